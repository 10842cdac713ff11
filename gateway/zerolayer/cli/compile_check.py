"""``zerolayer compile-check``: validate system prompts for precompilation, with the tokenizer
and budget the daemon would use (the same configuration file and environment as ``serve``).

The command lives beside the CLI, apart from the runtime registry (zerolayer.request_path.prompts),
so that zerolayer.config.settings can import the prompt schema without an import cycle.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from zerolayer.config.prompts import PromptEntry
from zerolayer.request_path.prompts import (
    DEFAULT_MAX_PREFIX_TOKENS,
    MAX_PROMPT_CHARS,
    _file_text,
    _pydantic_reasons,
    check_entries,
    decode_utf8,
)
from zerolayer.tokenizer import Tokenizer

if sys.version_info >= (3, 11):
    import tomllib
else:  # Python 3.10
    import tomli as tomllib


# What the configuration is called in messages when no --config is given (``serve`` then runs
# on the built-in defaults and the environment too).
BUILT_IN_CONFIG = "the built-in configuration (no --config given)"


class _UsageError(Exception):
    """Input compile-check cannot read at all (exit status 2)."""


def _read_input(file: str) -> tuple[bytes, str, Path]:
    """(bytes, display name, base directory for relative prompt files)."""
    if file == "-":
        return sys.stdin.buffer.read(), "stdin", Path.cwd()
    path = Path(file)
    try:
        return path.read_bytes(), path.name, path.resolve().parent
    except OSError as exc:
        raise _UsageError(f"cannot read {file}: {exc.strerror or exc}") from exc


def _parse_input(data: bytes, name: str, suffix: str) -> tuple[list[Any], bool] | str:
    """(raw prompt tables or single texts, whether it was TOML), or the UTF-8 problem."""
    text, problem = decode_utf8(data)
    if text is None:
        return problem or "invalid UTF-8"
    stripped = text.lstrip()
    if suffix == ".json" or (suffix != ".toml" and stripped.startswith("{")):
        try:
            obj = json.loads(text)
        except ValueError as exc:
            if suffix == ".json":
                raise _UsageError(f"{name} is not valid JSON: {exc}") from exc
            obj = None
        if isinstance(obj, dict):
            if not isinstance(obj.get("system"), str):
                raise _UsageError(f"{name}: a JSON input needs a string field 'system'")
            return [obj["system"]], False
        if suffix == ".json":
            raise _UsageError(f"{name}: a JSON input must be an object with a 'system' field")
    if suffix == ".toml" or "[[prompts]]" in text:
        try:
            doc = tomllib.loads(text)
        except tomllib.TOMLDecodeError as exc:
            if suffix == ".toml":
                raise _UsageError(f"{name} is not valid TOML: {exc}") from exc
            doc = None
        if doc is not None:
            tables = doc.get("prompts", [])
            if not isinstance(tables, list):
                raise _UsageError(f"{name}: 'prompts' must be an array of tables ([[prompts]])")
            return tables, True
    return [_file_text(text)], False


def _load_tokenizer(args: argparse.Namespace) -> tuple[Tokenizer, int, Any, str]:
    """(tokenizer, max_prefix_tokens, settings, the configuration's name) from --model /
    --config."""
    # The daemon's effective configuration (file and ZEROLAYER_* environment), as `serve` sees
    # it: without --config, the built-in defaults, like `serve` without --config.
    from zerolayer.config.settings import ConfigError, load_settings

    config = str(Path(args.config)) if args.config else BUILT_IN_CONFIG
    try:
        settings = load_settings(args.config)
    except ConfigError as exc:
        raise _UsageError(str(exc)) from exc
    max_tokens = args.max_prefix_tokens
    if max_tokens is None:
        max_tokens = getattr(settings.engine, "max_prefix_tokens", DEFAULT_MAX_PREFIX_TOKENS)
    path = args.model
    if path is None:
        if settings.engine.backend == "synthetic":
            from zerolayer.tokenizer import ByteTokenizer

            return ByteTokenizer(settings.engine.synthetic_vocab_size), max_tokens, settings, config
        path = settings.model.path
    if path:
        from zerolayer.config.settings import ModelConfig
        from zerolayer.models.loader import ModelLoadError, load_tokenizer

        try:
            tokenizer = load_tokenizer(ModelConfig(path=path, data_dir=settings.model.data_dir))
            return tokenizer, max_tokens, settings, config
        except ModelLoadError as exc:
            raise _UsageError(str(exc)) from exc
    from zerolayer.models.builtin import builtin_tokenizer

    print(
        f"note: counting tokens with the built-in byte tokenizer (model.path is empty in "
        f"{config} and the environment); pass --model PATH to count with another model's",
        file=sys.stderr,
    )
    return builtin_tokenizer(), max_tokens, settings, config


def run_compile_check(args: argparse.Namespace) -> int:
    """``zerolayer compile-check``: 0 when every prompt passes, 1 when one fails, 2 when the
    input or the tokenizer cannot be read."""
    try:
        tokenizer, max_tokens, settings, config = _load_tokenizer(args)
        if args.file is None:
            if not hasattr(settings, "prompts"):
                raise _UsageError("this build's configuration has no [[prompts]] key")
            tables: list[Any] = [e.model_dump() for e in settings.prompts]
            is_toml, name = True, config
            # As the daemon reads them: relative to the config file, else the working directory.
            base_dir = Path(args.config).resolve().parent if args.config else Path.cwd()
        else:
            data, name, base_dir = _read_input(args.file)
            parsed = _parse_input(data, name, Path(args.file).suffix.lower())
            if isinstance(parsed, str):
                print(f"ERROR: {parsed}")
                return 1
            tables, is_toml = parsed
    except _UsageError as exc:
        print(f"zerolayer compile-check: {exc}", file=sys.stderr)
        return 2
    if not is_toml:
        entries = [PromptEntry(id=1, name="system", text=tables[0])]
        bad_tables: list[str] = []
    else:
        entries, bad_tables = [], []
        for i, raw in enumerate(tables):
            try:
                entries.append(PromptEntry.model_validate(raw))
            except ValidationError as exc:
                bad_tables.append(f"ERROR: prompts[{i}]: {_pydantic_reasons(exc)}")
        if not tables:
            print(f"ERROR: {name} has no [[prompts]] entries")
            return 1
    for line in bad_tables:
        print(line)
    failed = bool(bad_tables)
    for c in check_entries(entries, tokenizer, base_dir=base_dir, max_prefix_tokens=max_tokens):
        # Single-prompt inputs (JSON, plain text) print bare reasons; TOML names the prompt.
        where = f" (prompt {c.entry.label})" if is_toml else ""
        if c.problems:
            failed = True
            for problem in c.problems:
                print(f"ERROR: {problem}{where}")
        else:
            assert c.ids is not None
            print(f"OK {c.entry.name}: {len(c.ids)} tokens")
    return 1 if failed else 0


def add_compile_check_subparser(subparsers: Any) -> None:
    """Register ``compile-check`` on the ``zerolayer`` command's subparsers."""
    cc = subparsers.add_parser(
        "compile-check",
        help="validate precompiled system prompts the way daemon start-up does",
        description=(
            "Validate precompiled prompts: no template variables, at most "
            f"{MAX_PROMPT_CHARS} characters, valid UTF-8, not empty, within the prefix token "
            "budget. Exit status 0 only when every prompt passes."
        ),
    )
    cc.add_argument(
        "file",
        nargs="?",
        default=None,
        help="TOML with [[prompts]], a JSON object with a 'system' field, or plain text; "
        "- reads stdin; omitted: the daemon config's own prompts",
    )
    cc.add_argument(
        "--model",
        default=None,
        help="model whose tokenizer to use: checkpoint directory, .gguf file, @smollm2, @builtin",
    )
    cc.add_argument(
        "--config",
        default=None,
        help="daemon config (default as for serve; ZEROLAYER_* environment applies): its "
        "model's tokenizer, token budget and prompts",
    )
    cc.add_argument(
        "--max-prefix-tokens",
        type=int,
        default=None,
        help=f"token budget per prompt (default: the config's, else {DEFAULT_MAX_PREFIX_TOKENS})",
    )
    cc.set_defaults(func=run_compile_check)


def main(argv: list[str] | None = None) -> int:
    """``python -m zerolayer.cli.compile_check FILE``: compile-check without the zerolayer
    command."""
    parser = argparse.ArgumentParser(prog="zerolayer")
    add_compile_check_subparser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["compile-check", *(sys.argv[1:] if argv is None else argv)])
    code: int = args.func(args)  # argparse's Namespace is untyped: the handler returns an int
    return code


if __name__ == "__main__":
    sys.exit(main())
