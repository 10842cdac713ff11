"""Defects of the request path found in review, each tested over the wire against a real daemon
(they failed before the request path was made one): a request the engine cannot hold, a hook
refusing with an unknown code, and drain with a CANCEL while async hooks run."""

from __future__ import annotations

import json
import time
from pathlib import Path

from benchmarks._support.daemon import Daemon
from tests.support import rawclient as rc

INVALID_REQUEST, INTERNAL = 7, 15


def write_hook(tmp_path: Path, name: str, body: str) -> str:
    path = tmp_path / f"{name}.py"
    path.write_text("from zerolayer.hooks import HookError, hook\nimport asyncio\n\n" + body)
    return json.dumps([str(path)])


def test_a_top_k_beyond_int32_is_refused_and_harms_no_other_stream() -> None:
    with Daemon({"ENGINE__SYNTHETIC_STEP_MS": "2"}) as d:
        long = rc.RawConnection(d.host, d.port)
        long.send(rc.request(1, b"a long one", 300))
        assert long.read_frame()[0] == rc.TOKEN  # it runs ...
        bad = rc.RawConnection(d.host, d.port)
        bad.send(rc.request(5, b"x", 4, top_k=2**31) + rc.request(6, b"y", 4, top_k=2**32 - 1))
        res = rc.collect(bad, {5, 6})
        for stream in (5, 6):
            code, _, message = res[stream]["error"]
            assert code == INVALID_REQUEST and "top_k" in message
        res = rc.collect(long, {1})[1]  # ... and finishes with all its tokens
        assert res["done"]["completion_tokens"] == 300 and res["ends"] == 1
        bad.send(rc.request(7, b"fine", 3))
        assert rc.collect(bad, {7})[7]["done"]["completion_tokens"] == 3


def test_a_hook_refusing_with_an_unknown_code_ends_only_its_stream(tmp_path: Path) -> None:
    modules = write_hook(
        tmp_path,
        "odd_code",
        '@hook("on_request")\ndef refuse(ctx):\n'
        "    if ctx.max_tokens == 13:\n        raise HookError(99, 'custom refusal')\n",
    )
    with Daemon({"HOOKS__MODULES": modules}) as d:
        conn = rc.RawConnection(d.host, d.port)
        conn.send(rc.request(1, b"refused", 13) + rc.request(3, b"served", 5))
        res = rc.collect(conn, {1, 3})
        assert res[1]["error"][0] == INTERNAL and "custom refusal" in res[1]["error"][2]
        assert res[3]["done"]["completion_tokens"] == 5
        conn.send(rc.frame(rc.PING, 0, b"still here"))
        assert conn.read_frame()[0] == rc.PONG


def test_drain_closes_a_connection_whose_last_stream_is_cancelled_in_async_hooks(
    tmp_path: Path,
) -> None:
    # The hook holds every request for 60 s: the stream is in its hooks when CANCEL arrives.
    modules = write_hook(
        tmp_path, "slow", '@hook("on_request")\nasync def slow(ctx):\n    await asyncio.sleep(60)\n'
    )
    with Daemon({"HOOKS__MODULES": modules, "SERVER__DRAIN_TIMEOUT_S": "60"}) as d:
        conn = rc.RawConnection(d.host, d.port, timeout=20)
        conn.send(rc.request(1, b"held", 5))
        time.sleep(0.3)  # the hook is running
        d.proc.send_signal(15)
        assert conn.read_frame()[0] == rc.GOAWAY
        conn.send(rc.frame(rc.CANCEL, 1))
        res = rc.collect(conn, {1})[1]
        assert res["done"]["finish_reason"] == 3  # CANCELLED, at once
        # The drained connection closes now, not at the 60 s drain deadline (the read times
        # out after 20 s and fails the test).
        assert conn.closed()
