"""Replay the fuzz corpus (tests/fixtures/fuzz-corpus) against a real daemon: each input on a
fresh connection gets exactly the answer its file expects, never INTERNAL, never a hang, and the
daemon serves a normal request on another connection afterwards."""

from __future__ import annotations

import re
import struct

import pytest

from benchmarks._support import fuzzframes as ff
from benchmarks._support.daemon import Daemon
from tests.support import rawclient as rc

ERROR_CODES = {
    "MALFORMED_FRAME": 1,
    "FRAME_TOO_LARGE": 2,
    "INVALID_REQUEST": 7,
    "PROMPT_TOO_LONG": 8,
    "UNKNOWN_PROMPT": 9,
    "STREAM_IN_USE": 10,
}


@pytest.fixture(scope="module")
def daemon():
    with Daemon({"CACHE__ENABLED": "false"}) as d:
        yield d


def replay(d: Daemon, data: bytes, expect: str) -> None:
    conn = rc.RawConnection(d.host, d.port, timeout=4)
    conn.send(data)
    if expect == "closed":  # the client goes away mid-frame
        conn.close()
        return
    kind = expect.split()
    if kind[0] != "0":  # the connection must survive: a PING after it must be answered
        conn.send(rc.frame(rc.PING, 0, b"corpus"))
    stream = int(kind[0])
    ends: list[tuple[int, int]] = []  # (frame type, code) on the expected stream
    pong = False
    while True:
        try:
            f = conn.read_frame()
        except TimeoutError:
            raise AssertionError(f"no answer within 4 s (hang); so far {ends}") from None
        if f is None:
            break
        ftype, _, sid, payload = f
        if ftype == rc.ERROR:
            code = struct.unpack_from("<H", payload)[0]
            assert code != ff.INTERNAL, payload
            if sid == stream:
                ends.append((ftype, code))
        elif ftype == rc.DONE and sid == stream:
            ends.append((ftype, 0))
        elif ftype == rc.PONG:
            pong = True
        if stream and pong and ends:
            break
    if kind[1] == "DONE":
        assert ends == [(rc.DONE, 0)]
    else:
        assert ends == [(rc.ERROR, ERROR_CODES[kind[2]])], ends
    if stream == 0:
        assert conn.closed()
    conn.close()


def serves_normally(d: Daemon) -> None:
    conn = rc.RawConnection(d.host, d.port, timeout=4)
    conn.send(rc.request(1, [1, 2, 3], 5))
    assert rc.collect(conn, {1})[1]["done"]["completion_tokens"] == 5
    conn.close()


@pytest.mark.parametrize("path", ff.corpus_files(), ids=lambda path: path.stem)
def test_corpus_input(path, daemon):
    comment, data = ff.read_corpus(path)
    expect = re.search(r"^expect: (.+)$", comment, re.M).group(1)
    replay(daemon, data, expect)
    serves_normally(daemon)
