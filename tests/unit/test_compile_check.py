"""``zerolayer compile-check``: the start-up validation of precompiled prompts as a command, on
TOML, JSON, plain text and stdin, with its exit status."""

from __future__ import annotations

import argparse
import io
import json
import subprocess
import sys
from pathlib import Path

import pytest

from zerolayer.cli.compile_check import add_compile_check_subparser
from zerolayer.config.settings import Settings
from zerolayer.request_path.prompts import system_ids
from zerolayer.tokenizer import ByteTokenizer

ROOT = Path(__file__).resolve().parents[2]
DATED = '{"system":"You are a helpful assistant on {date}"}'
DATED_ERROR = "ERROR: dynamic variable {date} not allowed in compiled prompt"
TERSE = "You are terse."
TERSE_TOKENS = len(system_ids(ByteTokenizer(), TERSE))


@pytest.fixture(autouse=True)
def _byte_tokenizer_unless_told(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without --model or --config, compile-check counts with the default config's model
    (SmolLM2); these tests count with the byte tokenizer, which an empty model.path selects."""
    monkeypatch.setenv("ZEROLAYER_MODEL__PATH", "")


def check(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, list[str], str]:
    parser = argparse.ArgumentParser(prog="zerolayer")
    add_compile_check_subparser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["compile-check", *argv])
    code = args.func(args)
    out, err = capsys.readouterr()
    return code, out.splitlines(), err


def write(path: Path, content: str | bytes) -> str:
    if isinstance(content, bytes):
        path.write_bytes(content)
    else:
        path.write_text(content)
    return str(path)


def test_the_dated_json_example_is_rejected_with_the_exact_message(tmp_path, capsys) -> None:
    code, out, err = check([write(tmp_path / "p.json", DATED)], capsys)
    assert code == 1
    assert out == [DATED_ERROR]
    assert "built-in byte tokenizer" in err  # says how tokens were counted


def test_json_with_a_static_system_passes(tmp_path, capsys) -> None:
    path = write(tmp_path / "p.json", json.dumps({"system": TERSE, "max_tokens": 5}))
    assert check([path], capsys)[:2] == (0, [f"OK system: {TERSE_TOKENS} tokens"])


def test_json_without_a_system_field_is_a_usage_error(tmp_path, capsys) -> None:
    code, out, err = check([write(tmp_path / "p.json", '{"prompt": "hi"}')], capsys)
    assert code == 2 and out == []
    assert "needs a string field 'system'" in err
    code, _, err = check([write(tmp_path / "q.json", "{nope")], capsys)
    assert code == 2 and "not valid JSON" in err


def test_plain_text(tmp_path, capsys) -> None:
    assert check([write(tmp_path / "p.txt", TERSE + "\n")], capsys)[:2] == (
        0,
        [f"OK system: {TERSE_TOKENS} tokens"],  # the file's final line break is not counted
    )
    code, out, _ = check([write(tmp_path / "q.txt", "Hello {{user}}!")], capsys)
    assert (code, out) == (1, ["ERROR: dynamic variable {{user}} not allowed in compiled prompt"])
    code, out, _ = check([write(tmp_path / "long.txt", "a" * 4097)], capsys)
    assert code == 1
    assert out[0] == "ERROR: prompt is 4097 characters; the limit is 4096"
    code, out, _ = check([write(tmp_path / "empty.txt", "\n")], capsys)
    assert (code, out) == (1, ["ERROR: empty prompt"])


def test_invalid_utf8_is_rejected(tmp_path, capsys) -> None:
    code, out, _ = check([write(tmp_path / "p.txt", b"ok \xff\xfe bad")], capsys)
    assert code == 1
    assert out == ["ERROR: invalid UTF-8 at byte 3: invalid start byte"]


def test_stdin(monkeypatch, capsys) -> None:
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(DATED.encode())))
    assert check(["-"], capsys)[:2] == (1, [DATED_ERROR])
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(TERSE.encode())))
    assert check(["-"], capsys)[:2] == (0, [f"OK system: {TERSE_TOKENS} tokens"])


TOML = """
[engine]
backend = "cpu"

[[prompts]]
id = 1
name = "terse"
text = "You are terse."

[[prompts]]
id = 2
name = "dated"
text = "Today is {current_date}."

[[prompts]]
id = 3
name = "from-file"
file = "prompts/long.txt"
"""


def test_toml_reports_each_prompt_by_name(tmp_path, capsys) -> None:
    (tmp_path / "prompts").mkdir()
    write(tmp_path / "prompts" / "long.txt", "Be brief. " * 10)
    code, out, _ = check([write(tmp_path / "zl.toml", TOML)], capsys)
    assert code == 1
    file_tokens = len(system_ids(ByteTokenizer(), ("Be brief. " * 10)))
    assert out == [
        f"OK terse: {TERSE_TOKENS} tokens",
        'ERROR: dynamic variable {current_date} not allowed in compiled prompt (prompt 2 "dated")',
        f"OK from-file: {file_tokens} tokens",
    ]


def test_toml_all_good_exits_zero_and_bad_tables_are_named(tmp_path, capsys) -> None:
    good = '[[prompts]]\nid = 1\nname = "a"\ntext = "A."\n'
    assert check([write(tmp_path / "a.toml", good)], capsys)[0] == 0
    bad = good + '[[prompts]]\nid = 0\nname = "b"\ntext = "B."\n'
    code, out, _ = check([write(tmp_path / "b.toml", bad)], capsys)
    assert code == 1
    assert out[0].startswith("ERROR: prompts[1]: id: Input should be greater than or equal to 1")
    dup = good + '[[prompts]]\nid = 1\nname = "b"\ntext = "B."\n'
    code, out, _ = check([write(tmp_path / "c.toml", dup)], capsys)
    assert code == 1 and 'ERROR: id 1 is also used by prompt 1 "a" (prompt 1 "b")' in out
    code, out, _ = check([write(tmp_path / "d.toml", "[engine]\n")], capsys)
    assert code == 1 and out == ["ERROR: d.toml has no [[prompts]] entries"]
    code, _, err = check([write(tmp_path / "e.toml", "[[prompts]\n")], capsys)
    assert code == 2 and "not valid TOML" in err


def test_token_budget(tmp_path, capsys) -> None:
    path = write(tmp_path / "p.txt", TERSE)
    assert check([path, "--max-prefix-tokens", str(TERSE_TOKENS)], capsys)[0] == 0
    code, out, _ = check([path, "--max-prefix-tokens", str(TERSE_TOKENS - 1)], capsys)
    assert code == 1
    assert out == [
        f"ERROR: prompt is {TERSE_TOKENS} tokens; the prefix budget is {TERSE_TOKENS - 1} "
        "tokens (engine.max_prefix_tokens)"
    ]
    # 1,100 characters are fine by length but over the default budget of 1024 tokens.
    code, out, _ = check([write(tmp_path / "big.txt", "word " * 220)], capsys)
    assert code == 1 and "the prefix budget is 1024 tokens" in out[0]


def test_model_tokenizer_is_used_when_given(tmp_path, capsys) -> None:
    from tests.support.checkpoint import write_checkpoint

    pytest.importorskip("transformers")
    write_checkpoint(tmp_path)
    path = write(tmp_path / "p.txt", "you are a terse assistant")
    code, out, err = check([path, "--model", str(tmp_path)], capsys)
    # BOS, <|system|>, 5 words, <|end|>: far fewer than the byte tokenizer's count.
    assert (code, out) == (0, ["OK system: 8 tokens"])
    assert "byte tokenizer" not in err
    code, _, err = check([path, "--model", str(tmp_path / "nowhere")], capsys)
    assert code == 2 and "tokenizer.json is missing" in err


def test_config_supplies_tokenizer_and_budget(tmp_path, capsys) -> None:
    config = write(tmp_path / "zl.toml", '[engine]\nbackend = "synthetic"\n')
    path = write(tmp_path / "p.txt", TERSE)
    code, out, err = check([path, "--config", config], capsys)
    assert (code, out) == (0, [f"OK system: {TERSE_TOKENS} tokens"])
    assert "byte tokenizer" not in err
    code, _, err = check([path, "--config", str(tmp_path / "missing.toml")], capsys)
    assert code == 2 and "config file not found" in err


def test_missing_input_is_a_usage_error(tmp_path, capsys) -> None:
    code, _, err = check([str(tmp_path / "nope.txt")], capsys)
    assert code == 2 and "cannot read" in err


def test_without_file_or_config_the_built_in_configs_prompts_are_checked(capsys) -> None:
    # Like `serve` without --config: the built-in defaults, which register no prompts.
    code, out, _ = check([], capsys)
    assert code == 1
    assert out == [
        "ERROR: the built-in configuration (no --config given) has no [[prompts]] entries"
    ]


def test_without_config_the_environment_still_applies(tmp_path, capsys, monkeypatch) -> None:
    # Regression: compile-check without --config ignored ZEROLAYER_* (serve does not): a model
    # path set only in the environment must be the tokenizer that counts.
    monkeypatch.setenv("ZEROLAYER_MODEL__PATH", str(tmp_path / "no-such-model"))
    code, _, err = check([write(tmp_path / "p.json", json.dumps({"system": TERSE}))], capsys)
    assert code == 2
    assert "no-such-model" in err
    monkeypatch.setenv("ZEROLAYER_ENGINE__MAX_PREFIX_TOKENS", "3")
    monkeypatch.setenv("ZEROLAYER_MODEL__PATH", "")
    code, out, _ = check([write(tmp_path / "q.json", json.dumps({"system": TERSE}))], capsys)
    assert code == 1 and "3" in out[0]


@pytest.mark.skipif(
    "prompts" not in Settings.model_fields, reason="Settings has no prompts field yet"
)
def test_config_prompts_are_checked_when_no_file_is_given(tmp_path, capsys) -> None:
    config = write(
        tmp_path / "zl.toml",
        '[engine]\nbackend = "synthetic"\n[[prompts]]\nid = 1\nname = "a"\ntext = "A {b}"\n',
    )
    code, out, _ = check(["--config", config], capsys)
    assert (code, out) == (
        1,
        ['ERROR: dynamic variable {b} not allowed in compiled prompt (prompt 1 "a")'],
    )


def run_command(module_args: list[str], stdin: bytes) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", *module_args],
        input=stdin,
        capture_output=True,
        cwd=ROOT,
        timeout=60,
    )


def test_process_exit_status_and_output_on_stdin() -> None:
    bad = run_command(["zerolayer.cli.compile_check", "-"], DATED.encode())
    assert bad.returncode == 1
    assert bad.stdout.decode().splitlines() == [DATED_ERROR]
    good = run_command(["zerolayer.cli.compile_check", "-"], TERSE.encode())
    assert good.returncode == 0, good.stderr


def test_zerolayer_command_once_wired() -> None:
    from zerolayer.cli.main import build_parser

    parser = build_parser()
    try:
        parser.parse_args(["compile-check", "-"])
    except SystemExit:
        pytest.skip("compile-check is not registered in zerolayer.cli.main yet")
    bad = run_command(["zerolayer.cli.main", "compile-check", "-"], DATED.encode())
    assert (bad.returncode, bad.stdout.decode().splitlines()) == (1, [DATED_ERROR])
