"""The ``zerolayer`` command as an operator meets it: one-line errors (tracebacks only with
--debug), help text on every option, the README's commands block equal to ``--help``, the
request ``generate`` sends, and terminal-safe output. No daemon here (tests/e2e/test_cli.py)."""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from zerolayer.cli.main import (
    COMMANDS,
    build_parser,
    generate_request,
    settings_endpoint,
    terminal_safe,
)
from zerolayer.config.settings import Settings

ROOT = Path(__file__).resolve().parents[2]


def run_cli(*argv: str, **env: str) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("ZEROLAYER_")}
    return subprocess.run(
        [sys.executable, "-m", "zerolayer.cli.main", *argv],
        cwd=ROOT,
        env={**clean, **env},
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_readme_commands_block_is_the_help_epilog() -> None:
    readme = (ROOT / "README.md").read_text()
    block = re.search(r"## Commands\n\n```\n(.*?)\n```", readme, re.S)
    assert block is not None
    assert block.group(1) == COMMANDS
    assert COMMANDS in build_parser().format_help()


def _parsers(parser: argparse.ArgumentParser) -> list[tuple[str, argparse.ArgumentParser]]:
    found = [(parser.prog, parser)]
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                found += _parsers(sub)
    return found


def test_every_option_has_help_text() -> None:
    missing = [
        f"{prog} {action.dest}"
        for prog, parser in _parsers(build_parser())
        for action in parser._actions
        if not isinstance(action, (argparse._HelpAction, argparse._SubParsersAction))
        and not action.help
    ]
    assert missing == []


def _generate_args(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(["generate", *argv])


def test_generate_sends_chat_by_default_and_text_with_raw() -> None:
    chat = generate_request(_generate_args("What is the capital of France?"))
    assert chat == {
        "max_tokens": 64,
        "temperature": 0.0,
        "messages": [{"role": "user", "content": "What is the capital of France?"}],
    }
    raw = generate_request(_generate_args("--raw", "--max-tokens", "5", "Once upon"))
    assert raw == {"max_tokens": 5, "temperature": 0.0, "prompt": "Once upon"}
    for mode in ((), ("--raw",)):
        req = generate_request(
            _generate_args(*mode, "--system", "Be terse.", "--prompt-id", "3", "--seed", "7", "x")
        )
        assert (req["system"], req["prompt_id"], req["seed"]) == ("Be terse.", 3, 7)


def test_terminal_output_escapes_control_characters() -> None:
    assert terminal_safe("a\x0fb\x03c\x1b[2Jd\x7f\x9b") == "a\\x0fb\\x03c\\x1b[2Jd\\x7f\\x9b"
    assert terminal_safe("line\n\ttab é 猫 🙂") == "line\n\ttab é 猫 🙂"


@pytest.mark.parametrize(
    ("argv", "env", "status", "line"),
    [
        (
            ["config"],
            {"ZEROLAYER_HOOKS__MODULES": "my_hooks"},
            2,
            "zerolayer: environment variable ZEROLAYER_HOOKS__MODULES='my_hooks': not a valid "
            "value for 'hooks'; lists and tables are written as JSON, e.g. "
            "ZEROLAYER_HOOKS__MODULES='[\"my_hooks\"]'",
        ),
        (
            ["config"],
            {"ZEROLAYER_SERVER__PORT": "seventy"},
            2,
            "zerolayer: invalid configuration: server.port: Input should be a valid integer, "
            "unable to parse string as an integer",
        ),
        (
            ["generate", "--endpoint", "http://127.0.0.1:8080/v1", "hi"],
            {},
            1,
            "zerolayer: endpoint must look like tcp://HOST:PORT or tls://HOST:PORT, got 'http://127.0.0.1:8080/v1'",
        ),
    ],
)
def test_user_errors_are_one_line_and_non_zero(
    argv: list[str], env: dict[str, str], status: int, line: str
) -> None:
    proc = run_cli(*argv, **env)
    assert (proc.returncode, proc.stderr) == (status, line + "\n")
    assert proc.stdout == ""


def test_debug_shows_the_traceback() -> None:
    for argv, env in (
        (["--debug", "config"], {"ZEROLAYER_SERVER__PORT": "seventy"}),
        (["config"], {"ZEROLAYER_SERVER__PORT": "seventy", "ZEROLAYER_DEBUG": "1"}),
    ):
        proc = run_cli(*argv, **env)
        assert proc.returncode != 0
        assert "Traceback (most recent call last)" in proc.stderr
        assert "server.port" in proc.stderr


def test_an_unknown_section_in_the_environment_stops_the_start() -> None:
    # Regression: ZEROLAYER_<SECTION>__KEY for a section that does not exist was ignored.
    proc = run_cli("serve", ZEROLAYER_TSL__CERT_FILE="/etc/cert.pem")
    assert proc.returncode == 2
    assert proc.stderr.startswith(
        "zerolayer: environment variable ZEROLAYER_TSL__CERT_FILE: no configuration section "
        "or key 'tsl' (known: auth, cache, "
    )
    assert proc.stderr.count("\n") == 1


def test_the_user_error_list_names_real_exception_classes() -> None:
    import importlib

    from zerolayer.cli.main import _USER_ERRORS

    for module, name in _USER_ERRORS:
        assert issubclass(getattr(importlib.import_module(module), name), Exception)


def test_serve_flags_win_over_environment_and_file_in_zerolayer_config() -> None:
    out = run_cli(
        "config", "@builtin", "--port", "9000", "--http-port", "9001", "--dtype", "bfloat16",
        "--max-batch-size", "3", "--max-context", "512", "--api-key", "k1", "--api-key", "k2",
        "--log-format", "json", "--host", "127.0.0.5",
        ZEROLAYER_SERVER__PORT="1111", ZEROLAYER_HTTP__PORT="2222", ZEROLAYER_METRICS__PORT="3333",
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    cfg = json.loads(out.stdout)
    assert cfg["server"]["port"] == 9000 and cfg["http"]["port"] == 9001  # flag over env
    assert cfg["metrics"]["port"] == 3333  # env over file, no flag
    assert cfg["server"]["host"] == cfg["http"]["host"] == "127.0.0.5"
    assert cfg["model"]["path"] == "@builtin" and cfg["model"]["dtype"] == "bfloat16"
    assert cfg["engine"]["max_batch_size"] == 3 and cfg["engine"]["max_context"] == 512
    assert cfg["auth"]["enabled"] is True and cfg["auth"]["api_keys"] == ["***", "***"]
    assert "k1" not in out.stdout and cfg["logging"]["json_lines"] is True
    bad = run_cli("config", "--port", "70000")
    assert bad.returncode == 2 and "server.port" in bad.stderr


def test_config_without_a_file_shows_the_built_in_defaults_from_any_directory(tmp_path) -> None:
    # What a wheel install meets: no configs/ anywhere near. stdout stays the JSON alone.
    clean = {k: v for k, v in os.environ.items() if not k.startswith("ZEROLAYER_")}
    proc = subprocess.run(
        [sys.executable, "-m", "zerolayer.cli.main", "config", "--port", "7171"],
        cwd=tmp_path,
        env={**clean, "ZEROLAYER_HTTP__PORT": "8181"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert (proc.returncode, proc.stderr) == (
        0,
        "configuration: built-in defaults (no --config given), ZEROLAYER_* variables and flags "
        "over them\n",
    )
    cfg = json.loads(proc.stdout)
    assert (cfg["server"]["port"], cfg["http"]["port"], cfg["metrics"]["port"]) == (
        7171,
        8181,
        9464,
    )
    assert cfg["model"]["path"] == "@smollm2"


def test_models_lists_each_model_once_and_other_caches_only_with_all(tmp_path) -> None:
    cached = tmp_path / "gguf" / "Tiny-0123456789abcdef-v2"
    cached.mkdir(parents=True)
    (cached / "model.safetensors").write_bytes(b"x" * 2048)
    (cached / "source.json").write_text('{"gguf": "/models/tiny.gguf"}')  # 29 bytes
    for version in ("builtin-v1", "builtin-v2"):  # two versions' weights: still one row
        (tmp_path / version).mkdir()
        (tmp_path / version / "model.safetensors").write_bytes(b"w" * 100)
    listed = run_cli("models", "--json", ZEROLAYER_MODEL__DATA_DIR=str(tmp_path))
    assert listed.returncode == 0, listed.stderr
    rows = json.loads(listed.stdout)
    names = [r["name"] for r in rows]
    assert names.count("@builtin") == 1 and str(cached) not in names
    smollm2 = next(r for r in rows if r["name"] == "@smollm2")
    assert smollm2["size_bytes"] > 50 * 2**20  # the installed wheel's GGUF file
    everything = run_cli("models", "--json", "--all", ZEROLAYER_MODEL__DATA_DIR=str(tmp_path))
    other = {r["name"]: r for r in json.loads(everything.stdout)}[str(cached)]
    assert other == {
        "name": str(cached), "kind": "converted", "size_bytes": 2048 + 29,
        "where": "/models/tiny.gguf", "cache": "",
    }  # fmt: skip
    # a cache of the listed @smollm2 file folds into its row
    mine = tmp_path / "gguf" / "SmolLM2-fedcba9876543210-v2"
    mine.mkdir()
    (mine / "model.safetensors").write_bytes(b"y")
    (mine / "source.json").write_text(json.dumps({"gguf": smollm2["where"]}))
    folded = json.loads(run_cli("models", "--json", ZEROLAYER_MODEL__DATA_DIR=str(tmp_path)).stdout)
    assert [r["name"] for r in folded] == names
    assert next(r for r in folded if r["name"] == "@smollm2")["cache"] == str(mine)
    long_name = tmp_path / "gguf" / ("L" * 70)  # columns fit the longest name
    long_name.mkdir()
    (long_name / "model.safetensors").write_bytes(b"z")
    text = run_cli("models", "--all", ZEROLAYER_MODEL__DATA_DIR=str(tmp_path)).stdout
    lines = text.splitlines()
    assert "@smollm2" in text and "MiB" in text and "2.0 KiB" in text
    kinds = {line.index(" converted ") for line in lines if " converted " in line}
    assert len(kinds) == 1 and kinds.pop() > 70  # one KIND column, after the longest name


def test_keys_list_shows_certificate_names(tmp_path) -> None:
    keys = str(tmp_path / "keys.toml")
    assert (
        run_cli("keys", "add", "alice", "--keys-file", keys, "--cert-name", "a.example").returncode
        == 0
    )
    assert run_cli("keys", "add", "bob", "--keys-file", keys).returncode == 0
    out = run_cli("keys", "list", "--keys-file", keys)
    assert out.returncode == 0, out.stderr
    head, alice, bob = out.stdout.splitlines()
    assert head.rstrip().endswith("CERT NAMES")
    assert alice.startswith("alice") and alice.rstrip().endswith("a.example")
    assert bob.startswith("bob") and bob.rstrip().endswith("-")


@pytest.mark.parametrize(
    ("server", "tls", "endpoint"),
    [
        ({}, {}, "tcp://127.0.0.1:7070"),
        ({"host": "0.0.0.0", "port": 7171}, {}, "tcp://127.0.0.1:7171"),
        ({"host": "::", "port": 7171}, {}, "tcp://[::1]:7171"),
        ({"host": "10.0.0.5"}, {"cert_file": "c.pem"}, "tls://10.0.0.5:7070"),
    ],
)
def test_the_cli_finds_the_daemon_from_its_settings(server, tls, endpoint) -> None:
    assert settings_endpoint(Settings(server=server, tls=tls)) == endpoint
