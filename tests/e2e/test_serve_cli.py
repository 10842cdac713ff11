"""``zerolayer serve MODEL --port --http-port ...`` as a new user types it, with the real default
model; ``--api-key`` turning auth on; ``SyncClient`` mirroring ``Client``; ``generate -``
reading the prompt from stdin."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from benchmarks._support.daemon import ROOT, Daemon, child_preexec, free_port, listening_fields
from benchmarks._support.metrics import scrape, value
from tests.support.smollm2 import SLOW_TIMEOUT_S, data_dir_of
from zerolayer.client import SyncClient, UnauthenticatedError


def _serve(*argv: str, env: dict[str, str] | None = None) -> tuple[subprocess.Popen, dict]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("ZEROLAYER_")}
    proc = subprocess.Popen(
        [sys.executable, "-m", "zerolayer.cli.main", "serve", *argv],
        cwd=ROOT, env={**clean, "ZEROLAYER_LOGGING__LEVEL": "warning", **(env or {})},
        stderr=subprocess.PIPE, text=True, preexec_fn=child_preexec(),
    )  # fmt: skip
    lines = []
    deadline = time.monotonic() + SLOW_TIMEOUT_S
    while time.monotonic() < deadline:
        line = proc.stderr.readline()
        if not line:
            break
        lines.append(line)
        fields = listening_fields(line)
        if fields is not None:
            threading.Thread(target=proc.stderr.read, daemon=True).start()  # keep draining
            return proc, fields
    proc.kill()
    raise AssertionError("serve did not start:\n" + "".join(lines))


def _stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


@pytest.mark.timeout(SLOW_TIMEOUT_S)
def test_serve_a_named_model_on_the_ports_given(smollm2_dir: Path):
    # The session's data dir (its conversion and kernel build), not the user's ~/.cache: what
    # is tested here is the command line, not a first conversion (tests/unit/test_gguf_import.py).
    frame, api = free_port(), free_port()
    env = {"ZEROLAYER_MODEL__DATA_DIR": data_dir_of(smollm2_dir)}
    proc, fields = _serve("@smollm2", "--port", str(frame), "--http-port", str(api),
                          "--metrics-port", "0", "--max-context", "512", env=env)  # fmt: skip
    try:
        assert fields["frame"].endswith(f":{frame}") and fields["http"].endswith(f":{api}")
        with urllib.request.urlopen(f"http://127.0.0.1:{api}/health", timeout=30) as r:
            assert r.status == 200
        with SyncClient(f"tcp://127.0.0.1:{frame}", "") as c:
            result = c.generate("The capital of France is", 12)  # raw text: a continuation
            assert result.completion_tokens > 0 and len(result.ids) == result.completion_tokens
            assert result.text
            chat = c.generate_json(
                {"messages": [{"role": "user", "content": "Hi!"}], "max_tokens": 8}
            )
            assert chat.completion_tokens > 0 and chat.text
            events = c.stream("Once upon a time", 6)
            texts = [e.text for e in events]
            assert texts and c.result is not None and c.result.completion_tokens == 6
            assert c.ping(b"abc") == b"abc"
    finally:
        _stop(proc)


def test_api_keys_from_the_command_line_turn_auth_on(tmp_path):
    env = {
        "ZEROLAYER_ENGINE__BACKEND": "synthetic",
        "ZEROLAYER_AUTH__KEYS_FILE": str(tmp_path / "none.toml"),
    }
    proc, fields = _serve("--port", "0", "--http-port", "0", "--metrics-port", "0",
                          "--api-key", "k-one", "--api-key", "k-two", env=env)  # fmt: skip
    try:
        endpoint = f"tcp://{fields['frame']}"
        with pytest.raises(UnauthenticatedError), SyncClient(endpoint, "wrong") as c:
            c.generate("hi", 2)
        with SyncClient(endpoint, "k-two") as c:
            assert c.generate("hi", 2).completion_tokens == 2
        req = urllib.request.Request(
            f"http://{fields['http']}/v1/completions", method="POST",
            data=json.dumps({"prompt": "hi", "max_tokens": 2}).encode(),
            headers={"content-type": "application/json"},
        )  # fmt: skip
        with pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.urlopen(req, timeout=30)
        assert err.value.code == 401
        req.add_header("authorization", "Bearer k-one")
        with urllib.request.urlopen(req, timeout=30) as r:
            assert json.loads(r.read())["usage"]["completion_tokens"] == 2
    finally:
        _stop(proc)


def test_sync_client_stream_left_early_is_cancelled_and_generate_reads_stdin():
    with Daemon({"ENGINE__SYNTHETIC_STEP_MS": "5"}) as d:
        with SyncClient(d.endpoint, "") as c:
            events = c.stream("hi", 1000)  # 5 s at 5 ms a token
            for n, _ in enumerate(events):
                if n == 3:
                    break
            events.close()  # leaving early: the generator's close sends CANCEL
            deadline = time.monotonic() + 30
            while value(scrape(d.metrics_url), "zerolayer_num_requests_running") > 0:
                assert time.monotonic() < deadline, "the stream left early still runs"
                time.sleep(0.05)
            assert c.generate("hi", 3).completion_tokens == 3  # the connection is fine
        text = "Hello there, my friend"

        def generate(*argv: str, stdin: str | None = None) -> dict:
            out = subprocess.run(
                [sys.executable, "-m", "zerolayer.cli.main", "generate", "--endpoint", d.endpoint,
                 "--json", "--max-tokens", "2", *argv],
                cwd=ROOT, input=stdin, capture_output=True, text=True, timeout=120,
            )  # fmt: skip
            assert out.returncode == 0, out.stderr
            return json.loads(out.stdout)

        from_stdin = generate("-", stdin=text + "\n")
        assert from_stdin["prompt_tokens"] == generate(text)["prompt_tokens"]
        assert from_stdin["prompt_tokens"] > generate("-", stdin="-")["prompt_tokens"]
