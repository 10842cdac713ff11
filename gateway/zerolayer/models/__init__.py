"""Model loading: checkpoint directories and GGUF files, their tokenizers, the built-in model
(``zerolayer.models.loader.load_model`` is the entry point the engine uses). The package imports
none of its modules: torch comes with the loader and the decoder only, so the parts a daemon
without a model uses (chat templates: ``zerolayer.models.templates``) import without it."""
