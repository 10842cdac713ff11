"""``zerolayer generate`` against a running daemon: the chat template by default, ``--raw`` text,
``--system`` in both, a registered prompt by ``--prompt-id``, the DONE record as JSON, one-line
server errors, and control characters escaped on a terminal (the built-in model emits them)."""

from __future__ import annotations

import json
import os
import pty
import subprocess
import sys

import pytest

from benchmarks._support.daemon import ROOT, Daemon
from zerolayer.config.settings import BUILTIN_MODEL
from zerolayer.tokenizer import ByteTokenizer

QUESTION = "What is the capital of France?"
TERSE = "You are terse."


def generate(
    endpoint: str, *argv: str, stdout: int = subprocess.PIPE
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "zerolayer.cli.main", "generate", "--endpoint", endpoint, *argv],
        cwd=ROOT,
        stdout=stdout,
        stderr=subprocess.PIPE,
        text=True,
        timeout=120,
    )


def done_record(proc: subprocess.CompletedProcess[str]) -> dict:
    assert proc.returncode == 0, proc.stderr
    (line,) = proc.stdout.splitlines()  # --json: exactly one object on stdout
    return json.loads(line)


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    config = tmp_path_factory.mktemp("cli") / "zl.toml"
    config.write_text(f'[[prompts]]\nid = 3\nname = "terse"\ntext = "{TERSE}"\n')
    with Daemon(config=str(config)) as d:
        yield d


def test_chat_template_by_default_raw_text_with_raw(daemon):
    tok = ByteTokenizer()  # the synthetic backend's tokenizer
    chat = done_record(generate(daemon.endpoint, "--json", "--max-tokens", "5", QUESTION))
    rendered = tok.render_chat([{"role": "user", "content": QUESTION}], None)
    assert chat["prompt_tokens"] == len(tok.encode_prompt(rendered))
    assert (chat["finish_reason"], chat["completion_tokens"]) == ("max_tokens", 5)
    assert len(chat["text"]) == 5 and set(chat) >= {"ttft_ms", "total_ms", "queue_ms", "cache"}
    raw = done_record(generate(daemon.endpoint, "--json", "--raw", "--max-tokens", "5", QUESTION))
    assert raw["prompt_tokens"] == len(tok.encode_prompt(QUESTION))
    assert raw["text"] != chat["text"]


def test_system_in_both_modes_and_a_registered_prompt_by_id(daemon):
    tok = ByteTokenizer()
    chat = done_record(generate(daemon.endpoint, "--json", "--system", TERSE, "Hi"))
    expected = tok.render_chat([{"role": "user", "content": "Hi"}], TERSE)
    assert chat["prompt_tokens"] == len(tok.encode_prompt(expected))
    raw = done_record(generate(daemon.endpoint, "--json", "--raw", "--system", TERSE, "Hi"))
    assert raw["prompt_tokens"] == len(tok.encode_prompt(tok.render_system(TERSE) + "Hi"))
    # The registered prompt 3 holds the same system text: the same prompt, the same answer.
    by_id = done_record(generate(daemon.endpoint, "--json", "--prompt-id", "3", "Hi"))
    assert (by_id["prompt_tokens"], by_id["text"]) == (chat["prompt_tokens"], chat["text"])


def test_server_errors_are_one_line(daemon):
    proc = generate(daemon.endpoint, "--prompt-id", "99", "Hi")
    assert proc.returncode == 1
    assert proc.stderr.startswith("zerolayer: UNKNOWN_PROMPT: ")
    assert proc.stderr.count("\n") == 1


def test_control_characters_are_escaped_on_a_terminal_only(tmp_path):
    env = {"ENGINE__BACKEND": "cpu", "MODEL__PATH": BUILTIN_MODEL, "MODEL__DATA_DIR": str(tmp_path)}
    with Daemon(env) as d:
        # Sampled with a fixed seed: the same bytes every run, control characters among them.
        argv = ("--raw", "--temperature", "1", "--seed", "1", "--max-tokens", "64", "hello")
        piped = generate(d.endpoint, *argv)
        assert piped.returncode == 0, piped.stderr
        controls = {c for c in piped.stdout if ord(c) < 0x20 and c not in "\n\t"}
        assert controls, "the built-in model's text should hold control characters"
        main, secondary = pty.openpty()
        try:
            proc = generate(d.endpoint, *argv, stdout=secondary)
            os.close(secondary)
            secondary = -1
            chunks = []
            while True:
                try:
                    chunk = os.read(main, 65536)
                except OSError:  # EIO: the other side is closed and drained
                    break
                if not chunk:
                    break
                chunks.append(chunk)
        finally:
            os.close(main)
            if secondary >= 0:
                os.close(secondary)
    assert proc.returncode == 0, proc.stderr
    shown = b"".join(chunks).decode()
    # The terminal driver turns "\n" into "\r\n"; nothing else below 0x20 but tab reaches it.
    assert {c for c in shown if ord(c) < 0x20} <= {"\r", "\n", "\t"}
    for c in controls:
        assert f"\\x{ord(c):02x}" in shown


def test_without_endpoint_the_daemon_is_found_from_its_settings(daemon):
    """The daemon runs on a free port; ZEROLAYER_SERVER__PORT alone tells generate where."""
    port = daemon.endpoint.rsplit(":", 1)[1]
    clean = {k: v for k, v in os.environ.items() if not k.startswith("ZEROLAYER_")}
    proc = subprocess.run(
        [sys.executable, "-m", "zerolayer.cli.main", "generate", "--json", "--max-tokens", "3",
         "Hi"],
        cwd=ROOT, env={**clean, "ZEROLAYER_SERVER__PORT": port},
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done_record(proc)["completion_tokens"] == 3
