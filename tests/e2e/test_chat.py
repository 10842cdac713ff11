"""``zerolayer chat`` in a pseudo-terminal against a real daemon (synthetic backend), over the
frame protocol and over the daemon's OpenAI HTTP API (``--endpoint http://``): a two-turn
conversation that keeps its history, /system, /reset, multi-line input, Ctrl-C stopping an
answer (cancelled on the server: its slot is free again) without leaving, and /exit.

Each check is against what the server saw (its metrics), not only the terminal: the answer's
length against the tokens the daemon generated, the history against the prompt tokens it was
sent, a stopped answer against its running streams."""

from __future__ import annotations

import os
import sys
import time

import pytest

from benchmarks._support.daemon import ROOT, Daemon
from benchmarks._support.metrics import scrape, value
from tests.support.ptyproc import PtyProcess

DOORS = {"frames": "frames", "http": "openai"}  # --endpoint kind → the metrics' api label


def _endpoint(d: Daemon, door: str) -> str:
    return d.endpoint if door == "frames" else d.http_url


def _chat(d: Daemon, door: str, *argv: str) -> PtyProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ZEROLAYER_")}
    cmd = [
        sys.executable,
        "-m",
        "zerolayer.cli.main",
        "chat",
        "--endpoint",
        _endpoint(d, door),
        *argv,
    ]
    return PtyProcess(cmd, str(ROOT), {**env, "TERM": "dumb"})


def _counter(d: Daemon, door: str, name: str) -> float:
    return value(scrape(d.metrics_url), name, api=DOORS[door])


@pytest.mark.parametrize("door", DOORS)
def test_two_turns_history_system_reset_multiline_and_exit(door):
    with Daemon() as d:
        chat = _chat(d, door, "--max-tokens", "8", "--temperature", "0")
        try:
            chat.expect("connected to")
            chat.expect(">>> ")
            chat.send("Hello there\r")
            chat.expect("Hello there")  # the terminal's echo of the line
            answer = chat.expect(">>> ").strip("\r\n")  # its spaces are tokens too
            generated = _counter(d, door, "zerolayer_generation_tokens_total")
            assert generated == 8  # the daemon streamed 8 tokens to this session ...
            assert len(answer) >= 6  # ... and they reached the terminal (one character each)
            one = _counter(d, door, "zerolayer_prompt_tokens_total")
            chat.send("And again\r")
            chat.expect(">>> ")
            two = _counter(d, door, "zerolayer_prompt_tokens_total") - one
            assert two > one + 8  # the second request carried the first turn and its answer
            chat.send("/system Be terse.\r")
            chat.expect("(system prompt set)")
            chat.send("/reset\r")
            chat.expect("(conversation cleared)")
            chat.expect(">>> ")
            before = _counter(d, door, "zerolayer_prompt_tokens_total")
            chat.send('"""line one\r')
            chat.expect("... ")
            chat.send('line two"""\r')
            chat.expect(">>> ")
            three = _counter(d, door, "zerolayer_prompt_tokens_total") - before
            assert 0 < three < two  # after /reset: no history, only the system and two lines
            chat.send("/exit\r")
            assert chat.wait() == 0
            assert b"Task was destroyed" not in chat.rest()  # a clean exit over both doors
        finally:
            chat.kill()


@pytest.mark.parametrize("door", DOORS)
def test_ctrl_c_stops_the_answer_on_the_server_and_the_session_goes_on(door):
    with Daemon({"ENGINE__SYNTHETIC_STEP_MS": "30"}) as d:
        chat = _chat(d, door, "--max-tokens", "1500")  # 45 s at 30 ms a token: stopped long before
        try:
            chat.expect(">>> ")
            chat.send("Tell me a very long story\r")
            deadline = time.monotonic() + 60
            while value(scrape(d.metrics_url), "zerolayer_num_requests_running") < 1:
                assert time.monotonic() < deadline, "the request never ran"
                time.sleep(0.05)
            time.sleep(0.3)
            chat.send(b"\x03")  # Ctrl-C: the terminal sends SIGINT to the chat
            chat.expect("[stopped]")
            chat.expect(">>> ")
            # the answer would run for 45 s: a stream gone within 30 s was stopped by the server
            deadline = time.monotonic() + 30
            while value(scrape(d.metrics_url), "zerolayer_num_requests_running") > 0:
                assert time.monotonic() < deadline, "the cancelled request still runs"
                time.sleep(0.05)
            chat.send("/max\r")  # still in the session
            chat.expect("unknown command /max")
            chat.send("/reset\r")
            chat.expect("(conversation cleared)")
            # Ctrl-D at the prompt leaves; typed ahead of it, the terminal (cooked until readline
            # takes it) drops a lone ^D and the chat waits on: so wait for the prompt first
            chat.expect(">>> ")
            chat.send(b"\x04")
            assert chat.wait() == 0
            assert b"Task was destroyed" not in chat.rest()  # an answer stopped mid-stream
        finally:
            chat.kill()


def test_an_http_endpoint_that_is_not_there_is_one_line_and_status_1():
    with Daemon() as d:
        port = d.http_url.rsplit(":", 1)[1]
    chat = PtyProcess(
        [sys.executable, "-m", "zerolayer.cli.main", "chat", "--endpoint", f"http://127.0.0.1:{port}"],
        str(ROOT), {**os.environ, "TERM": "dumb"},
    )  # fmt: skip
    try:
        assert chat.wait(60) == 1
        out = chat.output.decode()
        assert f"cannot reach http://127.0.0.1:{port}" in out and "Traceback" not in out
    finally:
        chat.kill()
