"""Issue #25: hostile clients on the HTTP and frame doors, each attack from another loopback
address (127.0.0.2 ...) than the canary it must not hurt (127.0.0.1). Each test fails on the
code before the fix: no reply / leaked connection, head accumulated unbounded, no HTTP
connection cap, anonymous HELLOs in one bucket, two responses to an Upgrade request."""

from __future__ import annotations

import os
import socket
import time

import pytest

from benchmarks._support.daemon import Daemon
from gateway.codes import ErrorCode
from tests.support import rawclient as rc
from tests.support.rawhttp import RawHttp

CHAT = {"model": "synthetic", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
SURROGATE_BODY = (
    b'{"model":"synthetic","messages":[{"role":"user","content":"hi"}],"max_tokens":4,"\\ud800":1}'
)
ATTACKER = "127.0.0.2"


def fds(d: Daemon) -> int:
    return len(os.listdir(f"/proc/{d.proc.pid}/fd"))


def canary_http(d: Daemon) -> None:
    c = RawHttp("127.0.0.1", d.http_port)
    c.request("POST", "/v1/chat/completions", CHAT)
    assert c.response().json()["usage"]["completion_tokens"] == 4
    c.sock.close()


def canary_frames(d: Daemon) -> None:
    conn = rc.RawConnection(d.host, d.port)
    conn.send(rc.hello())
    conn.send(rc.request(1, b"canary", 3))
    got = rc.collect(conn, {1})
    assert got[1]["done"]["completion_tokens"] == 3
    conn.close()


def settle(d: Daemon, baseline: int, slack: int = 2) -> int:
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and fds(d) > baseline + slack:
        time.sleep(0.1)
    return fds(d)


@pytest.fixture(scope="module")
def daemon():
    env = {
        "HTTP__MAX_CONNECTIONS_PER_IP": "8",
        "HTTP__MAX_BODY_BYTES_IN_FLIGHT": str(8 * 1_048_576),
        "HTTP__HEADER_TIMEOUT_S": "5",
        "SERVER__MAX_CONNECTIONS_PER_PRINCIPAL": "4",
        "SERVER__MAX_CONNECTIONS_PER_IP": "0",
    }
    with Daemon(env) as d:
        yield d
        canary_http(d)
        canary_frames(d)
        assert d.proc.poll() is None


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/messages", "/v1/completions"])
def test_lone_surrogate_key_gets_a_400_and_the_connection_is_not_leaked(daemon, path):
    before = fds(daemon)
    body = SURROGATE_BODY
    if path == "/v1/completions":
        body = body.replace(b'"messages":[{"role":"user","content":"hi"}]', b'"prompt":"hi"')
    for _ in range(20):
        c = RawHttp("127.0.0.1", daemon.http_port, source=ATTACKER)
        c.send(
            b"POST %s HTTP/1.1\r\nhost: t\r\ncontent-type: application/json\r\n"
            b"content-length: %d\r\n\r\n%s" % (path.encode(), len(body), body)
        )
        c.expect_raw()
        r = c.response()
        assert r.status == 400, r.body
        assert b"ud800" in r.body
        c.sock.close()
    assert settle(daemon, before) <= before + 2
    canary_http(daemon)


def test_frame_json_request_with_a_surrogate_key_is_invalid_on_its_stream(daemon):
    conn = rc.RawConnection(daemon.host, daemon.port, source=ATTACKER)
    conn.send(rc.hello())
    conn.send(rc.json_request(5, '{"prompt":"x","max_tokens":2,"\\ud800":1}'))
    conn.send(rc.request(7, b"after", 2))  # the connection goes on
    got = rc.collect(conn, {5, 7})
    assert (
        got[5]["error"][0] == ErrorCode.INVALID_REQUEST
    )  # , on stream 5 (not INTERNAL on stream 0)
    assert got[7]["done"]["completion_tokens"] == 2
    conn.close()
    assert "Traceback" not in daemon.log


def test_a_huge_header_line_is_refused_as_it_arrives(daemon):
    c = RawHttp("127.0.0.1", daemon.http_port, source=ATTACKER)
    c.send(b"GET /v1/models HTTP/1.1\r\nhost: t\r\nx-big: ")
    sent = 0
    with pytest.raises(OSError):  # the daemon answers 431 and closes long before 64 MiB
        for _ in range(1024):
            c.sock.sendall(b"a" * 65536)
            sent += 65536
    assert sent < 4 * 1_048_576
    canary_http(daemon)


def test_http_connections_are_capped_per_address_with_503_and_retry_after(daemon):
    before = fds(daemon)
    held = [RawHttp("127.0.0.1", daemon.http_port, source=ATTACKER) for _ in range(8)]
    time.sleep(0.2)
    extra = RawHttp("127.0.0.1", daemon.http_port, source=ATTACKER)
    extra.expect_raw("GET")
    r = extra.response()
    assert r.status == 503 and r.headers["retry-after"] == "1"
    canary_http(daemon)  # another address is served while the attacker is at its cap
    for c in [*held, extra]:
        c.sock.close()
    assert settle(daemon, before) <= before + 2


def test_request_bodies_in_flight_are_bounded_daemon_wide(daemon):
    body_len = 4 * 1_048_576 - 1024  # just under http.max_body_bytes
    holders, refused = [], 0
    for i in range(4):
        c = RawHttp("127.0.0.1", daemon.http_port, source=f"127.0.0.{3 + i}")
        c.send(
            b"POST /v1/chat/completions HTTP/1.1\r\nhost: t\r\ncontent-type: application/json"
            b"\r\ncontent-length: %d\r\n\r\n{" % body_len
        )
        holders.append(c)
    time.sleep(0.3)
    for c in holders[2:]:  # 8 MiB in flight: the third and fourth are refused at once
        c.expect_raw()
        r = c.response()
        assert r.status == 503 and "retry-after" in r.headers
        refused += 1
    assert refused == 2
    canary_http(daemon)
    for c in holders:
        c.sock.close()


def test_anonymous_hello_connections_are_limited_per_address(daemon):
    attackers = []
    for _ in range(4):  # max_connections_per_principal = 4, all from the attacker's address
        conn = rc.RawConnection(daemon.host, daemon.port, source=ATTACKER)
        conn.send(rc.hello())
        assert conn.read_frame()[0] == rc.WELCOME
        attackers.append(conn)
    canary_frames(daemon)  # the canary's HELLO is not in the attacker's bucket
    for conn in attackers:
        conn.close()


def test_upgrade_h2c_gets_exactly_one_response(daemon):
    s = socket.create_connection(("127.0.0.1", daemon.http_port), source_address=(ATTACKER, 0))
    s.settimeout(5)
    s.sendall(
        b"GET /v1/models HTTP/1.1\r\nhost: t\r\nconnection: Upgrade, HTTP2-Settings\r\n"
        b"upgrade: h2c\r\nhttp2-settings: AAMAAABkAARAAAAAAAIAAAAA\r\n\r\n"
    )
    data = b""
    while chunk := s.recv(65536):
        data += chunk
    s.close()
    assert data.count(b"HTTP/1.1 ") == 1 and data.startswith(b"HTTP/1.1 200")


def _chat(content: str) -> dict:
    """A chat body both doors take (the frame door's JSON REQUEST has no ``model``)."""
    return {"messages": [{"role": "user", "content": content}], "max_tokens": 4}


def _ping(conn: rc.RawConnection, data: bytes) -> None:
    """PING, and read to its PONG (other frames on stream 0 would fail the test)."""
    conn.send(rc.frame(rc.PING, 0, data))
    while True:
        f = conn.read_frame()
        assert f is not None, "canary connection closed"
        if f[0] == rc.PONG:
            assert f[3] == data
            return


def test_large_prompts_are_bounded_first_and_tokenized_off_the_loop(daemon):
    """Item 3: a 4 MB chat message is refused by the byte bound (max_context 2048 x 16) before
    any tokenizing, naming the field; a 20 KB one (above the inline size, under the bound) is
    tokenized on the offload pool and then refused by its token count; meanwhile a canary on
    127.0.0.1 gets its PONGs and its stream served, and every attacker stream ends once."""
    canary = rc.RawConnection(daemon.host, daemon.port)
    canary.send(rc.hello())
    huge = RawHttp("127.0.0.1", daemon.http_port, timeout=60, source=ATTACKER)
    huge.request("POST", "/v1/chat/completions", _chat("a" * 4_000_000))
    _ping(canary, b"after-huge")
    large = RawHttp("127.0.0.1", daemon.http_port, timeout=60, source=ATTACKER)
    large.request("POST", "/v1/chat/completions", _chat("b" * 20_000))
    frames = rc.RawConnection(daemon.host, daemon.port, source=ATTACKER)
    frames.send(rc.hello())
    frames.send(rc.json_request(1, _chat("c" * 20_000)))
    frames.send(rc.json_request(3, _chat("d" * 20_000)))
    frames.send(rc.frame(rc.CANCEL, 3))  # cancelled while (or before) it is tokenized
    frames.send(rc.json_request(5, _chat("e" * 40_000)))
    _ping(canary, b"after-large")
    canary.send(rc.request(1, b"canary", 3))
    assert rc.collect(canary, {1})[1]["done"]["completion_tokens"] == 3

    r = huge.response()
    err = r.json()["error"]
    assert r.status == 400 and err["code"] == "prompt_too_long"
    assert err["message"].startswith("messages:") and "32768 UTF-8 bytes" in err["message"]
    r = large.response()
    err = r.json()["error"]
    assert r.status == 400 and err["code"] == "prompt_too_long"
    assert "tokens" in err["message"] and "UTF-8" not in err["message"]
    got = rc.collect(frames, {1, 3, 5})
    assert all(s["ends"] == 1 for s in got.values())
    assert got[1]["error"][0] == ErrorCode.PROMPT_TOO_LONG and "tokens" in got[1]["error"][2]
    assert got[3]["done"] is not None or got[3]["error"] is not None
    assert got[5]["error"][0] == ErrorCode.PROMPT_TOO_LONG and "UTF-8" in got[5]["error"][2]
    frames.send(rc.request(7, b"still here", 2))  # the connection goes on after all of it
    assert rc.collect(frames, {7})[7]["done"]["completion_tokens"] == 2
    for c in (huge, large, frames, canary):
        c.close()
