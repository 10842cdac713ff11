"""``zerolayer chat`` in a pseudo-terminal against a real daemon (synthetic backend): a two-turn
conversation that keeps its history, /system, /reset, multi-line input, Ctrl-C stopping an
answer (cancelled on the server: its slot is free again) without leaving, and /exit."""

from __future__ import annotations

import os
import sys
import time

from benchmarks._support.daemon import ROOT, Daemon
from benchmarks._support.metrics import scrape, value
from tests.support.ptyproc import PtyProcess


def _chat(d: Daemon, *argv: str) -> PtyProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ZEROLAYER_")}
    cmd = [sys.executable, "-m", "gateway.cli", "chat", "--endpoint", d.endpoint, *argv]
    return PtyProcess(cmd, str(ROOT), {**env, "TERM": "dumb"})


def _prompt_tokens(d: Daemon) -> float:
    return value(scrape(d.metrics_url), "zerolayer_prompt_tokens_total", api="frames")


def test_two_turns_history_system_reset_multiline_and_exit():
    with Daemon() as d:
        chat = _chat(d, "--max-tokens", "8", "--temperature", "0")
        try:
            chat.expect("connected to")
            chat.expect(">>> ")
            chat.send("Hello there\r")
            first = chat.expect(">>> ")
            assert len(first.strip()) >= 4  # the answer streamed (the synthetic model: letters)
            one = _prompt_tokens(d)
            chat.send("And again\r")
            chat.expect(">>> ")
            two = _prompt_tokens(d) - one
            assert two > one  # the second request carried the first turn too (the history)
            chat.send("/system Be terse.\r")
            chat.expect("(system prompt set)")
            chat.send("/reset\r")
            chat.expect("(conversation cleared)")
            chat.expect(">>> ")
            before = _prompt_tokens(d)
            chat.send('"""line one\r')
            chat.expect("... ")
            chat.send('line two"""\r')
            chat.expect(">>> ")
            three = _prompt_tokens(d) - before
            assert 0 < three < two  # after /reset: no history, only the system and two lines
            chat.send("/exit\r")
            assert chat.wait() == 0
        finally:
            chat.kill()


def test_ctrl_c_stops_the_answer_on_the_server_and_the_session_goes_on():
    with Daemon({"ENGINE__SYNTHETIC_STEP_MS": "30"}) as d:
        chat = _chat(d, "--max-tokens", "1500")  # 45 s at 30 ms a token: stopped long before
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
            deadline = time.monotonic() + 30
            while value(scrape(d.metrics_url), "zerolayer_num_requests_running") > 0:
                assert time.monotonic() < deadline, "the cancelled request still runs"
                time.sleep(0.05)
            chat.send("/max\r")  # still in the session
            chat.expect("unknown command /max")
            chat.send("/reset\r")
            chat.expect("(conversation cleared)")
            chat.send(b"\x04")  # Ctrl-D at the prompt leaves
            assert chat.wait() == 0
        finally:
            chat.kill()
