"""Frame protocol v1, sans-IO: bytes in, frames out; values in, bytes out. No sockets, no asyncio.

The wire contract is docs/protocol.md. A ``FrameDecoder`` owns one preallocated receive buffer: the
caller (a socket protocol, a test) writes into ``get_buffer()``, reports ``advance(n)``, and pulls
frames with ``next_frame()`` as ``(type, flags, stream, payload)`` where ``payload`` is a memoryview
into that buffer, valid until the next ``get_buffer()``. Header rules that do not depend on the
server's state (types, flags, reserved bits, direction, stream kind, size) are checked here and
raise ``ProtocolError`` (the connection closes). What a REQUEST's payload asks for is the frame
door's field mapping (``zerolayer.frames.requests``), not the codec's.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypedDict

import numpy as np

if TYPE_CHECKING:
    from typing_extensions import Unpack  # typing.Unpack from Python 3.11; annotations only

from zerolayer.codes import (  # noqa: F401 - re-exported
    Cached,
    ErrorCode,
    FinishReason,
    FrameType,
    Refusal,
    invalid,
)

VERSION = 2  # what this codec speaks; the server also speaks 1 (docs/protocol.md, "Versions")
SUPPORTED_VERSIONS = (1, 2)
HEADER = struct.Struct("<IBBHI")  # length, type, flags, reserved, stream
HEADER_SIZE = HEADER.size  # 12
MAX_PING_BYTES = 64


# REQUEST flags and options
FLAG_JSON = 0x01
OPT_TEXT_PROMPT = 0x01
OPT_TEXT_DELTAS = 0x02
OPT_SEED = 0x04
OPT_NO_CACHE = 0x08  # bypass the response cache (JSON "cache": false)
OPT_LOGPROBS = 0x10  # version 2: LOGPROBS frames beside the TOKEN frames
OPT_PROCESSING = 0x20  # version 2: the processing block follows the stop ids
TOP_LOGPROBS_SHIFT, TOP_LOGPROBS_MASK = 8, 0x1F00  # options bits 8-12: top_logprobs (0-20)
KNOWN_OPTIONS = (
    OPT_TEXT_PROMPT | OPT_TEXT_DELTAS | OPT_SEED | OPT_NO_CACHE | OPT_LOGPROBS | OPT_PROCESSING
    | TOP_LOGPROBS_MASK
)  # fmt: skip
# DONE cache bits (zerolayer.codes.Cached)
CACHE_RESPONSE = Cached.RESPONSE
CACHE_PROMPT = Cached.PROMPT

REQUEST_FIXED = struct.Struct("<IffIQIHH")  # 32 bytes
# The processing block (option bit 5): presence, frequency, repetition penalty, min_tokens,
# n_bias, reserved; then n_bias (token id i32, bias f32) pairs.
REQUEST_PROCESSING = struct.Struct("<fffIHH")  # 16 bytes
BIAS_ENTRY = np.dtype([("id", "<i4"), ("value", "<f4")])
LOGPROBS_HEAD = struct.Struct("<HBB")  # n_tokens, k, reserved
TOKEN_HEAD = struct.Struct("<HH")
DONE_BODY = struct.Struct("<BBHIIIII")  # 24 bytes
ERROR_HEAD = struct.Struct("<HHI")
HELLO_HEAD = struct.Struct("<HH")
WELCOME_HEAD = struct.Struct("<HHIIIiI")
GOAWAY_HEAD = struct.Struct("<I")
U32_MAX = 2**32 - 1

CLIENT_TO_SERVER = frozenset(
    {FrameType.REQUEST, FrameType.PING, FrameType.PONG, FrameType.CANCEL, FrameType.HELLO}
)
SERVER_TO_CLIENT = frozenset(
    {
        FrameType.TOKEN,
        FrameType.DONE,
        FrameType.PING,
        FrameType.PONG,
        FrameType.ERROR,
        FrameType.WELCOME,
        FrameType.GOAWAY,
        FrameType.LOGPROBS,
    }
)
# Frames that must be on stream 0, and frames that must not be.
CONNECTION_FRAMES = frozenset(
    {FrameType.PING, FrameType.PONG, FrameType.HELLO, FrameType.WELCOME, FrameType.GOAWAY}
)
STREAM_FRAMES = frozenset(
    {FrameType.REQUEST, FrameType.CANCEL, FrameType.TOKEN, FrameType.DONE, FrameType.LOGPROBS}
)
# Allowed flag bits per type: only REQUEST has one.
_ALLOWED_FLAGS = [0] * 256
_ALLOWED_FLAGS[FrameType.REQUEST] = FLAG_JSON
_KNOWN_TYPES = [False] * 256
for _t in FrameType:
    _KNOWN_TYPES[_t] = True


class ProtocolError(Exception):
    """A violation of the framing itself (header, HELLO, PING, CANCEL, a stream in use): the
    peer cannot be trusted to frame what follows, so the ERROR goes on stream 0 and the
    connection closes. Distinct from ``Refusal``, which ends one stream and keeps the
    connection: a REQUEST whose payload is bad is refused, not a protocol error."""

    def __init__(self, code: ErrorCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


# --------------------------------------------------------------------------------------- decoding


class FrameDecoder:
    """Incremental decoder over one caller-owned receive buffer.

    ``role`` is the side that receives: "server" accepts client→server frames, "client" the
    reverse. The buffer starts at ``initial_size`` and grows only to hold one frame of at most
    ``max_frame_bytes`` payload; a longer length raises FRAME_TOO_LARGE from the header alone.
    """

    __slots__ = ("_buf", "_view", "_start", "_end", "_max", "_accept", "_initial")

    def __init__(self, role: str, max_frame_bytes: int, initial_size: int = 65536) -> None:
        if role not in ("server", "client"):
            raise ValueError("role must be 'server' or 'client'")
        self._accept = CLIENT_TO_SERVER if role == "server" else SERVER_TO_CLIENT
        self._max = max_frame_bytes
        self._initial = max(initial_size, HEADER_SIZE * 2)
        self._buf = bytearray(self._initial)
        self._view = memoryview(self._buf)
        self._start = 0  # first unconsumed byte
        self._end = 0  # end of received data

    @property
    def capacity(self) -> int:
        return len(self._buf)

    @property
    def buffered(self) -> int:
        return self._end - self._start

    def get_buffer(self, sizehint: int = -1) -> memoryview:
        """Free space to receive into. Invalidates payload views returned earlier. The buffer
        grows (doubling) only when it is full of an unfinished frame: memory follows the bytes
        that arrived, never what a header announced."""
        if self._start == self._end:
            self._start = self._end = 0
        elif len(self._buf) - self._end < HEADER_SIZE or self._start > len(self._buf) // 2:
            self._compact()
        cap = self._max + HEADER_SIZE  # one whole frame: the most an unfinished frame needs
        if self._end == len(self._buf) and len(self._buf) < cap:
            self._grow(min(2 * len(self._buf), cap))
        return self._view[self._end :]

    def shrink(self) -> None:
        """Give back a buffer grown for a large frame once nothing is buffered (an idle
        connection keeps only ``initial_size``). Invalidates payload views returned earlier."""
        if self._start == self._end and len(self._buf) > self._initial:
            self._view.release()
            self._buf = bytearray(self._initial)
            self._view = memoryview(self._buf)
            self._start = self._end = 0

    def _compact(self) -> None:
        n = self._end - self._start
        self._view[:n] = self._view[self._start : self._end]
        self._start, self._end = 0, n

    def advance(self, nbytes: int) -> None:
        """Record that ``nbytes`` were written into the view from ``get_buffer()``."""
        self._end += nbytes

    def feed(self, data: bytes) -> None:
        """Copy ``data`` in (for tests and the client); equivalent to get_buffer + advance."""
        rest = memoryview(data)
        while len(rest):
            free = self.get_buffer()
            if not len(free):
                # A frame larger than the buffer: make room for it now.
                self._grow(self._end - self._start + len(rest))
                continue
            n = min(len(free), len(rest))
            free[:n] = rest[:n]
            self.advance(n)
            rest = rest[n:]

    def _grow(self, need: int) -> None:
        size = len(self._buf)
        while size < need:
            size *= 2
        size = min(size, max(need, self._max + HEADER_SIZE))
        new = bytearray(size)
        n = self._end - self._start
        new[:n] = self._view[self._start : self._end]
        self._view.release()
        self._buf, self._view = new, memoryview(new)
        self._start, self._end = 0, n

    def next_frame(self) -> tuple[int, int, int, memoryview] | None:
        """The next complete frame as (type, flags, stream, payload view), or None for more data."""
        avail = self._end - self._start
        if avail < HEADER_SIZE:
            return None
        length, ftype, flags, reserved, stream = HEADER.unpack_from(self._buf, self._start)
        if length > self._max:
            raise ProtocolError(
                ErrorCode.FRAME_TOO_LARGE,
                f"frame length {length} exceeds max_frame_bytes {self._max}",
            )
        self._check_header(ftype, flags, reserved, stream)
        total = HEADER_SIZE + length
        if avail < total:
            if self._start and self._start + total > len(self._buf):
                self._compact()  # the frame continues at the buffer's start
            return None
        begin = self._start + HEADER_SIZE
        self._start += total
        return ftype, flags, stream, self._view[begin : begin + length]

    def _check_header(self, ftype: int, flags: int, reserved: int, stream: int) -> None:
        if not _KNOWN_TYPES[ftype]:
            raise ProtocolError(ErrorCode.MALFORMED_FRAME, f"unknown frame type 0x{ftype:02x}")
        if reserved:
            raise ProtocolError(ErrorCode.MALFORMED_FRAME, "reserved header bits must be 0")
        if flags & ~_ALLOWED_FLAGS[ftype]:
            raise ProtocolError(
                ErrorCode.MALFORMED_FRAME,
                f"unknown flag bits 0x{flags:02x} on {FrameType(ftype).name}",
            )
        if ftype not in self._accept:
            raise ProtocolError(
                ErrorCode.MALFORMED_FRAME, f"{FrameType(ftype).name} sent in the wrong direction"
            )
        if stream == 0 and ftype in STREAM_FRAMES:
            raise ProtocolError(
                ErrorCode.MALFORMED_FRAME, f"{FrameType(ftype).name} must not use stream 0"
            )
        if stream != 0 and ftype in CONNECTION_FRAMES:
            raise ProtocolError(
                ErrorCode.MALFORMED_FRAME, f"{FrameType(ftype).name} must use stream 0"
            )


def parse_hello(payload: memoryview) -> tuple[int, bytes]:
    """(version, api key). A key_len that disagrees with the payload is MALFORMED_FRAME."""
    if len(payload) < HELLO_HEAD.size:
        raise ProtocolError(ErrorCode.MALFORMED_FRAME, "HELLO shorter than 4 bytes")
    version, key_len = HELLO_HEAD.unpack_from(payload, 0)
    if HELLO_HEAD.size + key_len != len(payload):
        raise ProtocolError(ErrorCode.MALFORMED_FRAME, "HELLO key_len disagrees with its length")
    return version, bytes(payload[HELLO_HEAD.size :])


def check_ping(payload: memoryview) -> None:
    if len(payload) > MAX_PING_BYTES:
        raise ProtocolError(ErrorCode.MALFORMED_FRAME, "PING payload over 64 bytes")


def check_cancel(payload: memoryview) -> None:
    if len(payload):
        raise ProtocolError(ErrorCode.MALFORMED_FRAME, "CANCEL must have an empty payload")


# ----------------------------------------------------------------- server→client payload parsing


@dataclass(slots=True)
class Done:
    finish_reason: int
    cache: int
    prompt_tokens: int
    completion_tokens: int
    queue_us: int
    ttft_us: int
    total_us: int


@dataclass(slots=True)
class Welcome:
    version: int
    max_frame_bytes: int
    max_streams: int
    vocab_size: int
    eos_token_id: int
    max_context: int
    model: str


def parse_token(payload: memoryview) -> tuple[np.ndarray, bytes]:
    """(ids as an int32 view into the payload, UTF-8 text delta bytes)."""
    if len(payload) < TOKEN_HEAD.size:
        raise ProtocolError(ErrorCode.MALFORMED_FRAME, "TOKEN shorter than 4 bytes")
    n_ids, _ = TOKEN_HEAD.unpack_from(payload, 0)
    end = TOKEN_HEAD.size + 4 * n_ids
    if end > len(payload):
        raise ProtocolError(ErrorCode.MALFORMED_FRAME, "TOKEN n_ids does not fit")
    ids = np.frombuffer(payload, dtype="<i4", count=n_ids, offset=TOKEN_HEAD.size)
    return ids, bytes(payload[end:])


def parse_logprobs(payload: memoryview) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(each token's logprob f32 [n], the top ids i32 [n, k], their logprobs f32 [n, k])."""
    if len(payload) < LOGPROBS_HEAD.size:
        raise ProtocolError(ErrorCode.MALFORMED_FRAME, "LOGPROBS shorter than 4 bytes")
    n, k, _ = LOGPROBS_HEAD.unpack_from(payload, 0)
    if len(payload) != LOGPROBS_HEAD.size + 4 * n * (1 + 2 * k):
        raise ProtocolError(ErrorCode.MALFORMED_FRAME, "LOGPROBS size disagrees with n and k")
    at = LOGPROBS_HEAD.size
    token = np.frombuffer(payload, "<f4", n, at)
    ids = np.frombuffer(payload, "<i4", n * k, at + 4 * n).reshape(n, k)
    top = np.frombuffer(payload, "<f4", n * k, at + 4 * n * (1 + k)).reshape(n, k)
    return token, ids, top


def parse_done(payload: memoryview) -> Done:
    if len(payload) != DONE_BODY.size:
        raise ProtocolError(ErrorCode.MALFORMED_FRAME, "DONE must be 24 bytes")
    reason, cache, _, p, c, q, t, total = DONE_BODY.unpack_from(payload, 0)
    return Done(reason, cache, p, c, q, t, total)


def parse_error(payload: memoryview) -> tuple[int, int, str]:
    """(code, retry_after_ms, message)."""
    if len(payload) < ERROR_HEAD.size:
        raise ProtocolError(ErrorCode.MALFORMED_FRAME, "ERROR shorter than 8 bytes")
    code, _, retry = ERROR_HEAD.unpack_from(payload, 0)
    return code, retry, str(payload[ERROR_HEAD.size :], "utf-8", errors="replace")


def parse_welcome(payload: memoryview) -> Welcome:
    if len(payload) < WELCOME_HEAD.size:
        raise ProtocolError(ErrorCode.MALFORMED_FRAME, "WELCOME shorter than 24 bytes")
    version, _, mfb, ms, vocab, eos, ctx = WELCOME_HEAD.unpack_from(payload, 0)
    name = str(payload[WELCOME_HEAD.size :], "utf-8", errors="replace")
    return Welcome(version, mfb, ms, vocab, eos, ctx, name)


def parse_goaway(payload: memoryview) -> tuple[int, str]:
    if len(payload) < GOAWAY_HEAD.size:
        raise ProtocolError(ErrorCode.MALFORMED_FRAME, "GOAWAY shorter than 4 bytes")
    (in_flight,) = GOAWAY_HEAD.unpack_from(payload, 0)
    return in_flight, str(payload[GOAWAY_HEAD.size :], "utf-8", errors="replace")


# --------------------------------------------------------------------------------------- encoding


def encode_frame(ftype: int, stream: int, payload: bytes = b"", flags: int = 0) -> bytes:
    return HEADER.pack(len(payload), ftype, flags, 0, stream) + payload


class RequestOptions(TypedDict, total=False):
    """The optional fields of a binary REQUEST: ``encode_request``'s keywords (its body gives
    each one's default), which ``Client.generate`` passes through as they are."""

    temperature: float  # default 0.0: greedy
    top_p: float  # 1.0
    top_k: int  # 0: off
    seed: int | None  # None: unseeded
    prompt_id: int  # 0: none
    stop_ids: list[int] | tuple[int, ...]  # ()
    cache: bool  # True; False bypasses the response cache
    # version 2
    logprobs: bool  # False
    top_logprobs: int  # 0
    presence_penalty: float  # 0.0
    frequency_penalty: float  # 0.0
    repetition_penalty: float  # 1.0
    min_tokens: int  # 0
    logit_bias: dict[int, float] | None  # None


_REQUEST_OPTIONS = RequestOptions.__optional_keys__


def encode_request(
    stream: int,
    prompt: str | bytes | list[int] | np.ndarray,
    max_tokens: int,
    *,
    text_deltas: bool = False,
    **fields: Unpack[RequestOptions],
) -> bytes:
    """A binary REQUEST. A str/bytes prompt is sent as UTF-8 text, a list/array as int32 ids;
    ``fields`` are RequestOptions (a keyword outside them is a TypeError). Version 2:
    ``logprobs`` (option bit 4, with ``top_logprobs`` in bits 8-12) and the processing block
    (bit 5), written when any of its fields is not its default."""
    unknown = fields.keys() - _REQUEST_OPTIONS
    if unknown:
        raise TypeError(f"encode_request() got unexpected keyword arguments {sorted(unknown)}")
    temperature = fields.get("temperature", 0.0)
    top_p = fields.get("top_p", 1.0)
    top_k = fields.get("top_k", 0)
    seed = fields.get("seed")
    prompt_id = fields.get("prompt_id", 0)
    stop_ids = fields.get("stop_ids", ())
    cache = fields.get("cache", True)
    logprobs = fields.get("logprobs", False)
    top_logprobs = fields.get("top_logprobs", 0)
    presence_penalty = fields.get("presence_penalty", 0.0)
    frequency_penalty = fields.get("frequency_penalty", 0.0)
    repetition_penalty = fields.get("repetition_penalty", 1.0)
    min_tokens = fields.get("min_tokens", 0)
    logit_bias = fields.get("logit_bias")
    options = OPT_TEXT_DELTAS if text_deltas else 0
    if not cache:
        options |= OPT_NO_CACHE
    if logprobs:
        options |= OPT_LOGPROBS
    options |= (top_logprobs << TOP_LOGPROBS_SHIFT) & TOP_LOGPROBS_MASK
    block = b""
    if (
        presence_penalty
        or frequency_penalty
        or repetition_penalty != 1.0
        or min_tokens
        or (logit_bias)
    ):
        options |= OPT_PROCESSING
        bias = np.array(list((logit_bias or {}).items()), BIAS_ENTRY)
        block = (
            REQUEST_PROCESSING.pack(
                presence_penalty, frequency_penalty, repetition_penalty, min_tokens, len(bias), 0
            )
            + bias.tobytes()
        )
    if isinstance(prompt, str):
        body = prompt.encode("utf-8")
        options |= OPT_TEXT_PROMPT
    elif isinstance(prompt, bytes):
        body = prompt
        options |= OPT_TEXT_PROMPT
    else:
        body = np.asarray(prompt, dtype="<i4").tobytes()
    if seed is not None:
        options |= OPT_SEED
    fixed = REQUEST_FIXED.pack(
        max_tokens,
        temperature,
        top_p,
        top_k,
        seed or 0,
        prompt_id,
        len(stop_ids),
        options,
    )
    stops = np.asarray(stop_ids, dtype="<i4").tobytes()
    return encode_frame(FrameType.REQUEST, stream, fixed + stops + block + body)


def encode_json_request(stream: int, request: dict[str, Any]) -> bytes:
    body = json.dumps(request, separators=(",", ":")).encode("utf-8")
    return encode_frame(FrameType.REQUEST, stream, body, FLAG_JSON)


def encode_hello(api_key: bytes | str = b"", version: int = VERSION) -> bytes:
    key = api_key.encode("utf-8") if isinstance(api_key, str) else api_key
    return encode_frame(FrameType.HELLO, 0, HELLO_HEAD.pack(version, len(key)) + key)


def encode_welcome(
    max_frame_bytes: int,
    max_streams: int,
    vocab_size: int,
    eos_token_id: int,
    max_context: int,
    model: str,
    version: int = VERSION,
) -> bytes:
    body = WELCOME_HEAD.pack(
        version, 0, max_frame_bytes, max_streams, vocab_size, eos_token_id, max_context
    )
    return encode_frame(FrameType.WELCOME, 0, body + model.encode("utf-8"))


def encode_ping(data: bytes = b"") -> bytes:
    return encode_frame(FrameType.PING, 0, data)


def encode_pong(data: bytes = b"") -> bytes:
    return encode_frame(FrameType.PONG, 0, data)


def encode_cancel(stream: int) -> bytes:
    return encode_frame(FrameType.CANCEL, stream)


def encode_error(stream: int, code: int, message: str, retry_after_ms: int = 0) -> bytes:
    # A message may quote the client (a JSON key with a lone surrogate): escaped, never raised.
    text = message.encode("utf-8", "backslashreplace")
    body = ERROR_HEAD.pack(code, 0, retry_after_ms) + text
    return encode_frame(FrameType.ERROR, stream, body)


def encode_goaway(in_flight: int, reason: str = "") -> bytes:
    return encode_frame(FrameType.GOAWAY, 0, GOAWAY_HEAD.pack(in_flight) + reason.encode("utf-8"))


def encode_token(stream: int, ids: list[int] | np.ndarray, text: bytes = b"") -> bytes:
    body = TOKEN_HEAD.pack(len(ids), 0) + np.asarray(ids, dtype="<i4").tobytes() + text
    return encode_frame(FrameType.TOKEN, stream, body)


def encode_logprobs(stream: int, token: np.ndarray, top_ids: np.ndarray, top: np.ndarray) -> bytes:
    """A LOGPROBS frame for the n ids of the TOKEN frame before it: each id's logprob
    (``token`` [n]), and k alternatives per id (``top_ids`` / ``top`` [n, k], descending)."""
    n = len(token)
    k = top_ids.shape[1] if top_ids.ndim == 2 else 0
    body = (
        LOGPROBS_HEAD.pack(n, k, 0)
        + np.asarray(token, "<f4").tobytes()
        + np.asarray(top_ids, "<i4").tobytes()
        + np.asarray(top, "<f4").tobytes()
    )
    return encode_frame(FrameType.LOGPROBS, stream, body)


def encode_done(stream: int, done: Done) -> bytes:
    body = DONE_BODY.pack(
        done.finish_reason,
        done.cache,
        0,
        done.prompt_tokens,
        done.completion_tokens,
        done.queue_us,
        done.ttft_us,
        done.total_us,
    )
    return encode_frame(FrameType.DONE, stream, body)


# Hot-path packers: write straight into a caller's reusable bytearray (no intermediate bytes).
_TOKEN_FRAME_HEAD = struct.Struct("<IBBHIHH")  # header + TOKEN's n_ids/reserved
_TOKEN = int(FrameType.TOKEN)
_DONE_FRAME = struct.Struct("<IBBHI" + "BBHIIIII")
_DONE = int(FrameType.DONE)
DONE_FRAME_SIZE = _DONE_FRAME.size


def token_frame_size(n_ids: int, text_len: int) -> int:
    return HEADER_SIZE + TOKEN_HEAD.size + 4 * n_ids + text_len


def pack_token_into(
    buf: bytearray, offset: int, stream: int, ids: list[int] | tuple[int, ...], text: bytes
) -> int:
    """Write a TOKEN frame at ``offset`` (the buffer must have room); returns the new offset."""
    n = len(ids)
    length = TOKEN_HEAD.size + 4 * n + len(text)
    _TOKEN_FRAME_HEAD.pack_into(buf, offset, length, _TOKEN, 0, 0, stream, n, 0)
    offset += HEADER_SIZE + TOKEN_HEAD.size
    if n == 1:
        struct.pack_into("<i", buf, offset, ids[0])
    elif n:
        struct.pack_into(f"<{n}i", buf, offset, *ids)
    offset += 4 * n
    end = offset + len(text)
    buf[offset:end] = text
    return end


TOKEN1_FRAME = struct.Struct("<IBBHIHHi")  # a TOKEN frame carrying exactly one id
TOKEN1_FRAME_SIZE = TOKEN1_FRAME.size  # 20


TOKEN1_STREAM, TOKEN1_ID = 2, 4  # the stream's and the id's word in token1_frames
# A one-id TOKEN frame without text as its five int32 words, stream and id 0: TOKEN1_FRAME's own
# bytes, so the layout stays defined once.
_TOKEN1_WORDS = np.frombuffer(TOKEN1_FRAME.pack(8, int(FrameType.TOKEN), 0, 0, 0, 1, 0, 0), "<i4")


def token1_frames(streams: np.ndarray) -> np.ndarray:
    """One-id TOKEN frames without text, one per stream, as little-endian int32 words [n, 5]
    (``TOKEN1_FRAME``'s layout), the id left 0 for the caller to fill in column TOKEN1_ID. The
    array's bytes are the n frames exactly as ``pack_token1_into`` writes them, so the header
    words can be built once and reused."""
    frames = np.tile(_TOKEN1_WORDS, (len(streams), 1))
    frames[:, TOKEN1_STREAM] = np.asarray(streams, "<u4").view("<i4")
    return frames


def pack_token1_into(buf: bytearray, offset: int, stream: int, token: int, text: bytes) -> int:
    """The common case of ``pack_token_into``: one id and an optional text delta."""
    TOKEN1_FRAME.pack_into(buf, offset, 8 + len(text), _TOKEN, 0, 0, stream, 1, 0, token)
    offset += TOKEN1_FRAME_SIZE
    if text:
        end = offset + len(text)
        buf[offset:end] = text
        return end
    return offset


def pack_done_into(
    buf: bytearray,
    offset: int,
    stream: int,
    finish_reason: int,
    cache: int,
    prompt_tokens: int,
    completion_tokens: int,
    queue_us: int,
    ttft_us: int,
    total_us: int,
) -> int:
    _DONE_FRAME.pack_into(
        buf,
        offset,
        DONE_BODY.size,
        _DONE,
        0,
        0,
        stream,
        finish_reason,
        cache,
        0,
        prompt_tokens,
        completion_tokens,
        min(queue_us, U32_MAX),
        min(ttft_us, U32_MAX),
        min(total_us, U32_MAX),
    )
    return offset + DONE_FRAME_SIZE
