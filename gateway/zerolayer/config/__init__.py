"""The daemon's settings: ``settings.py`` (the TOML file, ``ZEROLAYER_*`` variables and flags), with
the hook chain's (``hooks.py``) and the registered prompts' (``prompts.py``) sections."""
