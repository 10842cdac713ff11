"""End-to-end: a real daemon process (synthetic backend) against the rules of docs/protocol.md.

These tests speak through tests/support/rawclient.py, written from the protocol document alone.
"""

from __future__ import annotations

import socket
import struct
import time
import urllib.request

import pytest

from benchmarks._support.daemon import Daemon
from tests.support import rawclient as rc

MALFORMED, TOO_LARGE, UNSUPPORTED, UNAUTH = 1, 2, 3, 4
OVERLOADED, INVALID, PROMPT_TOO_LONG, UNKNOWN_PROMPT = 6, 7, 8, 9
STREAM_IN_USE, TOO_MANY, IDLE, SHUTTING_DOWN, SLOW = 10, 11, 12, 13, 14


# One daemon for this module and the other of the same config (tests/conftest.py).
SHARED = {"ENGINE__SYNTHETIC_STEP_MS": "1", "ENGINE__MAX_CONTEXT": "65536"}


@pytest.fixture(scope="module")
def daemon(shared_daemon):
    return shared_daemon(SHARED)


def connect(d: Daemon, **kw) -> rc.RawConnection:
    return rc.RawConnection(d.host, d.port, **kw)


def expect_connection_error(conn: rc.RawConnection, code: int) -> str:
    f = conn.read_frame()
    assert f is not None, "server closed without an ERROR frame"
    ftype, _, stream, payload = f
    assert (ftype, stream) == (rc.ERROR, 0), f
    got, _, message = rc.parse_error(payload)
    assert got == code, message
    assert conn.closed(), "server must close after a stream-0 ERROR"
    return message


def test_hello_welcome_and_ping(daemon):
    conn = connect(daemon)
    conn.send(rc.hello())
    ftype, _, stream, payload = conn.read_frame()
    assert (ftype, stream) == (rc.WELCOME, 0)
    version, _, mfb, max_streams, vocab, eos, ctx = struct.unpack_from("<HHIIIiI", payload)
    assert (version, mfb, max_streams, vocab, ctx) == (1, 1048576, 256, 32000, 65536)
    assert payload[24:] == b"synthetic"
    conn.send(rc.frame(rc.PING, 0, b"abc"))
    assert conn.read_frame() == (rc.PONG, 0, 0, b"abc")
    conn.close()


def test_token_prompt_streams_to_max_tokens(daemon):
    conn = connect(daemon)
    conn.send(rc.request(1, [72, 105], 20))
    res = rc.collect(conn, {1})[1]
    assert res["done"]["finish_reason"] == 1
    assert res["done"]["completion_tokens"] == len(res["ids"]) == 20
    assert res["done"]["prompt_tokens"] == 2
    assert res["text"] == b"", "no text unless asked"
    d = res["done"]
    assert d["total_us"] >= d["ttft_us"] > 0
    conn.close()


def test_text_prompt_with_deltas_is_deterministic(daemon):
    conn = connect(daemon)
    conn.send(rc.request(1, b"hello", 30, text_deltas=True))
    conn.send(rc.request(2, b"hello", 30, text_deltas=True))
    res = rc.collect(conn, {1, 2})
    assert res[1]["ids"] == res[2]["ids"]
    assert res[1]["text"] == bytes(res[1]["ids"])  # byte-level tokenizer: one byte per id
    assert len(res[1]["text"]) == 30
    conn.close()


def test_json_chat_request(daemon):
    conn = connect(daemon)
    conn.send(
        rc.json_request(
            3,
            {
                "max_tokens": 12,
                "system": "Be terse.",
                "messages": [{"role": "user", "content": "Hi"}],
            },
        )
    )
    res = rc.collect(conn, {3})[3]
    assert res["done"]["finish_reason"] == 1
    assert len(res["text"]) == 12
    assert res["done"]["prompt_tokens"] > len("Be terse.Hi")  # template applied
    conn.close()


def test_stop_id_is_not_sent_or_counted(daemon):
    conn = connect(daemon)
    conn.send(rc.request(1, b"stop test", 50))
    first = rc.collect(conn, {1})[1]["ids"]
    stop = first[5]
    conn.send(rc.request(1, b"stop test", 50, stop_ids=[stop]))  # stream id reused after DONE
    res = rc.collect(conn, {1})[1]
    assert res["done"]["finish_reason"] == 2
    assert res["ids"] == first[: first.index(stop)]
    assert res["done"]["completion_tokens"] == len(res["ids"])
    conn.close()


def test_stop_sequence_cuts_text(daemon):
    conn = connect(daemon)
    conn.send(rc.json_request(1, {"max_tokens": 60, "prompt": "seq"}))
    text = rc.collect(conn, {1})[1]["text"].decode()
    stop = text[20:23]
    conn.send(rc.json_request(2, {"max_tokens": 60, "prompt": "seq", "stop_sequences": [stop]}))
    res = rc.collect(conn, {2})[2]
    assert res["done"]["finish_reason"] == 2
    assert res["text"].decode() == text[: text.index(stop)]
    assert res["done"]["completion_tokens"] == len(res["ids"])
    conn.close()


def test_bad_request_on_one_stream_leaves_others_running(daemon):
    conn = connect(daemon)
    conn.send(rc.request(1, b"a", 200))
    conn.send(rc.request(2, b"b", 0))  # max_tokens 0
    conn.send(rc.request(3, [1, 2, 99999999], 5))  # id outside the vocabulary
    conn.send(rc.request(4, b"x", 5, options=0x80))  # unknown option bit
    conn.send(rc.json_request(5, "{not json"))
    conn.send(rc.json_request(6, {"max_tokens": 3, "prompt": "a", "bogus": 1}))
    conn.send(rc.request(7, b"c", 10))
    res = rc.collect(conn, {1, 2, 3, 4, 5, 6, 7})
    for s in (2, 3, 4, 5, 6):
        assert res[s]["error"][0] == INVALID, res[s]
        assert res[s]["done"] is None
    assert res[1]["done"]["completion_tokens"] == 200
    assert res[7]["done"]["completion_tokens"] == 10
    assert all(r["ends"] == 1 for r in res.values())
    conn.close()


def test_prompt_too_long_and_unknown_prompt(daemon):
    conn = connect(daemon)
    conn.send(rc.request(1, [5] * 100, 65536))
    conn.send(rc.request(2, b"", 5, prompt_id=77))
    conn.send(rc.request(3, b"", 5))  # empty prompt without prompt_id
    res = rc.collect(conn, {1, 2, 3})
    assert res[1]["error"][0] == PROMPT_TOO_LONG
    assert res[2]["error"][0] == UNKNOWN_PROMPT
    assert res[3]["error"][0] == INVALID
    conn.close()


def test_cancel_ends_stream_with_cancelled(daemon):
    conn = connect(daemon)
    conn.send(rc.request(9, b"long", 60000))
    f = conn.read_frame()
    assert f[0] == rc.TOKEN
    conn.send(rc.frame(rc.CANCEL, 9))
    conn.send(rc.frame(rc.CANCEL, 12345))  # not in flight: ignored
    res = rc.collect(conn, {9})[9]
    assert res["done"]["finish_reason"] == 3
    assert res["done"]["completion_tokens"] == len(res["ids"]) + len(rc.parse_token(f[3])[0])
    conn.send(rc.frame(rc.PING, 0, b"still here"))
    assert conn.read_frame() == (rc.PONG, 0, 0, b"still here")
    conn.close()


@pytest.mark.parametrize(
    "data",
    [
        rc.frame(0x55, 0),  # unknown type
        rc.frame(rc.PING, 0, flags=0x02),  # unknown flag bit
        rc.frame(rc.PING, 0, reserved=1),  # reserved bits
        rc.frame(rc.TOKEN, 1, b"\0\0\0\0"),  # server-to-client type from a client
        rc.frame(rc.REQUEST, 0, b"\0" * 32),  # REQUEST on stream 0
        rc.frame(rc.CANCEL, 0),  # CANCEL on stream 0
        rc.frame(rc.PING, 5),  # PING on a stream
        rc.frame(rc.PING, 0, b"x" * 65),  # PING over 64 bytes
        rc.frame(rc.CANCEL, 3, b"x"),  # CANCEL with a payload
        rc.frame(rc.HELLO, 0, struct.pack("<HH", 1, 5) + b"ab"),  # key_len disagrees
        rc.frame(rc.PING, 0) + rc.hello(),  # HELLO after the first frame
    ],
    ids=[
        "unknown-type",
        "flag",
        "reserved",
        "direction",
        "request-stream0",
        "cancel-stream0",
        "ping-stream",
        "ping-size",
        "cancel-payload",
        "hello-keylen",
        "hello-late",
    ],
)
def test_malformed_frames_close_the_connection(daemon, data):
    conn = connect(daemon)
    conn.send(data)
    while True:
        f = conn.read_frame()
        assert f is not None
        if f[0] != rc.PONG:
            break
    ftype, _, stream, payload = f
    assert (ftype, stream) == (rc.ERROR, 0)
    assert rc.parse_error(payload)[0] == MALFORMED
    assert conn.closed()


def test_unsupported_version(daemon):
    conn = connect(daemon)
    conn.send(rc.hello(version=3))  # the server speaks 1 and 2
    expect_connection_error(conn, UNSUPPORTED)


def test_oversize_length_answered_without_payload(daemon):
    conn = connect(daemon)
    # Only the header: the server must answer without waiting for 2 MB that never come.
    conn.send(struct.pack("<IBBHI", 2 * 1048576, rc.REQUEST, 0, 0, 1))
    msg = expect_connection_error(conn, TOO_LARGE)
    assert "max_frame_bytes" in msg


def test_duplicate_stream_id_is_a_connection_error(daemon):
    conn = connect(daemon)
    conn.send(rc.request(4, b"x", 60000))
    conn.send(rc.request(4, b"y", 5))
    while True:
        f = conn.read_frame()
        assert f is not None
        if f[0] == rc.ERROR:
            break
        assert f[0] == rc.TOKEN and f[2] == 4
    assert f[2] == 0 and rc.parse_error(f[3])[0] == STREAM_IN_USE
    assert conn.closed()


def test_200_streams_on_one_connection(daemon):
    conn = connect(daemon)
    conn.send(b"".join(rc.request(s, b"s%d" % s, 16) for s in range(1, 201)))
    res = rc.collect(conn, set(range(1, 201)))
    assert all(
        r["done"] and r["done"]["completion_tokens"] == 16 == len(r["ids"]) for r in res.values()
    )
    assert all(r["ends"] == 1 for r in res.values())
    conn.close()


def test_50_connections(daemon):
    conns = [connect(daemon) for _ in range(50)]
    for i, c in enumerate(conns):
        c.send(rc.request(1, b"c%d" % i, 8) + rc.request(2, b"d%d" % i, 8))
    for c in conns:
        res = rc.collect(c, {1, 2})
        assert res[1]["done"]["completion_tokens"] == 8
        assert res[2]["done"]["completion_tokens"] == 8
        c.close()


def test_every_request_ends_exactly_once_under_mixed_load(daemon):
    conn = connect(daemon)
    frames = []
    for s in range(1, 121):
        kind = s % 4
        if kind == 0:
            frames.append(rc.request(s, b"ok", 30))
        elif kind == 1:
            frames.append(rc.request(s, b"", 5))  # invalid
        elif kind == 2:
            frames.append(rc.request(s, b"c", 60000))
            frames.append(rc.frame(rc.CANCEL, s))
        else:
            frames.append(rc.json_request(s, {"max_tokens": 4, "prompt": "j"}))
    conn.send(b"".join(frames))
    res = rc.collect(conn, set(range(1, 121)))
    assert all(r["ends"] == 1 for r in res.values())
    # Nothing arrives for an ended stream: PING round-trips with no stray frame before PONG.
    conn.send(rc.frame(rc.PING, 0, b"end"))
    assert conn.read_frame() == (rc.PONG, 0, 0, b"end")
    conn.close()


def test_a_daemon_without_a_model_serves_without_torch(daemon):
    # The synthetic backend's daemon imports no torch (seconds of CPU at each start; this suite
    # starts dozens): after every request above, none of torch's libraries is mapped.
    with open(f"/proc/{daemon.proc.pid}/maps") as fh:
        torch_libraries = {line.split()[-1] for line in fh if "libtorch" in line}
    assert not torch_libraries


def test_idle_timeout_closes_quiet_connection():
    with Daemon({"SERVER__IDLE_TIMEOUT_S": "1"}) as d:
        conn = connect(d)
        conn.send(rc.request(1, b"x", 3))
        rc.collect(conn, {1})
        t0 = time.monotonic()
        expect_connection_error(conn, IDLE)
        assert time.monotonic() - t0 >= 0.9  # counted from the end of the last stream
        # A connection that keeps pinging stays open past the timeout.
        conn = connect(d)
        for _ in range(4):
            conn.send(rc.frame(rc.PING, 0))
            assert conn.read_frame()[0] == rc.PONG
            time.sleep(0.4)
        conn.send(rc.request(1, b"x", 3))
        assert rc.collect(conn, {1})[1]["done"] is not None
        conn.close()


def test_stream_limits_and_overload():
    with Daemon(
        {
            "SERVER__MAX_STREAMS_PER_CONNECTION": "2",
            "ENGINE__MAX_BATCH_SIZE": "1",
            "ENGINE__MAX_QUEUE": "4",  # one client's fair share of it: 2
            "ENGINE__SYNTHETIC_STEP_MS": "5",
        }
    ) as d:
        conn = connect(d)
        conn.send(rc.request(1, b"a", 40) + rc.request(2, b"b", 40) + rc.request(3, b"c", 4))
        res = rc.collect(conn, {1, 2, 3})
        assert res[3]["error"][0] == TOO_MANY
        assert res[1]["done"] and res[2]["done"]
        # Queue of 4 behind one slot: the sixth concurrent request is refused with a hint.
        conns = [connect(d) for _ in range(6)]
        for c in conns:
            c.send(rc.request(1, b"q", 40))
        results = [rc.collect(c, {1})[1] for c in conns]
        refused = [r for r in results if r["error"]]
        assert refused, "a full queue must refuse"
        assert all(r["error"][0] == OVERLOADED and r["error"][1] > 0 for r in refused)
        assert sum(1 for r in results if r["done"]) >= 2  # the slot and the queue served


def test_slow_consumer_ends_streams_but_keeps_connection():
    with Daemon({"SERVER__WRITE_BUFFER_LIMIT_BYTES": "65536", "ENGINE__MAX_CONTEXT": "65536"}) as d:
        conn = connect(d, rcvbuf=4096)
        conn.send(b"".join(rc.request(s, b"flood", 60000) for s in range(1, 33)))
        # Do not read: once the kernel's buffers are full the server's passes the limit. Wait
        # for the server to report it (its metrics), however long the flood takes here.
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            text = urllib.request.urlopen(d.metrics_url + "/metrics", timeout=10).read()
            if b'zerolayer_request_errors_total{api="frames",code="SLOW_CONSUMER"} 32.0' in text:
                break
            time.sleep(0.5)
        res = rc.collect(conn, set(range(1, 33)))
        assert all(r["error"] and r["error"][0] == SLOW for r in res.values())
        conn.send(rc.frame(rc.PING, 0, b"alive"))
        assert conn.read_frame() == (rc.PONG, 0, 0, b"alive")
        # And other connections were served meanwhile.
        other = connect(d)
        other.send(rc.request(1, b"fine", 5))
        assert rc.collect(other, {1})[1]["done"]["completion_tokens"] == 5
        conn.close()
        other.close()


def test_sigterm_drains_streams_in_flight():
    with Daemon({"ENGINE__SYNTHETIC_STEP_MS": "5"}) as d:
        conn = connect(d)
        conn.send(rc.request(1, b"drain", 150) + rc.request(2, b"drain2", 150))
        assert conn.read_frame()[0] == rc.TOKEN
        d.proc.send_signal(15)
        seen_goaway = False
        tokens = {1: 1, 2: 0}
        done = {}
        while len(done) < 2:
            f = conn.read_frame()
            assert f is not None
            ftype, _, stream, payload = f
            if ftype == rc.GOAWAY:
                seen_goaway = True
                assert struct.unpack_from("<I", payload)[0] == 2
                conn.send(rc.request(3, b"late", 5))
            elif ftype == rc.TOKEN:
                tokens[stream] += len(rc.parse_token(payload)[0])
            elif ftype == rc.DONE:
                done[stream] = rc.parse_done(payload)
            elif ftype == rc.ERROR:
                assert stream == 3 and rc.parse_error(payload)[0] == SHUTTING_DOWN
        assert seen_goaway
        assert done[1]["completion_tokens"] == 150 and done[2]["completion_tokens"] == 150
        assert conn.closed(), "the server closes a drained connection"
        assert d.proc.wait(30) == 0
        # New connections are refused once draining finished.
        with pytest.raises(OSError):
            socket.create_connection((d.host, d.port), timeout=2)
