"""Model loading: Hugging Face Llama checkpoint directories, their tokenizers, and the built-in
model. ``load_model`` is the entry point the engine uses."""

from zerolayer.models.hf_tokenizer import HFTokenizer, TokenizerLoadError
from zerolayer.models.loader import LoadedModel, ModelLoadError, load_checkpoint, load_model

__all__ = [
    "HFTokenizer",
    "LoadedModel",
    "ModelLoadError",
    "TokenizerLoadError",
    "load_checkpoint",
    "load_model",
]
