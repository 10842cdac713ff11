"""The HTTP front end against malformed and hostile input, over raw sockets (responses read with
h11): bad JSON, wrong types, truncated and oversize bodies, garbage, slow headers, wrong paths,
methods and content types, pipelining. Each gets a clear answer or a closed socket, and the
daemon goes on serving both ports."""

from __future__ import annotations

import json
import time

import pytest

from benchmarks._support.daemon import Daemon
from tests.support import rawclient as rc
from tests.support.rawhttp import RawHttp

CHAT = {"model": "synthetic", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
MESSAGES = {**CHAT, "max_tokens": 3}


@pytest.fixture(scope="module")
def daemon():
    env = {
        "HTTP__HEADER_TIMEOUT_S": "0.5",
        "HTTP__BODY_TIMEOUT_S": "0.5",
        "HTTP__MAX_BODY_BYTES": "4096",
        "ENGINE__MAX_CONTEXT": "512",
    }
    with Daemon(env) as d:
        yield d
        # Whatever the tests sent, both doors still serve.
        c = RawHttp("127.0.0.1", d.http_port)
        c.request("POST", "/v1/chat/completions", CHAT)
        assert c.response().json()["usage"]["completion_tokens"] == 4
        conn = rc.RawConnection(d.host, d.port)
        conn.send(rc.request(1, b"still", 3))
        assert rc.collect(conn, {1})[1]["done"]["completion_tokens"] == 3
        assert d.proc.poll() is None


def http(d: Daemon) -> RawHttp:
    return RawHttp("127.0.0.1", d.http_port)


def post_raw(d: Daemon, path: bytes, body: bytes, headers: bytes = b"") -> RawHttp:
    c = http(d)
    c.send(
        b"POST %s HTTP/1.1\r\nhost: t\r\ncontent-type: application/json\r\n%s"
        b"content-length: %d\r\n\r\n%s" % (path, headers, len(body), body)
    )
    c.expect_raw()
    return c


def test_bad_json_and_wrong_types_are_400_in_each_api_shape(daemon):
    for body in (b"{", b"[1, 2]", b'{"messages": "hi"}', b"\xff\xfe{}", b"[" * 4000):
        r = post_raw(daemon, b"/v1/chat/completions", body).response()
        assert r.status == 400
        err = r.json()["error"]
        assert err["type"] == "invalid_request_error" and err["message"]
        r = post_raw(daemon, b"/v1/messages", body).response()
        assert r.status == 400
        assert r.json()["type"] == "error"
        assert r.json()["error"]["type"] == "invalid_request_error"
    c = http(daemon)
    for field, bad in (("max_tokens", "4"), ("temperature", None), ("stream", 1), ("seed", 1.5)):
        c.request("POST", "/v1/chat/completions", {**CHAT, field: bad} if bad is not None else {
            **CHAT, field: [1]})  # fmt: skip
        r = c.response()
        assert r.status == 400 and r.json()["error"]["param"] == field, r.body
    c.request("POST", "/v1/messages", {**MESSAGES, "max_tokens": -1})
    r = c.response()
    assert r.status == 400 and "max_tokens" in r.json()["error"]["message"]
    # The connection stays usable after refusals.
    c.request("POST", "/v1/chat/completions", CHAT)
    assert c.response().status == 200


def test_truncated_body_times_out_408_and_closes(daemon):
    c = http(daemon)
    c.send(
        b"POST /v1/chat/completions HTTP/1.1\r\nhost: t\r\ncontent-type: application/json\r\n"
        b"content-length: 100\r\n\r\n" + json.dumps(CHAT).encode()[:10]
    )
    c.expect_raw()
    r = c.response()
    assert r.status == 408 and r.headers["connection"] == "close"
    assert c.closed()


def test_oversize_body_is_413_before_it_is_read(daemon):
    c = http(daemon)
    c.send(
        b"POST /v1/messages HTTP/1.1\r\nhost: t\r\ncontent-type: application/json\r\n"
        b"content-length: 1000000\r\n\r\n"
    )
    c.expect_raw()
    r = c.response()
    assert r.status == 413 and r.json()["error"]["type"] == "request_too_large"
    assert c.closed()


def test_garbage_and_slow_headers_close_the_socket(daemon):
    for junk in (b"\x00\x01\x02\x03 not http\r\n\r\n", b"SSH-2.0-OpenSSH_9.6\r\n\r\n"):
        c = http(daemon)
        c.send(junk)
        c.expect_raw()
        assert c.response().status == 400
        assert c.closed()
    c = http(daemon)
    c.send(b"POST /v1/chat/completions HTTP/1.1\r\nhost: t\r\n")  # and nothing more
    t0 = time.monotonic()
    c.expect_raw()
    assert c.response().status == 408
    assert c.closed()
    assert time.monotonic() - t0 < 10


def test_paths_methods_and_content_types(daemon):
    c = http(daemon)
    c.request("POST", "/v1/audio/speech", CHAT)  # an OpenAI path this server does not have
    r = c.response()
    assert r.status == 404 and r.json()["error"]["code"] == "unknown_url"
    c.request("GET", "/v1/chat/completions")
    r = c.response()
    assert r.status == 405 and r.headers["allow"] == "POST"
    c.request("DELETE", "/v1/messages")
    r = c.response()
    assert r.status == 405 and r.json()["type"] == "error"
    c.request(
        "POST",
        "/v1/chat/completions",
        b"a=b",
        {"content-type": "application/x-www-form-urlencoded"},
    )
    assert c.response().status == 415
    c.request(
        "POST", "/v1/chat/completions", CHAT, {"content-type": "application/json; charset=utf-8"}
    )
    assert c.response().status == 200


def test_pipelined_requests_are_answered_in_order(daemon):
    bodies = [
        ("/v1/chat/completions", {**CHAT, "max_tokens": 3, "stream": True}),
        ("/v1/messages", {**MESSAGES, "max_tokens": 2}),
        ("/v1/nope", {}),
        ("/v1/chat/completions", {**CHAT, "max_tokens": 5}),
    ]
    c = http(daemon)
    data = b""
    for path, body in bodies:
        raw = json.dumps(body).encode()
        data += b"POST %s HTTP/1.1\r\nhost: t\r\ncontent-type: application/json\r\n" % path.encode()
        data += b"content-length: %d\r\n\r\n%s" % (len(raw), raw)
    c.send(data)
    got = []
    for _ in bodies:
        c.expect_raw()
        got.append(c.response())
    assert [r.status for r in got] == [200, 200, 404, 200]
    events = got[0].events()
    assert events[-1] == (None, "[DONE]")
    assert got[1].json()["usage"]["output_tokens"] == 2
    assert got[3].json()["usage"]["completion_tokens"] == 5


def test_client_gone_before_its_answer_harms_nobody(daemon):
    for _ in range(5):
        c = http(daemon)
        c.request("POST", "/v1/chat/completions", {**CHAT, "max_tokens": 50})
        c.close()
    c = http(daemon)
    c.request("POST", "/v1/messages", MESSAGES)
    assert c.response().json()["usage"]["output_tokens"] == 3


def test_access_log_lines_in_json():
    env = {"LOGGING__REQUESTS": "true", "LOGGING__JSON_LINES": "true", "LOGGING__LEVEL": "info"}
    with Daemon(env) as d:
        c = http(d)
        c.request("POST", "/v1/chat/completions", CHAT)
        assert c.response().status == 200
        c.request("POST", "/v1/messages", {**MESSAGES, "max_tokens": 0})
        assert c.response().status == 400
        deadline = time.monotonic() + 10
        lines: list[dict] = []
        while time.monotonic() < deadline:
            lines = [json.loads(x) for x in d.lines if x.startswith("{") and '"http' in x]
            if len(lines) >= 2:
                break
            time.sleep(0.1)
        done = [x for x in lines if x["msg"] == "http request"]
        refused = [x for x in lines if x["msg"] == "http request refused"]
        assert done and done[0]["api"] == "openai" and done[0]["status"] == 200
        assert done[0]["completion_tokens"] == 4 and done[0]["path"] == "/v1/chat/completions"
        assert refused and refused[0]["api"] == "anthropic" and refused[0]["status"] == 400
