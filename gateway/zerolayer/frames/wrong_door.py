"""Wrong door: recognise HTTP or TLS where frames were expected, and the answer that says so.

Pure functions, no sockets. The frame server calls ``answer`` on a connection's first bytes: a
curl aimed at the frame port gets an HTTP/1.1 response whose one line names this port and where
HTTP lives; a TLS ClientHello on the plain port gets a TLS alert. The client calls ``sniff`` on
the first bytes a server sends, to say "this endpoint answered in HTTP" instead of waiting for a
frame that never comes. Only bytes that cannot start a valid frame are recognised, so no client
speaking the frame protocol is ever turned away. ``SNIFF_BYTES`` of the first read are enough.
"""

from __future__ import annotations

import re

from zerolayer.frames.protocol import CLIENT_TO_SERVER, HEADER, HEADER_SIZE

__all__ = ["SNIFF_BYTES", "answer", "http_answer", "sniff", "tls_alert"]

SNIFF_BYTES = 16  # the longest method plus a space, and a frame header: both fit

# An HTTP/1.x request line starts with a method token and a space (HTTP/2's preface with "PRI").
_HTTP_REQUEST = re.compile(rb"(GET|HEAD|POST|PUT|DELETE|OPTIONS|PATCH|CONNECT|TRACE|PRI) ")
_HTTP_RESPONSE = b"HTTP/"
_TLS_HANDSHAKE = 0x16  # TLS record content type of a ClientHello (and ServerHello)
_TLS_ALERT = 0x15
_CLIENT_HELLO = 0x01  # handshake message type, the byte after the 5-byte record header


def _valid_client_header(first: bytes, max_frame_bytes: int) -> bool:
    length, ftype, _flags, reserved, _stream = HEADER.unpack_from(first)
    return ftype in CLIENT_TO_SERVER and reserved == 0 and length <= max_frame_bytes


def _is_client_hello(first: bytes) -> bool:
    # Record header: type 0x16, version 0x03 0x00..0x04, 2-byte length; then handshake type 1.
    return (
        first[0] == _TLS_HANDSHAKE
        and first[1] == 0x03
        and first[2] <= 0x04
        and first[5] == _CLIENT_HELLO
    )


def sniff(first: bytes) -> str | None:
    """ "http" or "tls" when ``first`` (a peer's first bytes) is an HTTP message or a TLS record;
    None otherwise. Used on both sides: requests on the server, responses on the client."""
    if _HTTP_REQUEST.match(first) or first.startswith(_HTTP_RESPONSE):
        return "http"
    if len(first) >= 3 and first[0] in (_TLS_HANDSHAKE, _TLS_ALERT) and first[1] == 0x03:
        return "tls"
    return None


def http_answer(http_port: int | None, metrics_port: int | None) -> bytes:
    """A complete HTTP/1.1 400 response (Connection: close) whose body is one line."""
    where = f"HTTP is served on port {http_port}" if http_port else "no HTTP API is served here"
    if metrics_port:
        where += f"; metrics and health on port {metrics_port}"
    body = (
        "This is the ZeroLayer frame protocol port (binary frames, see docs/protocol.md); "
        f"{where}.\n"
    ).encode()
    head = (
        "HTTP/1.1 400 Bad Request\r\n"
        "Content-Type: text/plain; charset=utf-8\r\n"
        f"Content-Length: {len(body)}\r\n"
        "Connection: close\r\n\r\n"
    ).encode()
    return head + body


def tls_alert(record_version: bytes = b"\x03\x01") -> bytes:
    """A fatal handshake_failure alert (TLS has no room for a sentence; the server logs one)."""
    return bytes([_TLS_ALERT, *record_version[:2], 0x00, 0x02, 0x02, 40])


def answer(
    first: bytes, *, max_frame_bytes: int, http_port: int | None, metrics_port: int | None
) -> bytes | None:
    """What to send back before closing when a connection's ``first`` bytes on the frame port are
    HTTP or a TLS ClientHello rather than a frame; None to go on decoding frames."""
    if _HTTP_REQUEST.match(first):  # its 5th byte is a letter or "/": never a frame type
        return http_answer(http_port, metrics_port)
    # A ClientHello's header bytes could in theory read as a valid frame header; then it is one.
    if (
        len(first) >= HEADER_SIZE
        and _is_client_hello(first)
        and not _valid_client_header(first, max_frame_bytes)
    ):
        return tls_alert(first[1:3])
    return None
