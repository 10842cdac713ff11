"""zerolayer.frames.wrong_door: HTTP and TLS recognised from a connection's first bytes, answered in
kind; frames (every client frame type, any first-read length) never are."""

from __future__ import annotations

import ssl
import struct

import pytest

from zerolayer.frames import protocol as p
from zerolayer.frames.wrong_door import SNIFF_BYTES, answer, http_answer, sniff, tls_alert

MAX = 1_048_576


def client_hello(version: ssl.TLSVersion = ssl.TLSVersion.TLSv1_2) -> bytes:
    """The real first flight of Python's TLS client (no network: memory BIOs)."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.minimum_version = version
    incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
    tls = ctx.wrap_bio(incoming, outgoing, server_hostname="localhost")
    with pytest.raises(ssl.SSLWantReadError):
        tls.do_handshake()
    return outgoing.read()


def knock(first: bytes, http_port: int | None = 8080, metrics_port: int | None = 9464):
    return answer(
        first[:SNIFF_BYTES], max_frame_bytes=MAX, http_port=http_port, metrics_port=metrics_port
    )


@pytest.mark.parametrize(
    "request_line",
    [
        b"GET /v1/chat/completions HTTP/1.1\r\nHost: x\r\n\r\n",
        b"POST /v1/messages HTTP/1.1\r\n",
        b"HEAD / HTTP/1.0\r\n",
        b"OPTIONS * HTTP/1.1\r\n",
        b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n",
        b"GET ",  # a first read this short is still recognisable
    ],
)
def test_http_on_the_frame_port_gets_one_line_of_http(request_line: bytes) -> None:
    reply = knock(request_line)
    assert reply is not None
    head, _, body = reply.partition(b"\r\n\r\n")
    lines = head.split(b"\r\n")
    assert lines[0] == b"HTTP/1.1 400 Bad Request"
    assert b"Connection: close" in lines
    assert f"Content-Length: {len(body)}".encode() in lines
    assert body == (
        b"This is the ZeroLayer frame protocol port (binary frames, see docs/protocol.md); "
        b"HTTP is served on port 8080; metrics and health on port 9464.\n"
    )


def test_the_answer_says_when_there_is_no_http_port() -> None:
    body = http_answer(None, None).partition(b"\r\n\r\n")[2]
    assert body.endswith(b"; no HTTP API is served here.\n")


@pytest.mark.parametrize("version", [ssl.TLSVersion.TLSv1_2, ssl.TLSVersion.TLSv1_3])
def test_a_client_hello_gets_a_fatal_tls_alert(version: ssl.TLSVersion) -> None:
    hello = client_hello(version)
    reply = knock(hello)
    assert reply == tls_alert(hello[1:3])
    # A TLS record: alert (21), the record version, length 2, fatal (2), handshake_failure (40).
    assert reply[0] == 21 and reply[3:] == bytes([0, 2, 2, 40])


def test_the_client_side_names_http_and_tls_replies() -> None:
    assert sniff(b"HTTP/1.0 400 Bad Request\r\n") == "http"
    assert sniff(tls_alert()) == "tls"
    assert sniff(client_hello()) == "tls"
    assert sniff(p.encode_welcome(MAX, 8, 259, 2, 2048, "m")) is None
    assert sniff(p.encode_error(0, p.ErrorCode.INTERNAL, "x")) is None


@pytest.mark.parametrize(
    "frame",
    [
        p.encode_hello(b"key"),
        p.encode_hello(b""),
        p.encode_ping(b"GET / HTTP/1.1"),
        p.encode_request(1, "GET / HTTP/1.1", 8),
        p.encode_json_request(7, {"max_tokens": 4, "prompt": "POST /"}),
        p.encode_cancel(3),
    ],
)
def test_frames_are_never_turned_away_whatever_the_first_read(frame: bytes) -> None:
    for n in range(1, len(frame) + 1):
        assert knock(frame[:n]) is None, n


def test_a_valid_frame_header_that_starts_like_tls_is_a_frame() -> None:
    # 16 03 01 00 | type REQUEST, flags JSON, reserved 0: a 66 326-byte JSON request, which
    # max_frame_bytes allows. Its first bytes also match a ClientHello's; the frame wins.
    header = struct.pack("<IBBHI", 0x00010316, p.FrameType.REQUEST, p.FLAG_JSON, 0, 1)
    assert header[:3] == b"\x16\x03\x01"
    assert knock(header + b"{") is None
    # With a lower limit the same bytes cannot be a frame: then they are answered as TLS.
    small = answer(header, max_frame_bytes=65536, http_port=None, metrics_port=None)
    assert small == tls_alert(b"\x03\x01")


def test_other_garbage_is_left_to_the_frame_decoder() -> None:
    assert knock(b"\x00\x00\x00\x00\xff\x00\x00\x00\x00\x00\x00\x00") is None
    assert knock(b"SSH-2.0-OpenSSH_9.6\r\n") is None
