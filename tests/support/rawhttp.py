"""Raw-socket HTTP/1.1 for tests: send exact bytes, read responses with h11 (an independent,
strict parser, so a framing mistake of ours fails the test rather than being tolerated)."""

from __future__ import annotations

import json
import socket
from dataclasses import dataclass, field

import h11


def sse_events(data: bytes) -> list[tuple[str | None, str]]:
    """Server-sent events as (event name or None, data), in order."""
    out = []
    for block in data.decode().split("\n\n"):
        if not block.strip():
            continue
        name, payload = None, ""
        for line in block.split("\n"):
            key, _, value = line.partition(": ")
            if key == "event":
                name = value
            elif key == "data":
                payload = value
        out.append((name, payload))
    return out


@dataclass
class Response:
    status: int
    headers: dict[str, str]
    body: bytes = b""
    chunks: list[bytes] = field(default_factory=list)  # body pieces as they arrived

    def json(self) -> dict:
        return json.loads(self.body)

    def events(self) -> list[tuple[str | None, str]]:
        return sse_events(self.body)


class RawHttp:
    """One client connection. ``send`` writes bytes as given; ``response`` reads the next one."""

    def __init__(
        self, host: str, port: int, timeout: float = 10.0, source: str | None = None
    ) -> None:
        """``source``: the loopback address to connect from (127.0.0.2 ... for attackers)."""
        src = (source, 0) if source else None
        self.sock = socket.create_connection((host, port), timeout=timeout, source_address=src)
        self.conn = h11.Connection(h11.CLIENT)

    def send(self, data: bytes) -> None:
        self.sock.sendall(data)

    def request(
        self,
        method: str,
        path: str,
        body: bytes | dict | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        """Send one well-formed request (and tell h11 about it, for reading the answer)."""
        if isinstance(body, dict):
            body = json.dumps(body).encode()
        hdrs = [("host", "test"), *((headers or {}).items())]
        if body is not None:
            hdrs.append(("content-length", str(len(body))))
            if not any(k.lower() == "content-type" for k, _ in hdrs):
                hdrs.append(("content-type", "application/json"))
        data = self.conn.send(h11.Request(method=method, target=path, headers=hdrs))
        if body:
            data += self.conn.send(h11.Data(data=body))
        data += self.conn.send(h11.EndOfMessage())
        self.sock.sendall(data)

    def expect_raw(self, method: str = "POST") -> None:
        """The next request was sent with ``send`` (not ``request``): read its answer anyway.
        Bytes already received for it are kept."""
        left, closed = self.conn.trailing_data
        self.conn = h11.Connection(h11.CLIENT)
        self.conn.send(h11.Request(method=method, target="/", headers=[("host", "x")]))
        self.conn.send(h11.EndOfMessage())
        if left:
            self.conn.receive_data(bytes(left))
        if closed:
            self.conn.receive_data(b"")

    def response(self) -> Response:
        resp: Response | None = None
        while True:
            event = self.conn.next_event()
            if event is h11.NEED_DATA:
                data = self.sock.recv(65536)
                self.conn.receive_data(data)
                continue
            if isinstance(event, h11.InformationalResponse):
                continue
            if isinstance(event, h11.Response):
                resp = Response(
                    event.status_code,
                    {k.decode(): v.decode() for k, v in event.headers},
                )
            elif isinstance(event, h11.Data):
                assert resp is not None
                resp.body += bytes(event.data)
                resp.chunks.append(bytes(event.data))
            elif isinstance(event, (h11.EndOfMessage, h11.ConnectionClosed)):
                assert resp is not None
                if self.conn.our_state is h11.DONE and self.conn.their_state is h11.DONE:
                    self.conn.start_next_cycle()
                return resp

    def closed(self, timeout: float = 5.0) -> bool:
        """True when the server closed the connection (EOF or reset) within ``timeout``."""
        self.sock.settimeout(timeout)
        try:
            while True:
                data = self.sock.recv(65536)
                if not data:
                    return True
        except ConnectionResetError:
            return True
        except TimeoutError:
            return False

    def close(self) -> None:
        self.sock.close()
