"""The one error of reading a GGUF file: what the importer and the tokenizer builder raise when a
file is not one they convert (kept apart so neither module imports the other for it)."""


class GGUFImportError(Exception):
    """The file is not a GGUF this importer converts; the message names the file and what it
    holds."""
