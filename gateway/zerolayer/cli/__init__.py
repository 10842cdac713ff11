"""The ``zerolayer`` command: ``main.py`` dispatches its subcommands (serve, generate, chat, models,
config, keys, bench, compile-check)."""
