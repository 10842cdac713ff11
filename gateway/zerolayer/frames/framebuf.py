"""A connection's reusable write buffer of frames: it owns its bytes, its length and its growth.

Callers append frames through its methods (which use the codec's packers from
zerolayer.frames.protocol) and ``take`` the bytes for one ``transport.write``; no caller touches an
offset. Sans-IO like the codec: no socket, no asyncio.
"""

from __future__ import annotations

from zerolayer.frames import protocol as p

_pack_token1 = p.pack_token1_into
_TOKEN1_SIZE = p.TOKEN1_FRAME_SIZE
_DONE_SIZE = p.DONE_FRAME_SIZE


class FrameBuffer:
    """Frames waiting for the next write; grows by doubling, reused after every ``take``."""

    __slots__ = ("_buf", "_len")

    def __init__(self, size: int = 1024) -> None:
        self._buf = bytearray(max(size, 64))
        self._len = 0

    def __len__(self) -> int:
        return self._len

    @property
    def capacity(self) -> int:
        return len(self._buf)

    def _reserve(self, n: int) -> None:
        need = self._len + n
        size = len(self._buf)  # never 0 (see __init__): doubling reaches any size
        if need > size:
            while size < need:
                size *= 2
            self._buf.extend(bytes(size - len(self._buf)))

    def token1(self, stream: int, token: int) -> None:
        """One TOKEN frame with one id and no text (the hot path)."""
        off = self._len
        if off + _TOKEN1_SIZE > len(self._buf):
            self._reserve(_TOKEN1_SIZE)
        self._len = _pack_token1(self._buf, off, stream, token, b"")

    def token(self, stream: int, ids: list[int] | tuple[int, ...], text: bytes = b"") -> None:
        """One TOKEN frame with any number of ids and an optional text delta."""
        self._reserve(p.token_frame_size(len(ids), len(text)))
        if len(ids) == 1:
            self._len = p.pack_token1_into(self._buf, self._len, stream, ids[0], text)
        else:
            self._len = p.pack_token_into(self._buf, self._len, stream, ids, text)

    def done(
        self,
        stream: int,
        finish_reason: int,
        cache: int,
        prompt_tokens: int,
        completion_tokens: int,
        queue_us: int,
        ttft_us: int,
        total_us: int,
    ) -> None:
        if self._len + _DONE_SIZE > len(self._buf):
            self._reserve(_DONE_SIZE)
        self._len = p.pack_done_into(
            self._buf, self._len, stream, finish_reason, cache, prompt_tokens,
            completion_tokens, queue_us, ttft_us, total_us,
        )  # fmt: skip

    def raw(self, data: bytes | memoryview) -> None:
        """Bytes of frames encoded elsewhere (ERROR, PONG, WELCOME, GOAWAY)."""
        n = len(data)
        self._reserve(n)
        self._buf[self._len : self._len + n] = data
        self._len += n

    def append(self, frames: memoryview) -> None:
        """Frames encoded elsewhere (an engine step's prebuilt TOKEN frames), as they are."""
        n = len(frames)
        end = self._len + n
        if end > len(self._buf):
            self._reserve(n)
        self._buf[self._len : end] = frames
        self._len = end

    def shrink(self, size: int) -> None:
        """Give back memory beyond ``size`` bytes while nothing is buffered."""
        if not self._len and len(self._buf) > size:
            self._buf = bytearray(size)

    def take(self) -> bytes | bytearray:
        """The buffered bytes (a copy: the buffer is reused at once); empties the buffer."""
        n, self._len = self._len, 0
        return self._buf[:n] if n else b""

    def clear(self) -> None:
        self._len = 0
