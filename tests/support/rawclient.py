"""A blocking client written only from docs/protocol.md, with struct and socket: no gateway code.

End-to-end tests use it to check the daemon against the written contract, independently of our
own codec (which the server shares).
"""

from __future__ import annotations

import json
import socket
import struct

HDR = struct.Struct("<IBBHI")
REQUEST, TOKEN, DONE, PING, PONG, ERROR, CANCEL, HELLO, WELCOME, GOAWAY = range(1, 11)


def frame(
    ftype: int, stream: int, payload: bytes = b"", flags: int = 0, reserved: int = 0
) -> bytes:
    return HDR.pack(len(payload), ftype, flags, reserved, stream) + payload


def request(
    stream: int,
    prompt: bytes | list[int],
    max_tokens: int,
    *,
    temperature: float = 0.0,
    top_p: float = 1.0,
    top_k: int = 0,
    seed: int | None = None,
    prompt_id: int = 0,
    stop_ids: list[int] = (),  # type: ignore[assignment]
    text_deltas: bool = False,
    options: int | None = None,
) -> bytes:
    opts = 0
    if isinstance(prompt, bytes):
        opts |= 1
        body = prompt
    else:
        body = struct.pack(f"<{len(prompt)}i", *prompt)
    if text_deltas:
        opts |= 2
    if seed is not None:
        opts |= 4
    if options is not None:
        opts = options
    fixed = struct.pack(
        "<IffIQIHH",
        max_tokens,
        temperature,
        top_p,
        top_k,
        seed or 0,
        prompt_id,
        len(stop_ids),
        opts,
    )
    return frame(REQUEST, stream, fixed + struct.pack(f"<{len(stop_ids)}i", *stop_ids) + body)


def json_request(stream: int, obj: dict | str) -> bytes:
    body = obj.encode() if isinstance(obj, str) else json.dumps(obj).encode()
    return frame(REQUEST, stream, body, flags=1)


def hello(key: bytes = b"", version: int = 1) -> bytes:
    return frame(HELLO, 0, struct.pack("<HH", version, len(key)) + key)


class RawConnection:
    def __init__(
        self,
        host: str,
        port: int,
        rcvbuf: int | None = None,
        timeout: float = 30,
        source: str | None = None,
    ) -> None:
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        if source:  # another client's loopback address (127.0.0.2 ...)
            self.sock.bind((source, 0))
        if rcvbuf:
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
        self.sock.settimeout(timeout)
        self.sock.connect((host, port))
        self.buf = b""

    def send(self, data: bytes) -> None:
        self.sock.sendall(data)

    def _fill(self, n: int) -> bool:
        while len(self.buf) < n:
            chunk = self.sock.recv(1 << 20)
            if not chunk:
                return False
            self.buf += chunk
        return True

    def read_frame(self) -> tuple[int, int, int, bytes] | None:
        """(type, flags, stream, payload), or None when the server closed the connection."""
        if not self._fill(12):
            return None
        length, ftype, flags, _, stream = HDR.unpack_from(self.buf)
        if not self._fill(12 + length):
            return None
        payload = self.buf[12 : 12 + length]
        self.buf = self.buf[12 + length :]
        return ftype, flags, stream, payload

    def closed(self) -> bool:
        """True when the server has closed (after any frames still buffered)."""
        try:
            return self.read_frame() is None
        except (ConnectionResetError, TimeoutError):
            return False

    def close(self) -> None:
        self.sock.close()


def parse_token(payload: bytes) -> tuple[list[int], bytes]:
    (n,) = struct.unpack_from("<H", payload)
    ids = list(struct.unpack_from(f"<{n}i", payload, 4))
    return ids, payload[4 + 4 * n :]


def parse_done(payload: bytes) -> dict:
    assert len(payload) == 24
    reason, cache, _, pt, ct, q, ttft, total = struct.unpack("<BBHIIIII", payload)
    return dict(
        finish_reason=reason,
        cache=cache,
        prompt_tokens=pt,
        completion_tokens=ct,
        queue_us=q,
        ttft_us=ttft,
        total_us=total,
    )


def parse_error(payload: bytes) -> tuple[int, int, str]:
    code, _, retry = struct.unpack_from("<HHI", payload)
    return code, retry, payload[8:].decode()


def collect(conn: RawConnection, streams: set[int]) -> dict[int, dict]:
    """Read until every stream in ``streams`` has ended; per stream: ids, text, done or error."""
    out = {s: {"ids": [], "text": b"", "done": None, "error": None, "ends": 0} for s in streams}
    open_ = set(streams)
    while open_:
        f = conn.read_frame()
        assert f is not None, f"connection closed with streams {open_} open"
        ftype, _, stream, payload = f
        if ftype == TOKEN:
            ids, text = parse_token(payload)
            out[stream]["ids"] += ids
            out[stream]["text"] += text
        elif ftype == DONE:
            out[stream]["done"] = parse_done(payload)
            out[stream]["ends"] += 1
            open_.discard(stream)
        elif ftype == ERROR:
            assert stream != 0, f"connection error: {parse_error(payload)}"
            out[stream]["error"] = parse_error(payload)
            out[stream]["ends"] += 1
            open_.discard(stream)
    return out
