"""Unit tests of the frame codec (gateway/zerolayer/frames/protocol.py): round trips, incremental
decoding, zero-copy views, every header and payload rule of docs/protocol.md, and the hot-path
packers."""

from __future__ import annotations

import json
import random
import struct

import numpy as np
import pytest

from zerolayer.codes import Refusal
from zerolayer.frames import protocol as p
from zerolayer.frames import requests
from zerolayer.frames.protocol import ErrorCode, FinishReason, FrameType, ProtocolError
from zerolayer.request_path.request import Request

HDR = struct.Struct("<IBBHI")
MAX = 1 << 20


def raw(ftype: int, stream: int, payload: bytes = b"", flags: int = 0, reserved: int = 0) -> bytes:
    """A frame built from the header layout alone, to test the decoder without our encoders."""
    return HDR.pack(len(payload), ftype, flags, reserved, stream) + payload


def decode_all(role: str, data: bytes, chunks: list[int] | None = None, **kw) -> list[tuple]:
    """Feed ``data`` (in ``chunks`` sizes if given) and collect frames, payloads copied out."""
    dec = p.FrameDecoder(role, kw.pop("max_frame_bytes", MAX), **kw)
    out: list[tuple] = []
    pos = 0
    for size in chunks or [len(data)]:
        dec.feed(data[pos : pos + size])
        pos += size
        while (frame := dec.next_frame()) is not None:
            ftype, flags, stream, payload = frame
            assert isinstance(payload, memoryview)
            out.append((ftype, flags, stream, bytes(payload)))
    assert pos == len(data)
    assert dec.buffered == 0
    return out


def decode_one(role: str, data: bytes) -> tuple[int, int, int, memoryview]:
    dec = p.FrameDecoder(role, MAX)
    dec.feed(data)
    frame = dec.next_frame()
    assert frame is not None and dec.next_frame() is None
    return frame


def header_error(role: str, data: bytes, max_frame_bytes: int = MAX) -> ProtocolError:
    dec = p.FrameDecoder(role, max_frame_bytes)
    dec.feed(data)
    with pytest.raises(ProtocolError) as exc:
        dec.next_frame()
    return exc.value


def random_splits(rng: random.Random, n: int) -> list[int]:
    sizes = []
    while n:
        size = min(n, rng.randint(1, 40))
        sizes.append(size)
        n -= size
    return sizes


def binary_payload(
    max_tokens: int = 4,
    temperature: float = 0.0,
    top_p: float = 1.0,
    top_k: int = 0,
    seed: int = 0,
    prompt_id: int = 0,
    n_stop: int = 0,
    options: int = 0,
    tail: bytes = b"\x01\x00\x00\x00",
) -> memoryview:
    """A binary REQUEST payload written from the layout table, so fields can be made invalid."""
    fixed = struct.pack(
        "<IffIQIHH", max_tokens, temperature, top_p, top_k, seed, prompt_id, n_stop, options
    )
    return memoryview(fixed + tail)


def request_error(payload: memoryview | bytes, flags: int = 0) -> Refusal:
    """A REQUEST payload refused: the stream ends in INVALID_REQUEST, never the connection."""
    with pytest.raises(Refusal) as exc:
        requests.parse_request(flags, memoryview(payload))
    assert exc.value.code == ErrorCode.INVALID_REQUEST
    return exc.value


def parse_json(obj: object) -> Request:
    body = obj if isinstance(obj, bytes) else json.dumps(obj).encode()
    return requests.parse_request(p.FLAG_JSON, memoryview(body))


def json_error(obj: object) -> Refusal:
    body = obj if isinstance(obj, bytes) else json.dumps(obj).encode()
    return request_error(body, flags=p.FLAG_JSON)


# ------------------------------------------------------------------------------------ round trips


def test_round_trip_binary_request_token_ids() -> None:
    wire = p.encode_request(
        5, [1, -2, 2**31 - 1], 12, top_k=3, stop_ids=[9, 10], prompt_id=4, seed=0
    )
    ftype, flags, stream, payload = decode_one("server", wire)
    assert (ftype, flags, stream) == (FrameType.REQUEST, 0, 5)
    req = requests.parse_request(flags, payload)
    s = req.sampling
    assert req.max_tokens == 12 and s.top_k == 3 and req.prompt_id == 4
    assert s.seed == 0  # seed 0 with the seed bit set is a real seed, not "none"
    assert req.stop_ids.tolist() == [9, 10]
    assert req.prompt_ids.tolist() == [1, -2, 2**31 - 1]
    assert req.prompt_text is None and not req.want_text


def test_round_trip_binary_request_text_prompt() -> None:
    wire = p.encode_request(
        1, "héllo ✓", 3, temperature=0.25, top_p=0.5, seed=2**64 - 1, text_deltas=True
    )
    req = requests.parse_request(0, decode_one("server", wire)[3])
    assert req.prompt_text == "héllo ✓" and req.prompt_ids is None
    s = req.sampling
    assert (s.temperature, s.top_p, s.seed, req.want_text) == (0.25, 0.5, 2**64 - 1, True)
    assert req.stop_ids.dtype == np.int32 and len(req.stop_ids) == 0


def test_round_trip_binary_request_bytes_prompt_is_text() -> None:
    req = requests.parse_request(0, decode_one("server", p.encode_request(2, b"abc", 1))[3])
    assert req.prompt_text == "abc"


def test_round_trip_json_request() -> None:
    body = {
        "max_tokens": 64,
        "system": "You are terse.",
        "messages": [
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello"},
            {"role": "user", "content": "Bye ✓"},
        ],
        "temperature": 0.7,
        "top_p": 0.9,
        "top_k": 50,
        "seed": 123,
        "prompt_id": 2,
        "stop_sequences": ["\n\n", "END"],
    }
    ftype, flags, stream, payload = decode_one("server", p.encode_json_request(11, body))
    assert (ftype, flags, stream) == (FrameType.REQUEST, p.FLAG_JSON, 11)
    req = requests.parse_request(flags, payload)
    assert req.want_text
    assert req.messages == body["messages"] and req.system == "You are terse."
    s = req.sampling
    assert (req.max_tokens, s.temperature, s.top_p, s.top_k) == (64, 0.7, 0.9, 50)
    assert (s.seed, req.prompt_id) == (123, 2)
    assert req.stop_sequences == ("\n\n", "END")


def test_round_trip_json_prompt_defaults() -> None:
    req = parse_json({"max_tokens": 1, "prompt": "x"})
    assert req.prompt_text == "x" and req.messages is None and req.system is None
    s = req.sampling
    assert (s.temperature, s.top_p, s.top_k) == (0.0, 1.0, 0)
    assert s.seed is None and req.prompt_id == 0
    assert req.stop_sequences == ()


@pytest.mark.parametrize(
    ("ids", "text"), [([5], b""), ([1, 2, 3], b"abc"), ([], "é".encode()), ([-1, 2**31 - 1], b"")]
)
def test_round_trip_token(ids: list[int], text: bytes) -> None:
    ftype, _, stream, payload = decode_one("client", p.encode_token(3, ids, text))
    assert (ftype, stream) == (FrameType.TOKEN, 3)
    got_ids, got_text = p.parse_token(payload)
    assert got_ids.tolist() == ids and got_text == text


def test_round_trip_done() -> None:
    done = p.Done(FinishReason.CANCELLED, p.CACHE_RESPONSE | p.CACHE_PROMPT, 10, 0, 1, 2, 2**32 - 1)
    ftype, _, stream, payload = decode_one("client", p.encode_done(8, done))
    assert (ftype, stream) == (FrameType.DONE, 8)
    assert p.parse_done(payload) == done


@pytest.mark.parametrize("role", ["server", "client"])
@pytest.mark.parametrize("data", [b"", b"x", bytes(range(64))])
def test_round_trip_ping_pong(role: str, data: bytes) -> None:
    for encode, ftype in ((p.encode_ping, FrameType.PING), (p.encode_pong, FrameType.PONG)):
        got_type, flags, stream, payload = decode_one(role, encode(data))
        assert (got_type, flags, stream, bytes(payload)) == (ftype, 0, 0, data)
    p.check_ping(memoryview(data))


@pytest.mark.parametrize("stream", [0, 1, 2**32 - 1])
def test_round_trip_error(stream: int) -> None:
    wire = p.encode_error(stream, ErrorCode.OVERLOADED, "queue full ✓", retry_after_ms=1500)
    ftype, _, got_stream, payload = decode_one("client", wire)
    assert (ftype, got_stream) == (FrameType.ERROR, stream)
    assert p.parse_error(payload) == (ErrorCode.OVERLOADED, 1500, "queue full ✓")


def test_round_trip_cancel() -> None:
    ftype, _, stream, payload = decode_one("server", p.encode_cancel(42))
    assert (ftype, stream, len(payload)) == (FrameType.CANCEL, 42, 0)
    p.check_cancel(payload)


@pytest.mark.parametrize("key", [b"", b"k", "sk-ünïcode", bytes(range(256))])
def test_round_trip_hello(key: bytes | str) -> None:
    ftype, _, stream, payload = decode_one("server", p.encode_hello(key))
    assert (ftype, stream) == (FrameType.HELLO, 0)
    expected = key.encode() if isinstance(key, str) else key
    assert p.parse_hello(payload) == (p.VERSION, expected)
    assert p.parse_hello(decode_one("server", p.encode_hello(key, version=9))[3])[0] == 9


def test_round_trip_welcome() -> None:
    wire = p.encode_welcome(4096, 16, 50257, -1, 8192, "llama-ünï")
    ftype, _, stream, payload = decode_one("client", wire)
    assert (ftype, stream) == (FrameType.WELCOME, 0)
    assert p.parse_welcome(payload) == p.Welcome(2, 4096, 16, 50257, -1, 8192, "llama-ünï")
    v1 = p.encode_welcome(4096, 16, 50257, -1, 8192, "x", version=1)
    assert p.parse_welcome(decode_one("client", v1)[3]).version == 1


def test_round_trip_goaway() -> None:
    ftype, _, stream, payload = decode_one("client", p.encode_goaway(3, "shutting down"))
    assert (ftype, stream) == (FrameType.GOAWAY, 0)
    assert p.parse_goaway(payload) == (3, "shutting down")
    assert p.parse_goaway(decode_one("client", p.encode_goaway(0))[3]) == (0, "")


# ----------------------------------------------------------------------------- incremental input


def server_bound_stream() -> bytes:
    return b"".join(
        [
            p.encode_hello(b"key"),
            p.encode_request(1, [1, 2, 3], 5),
            p.encode_ping(b"12345678"),
            p.encode_json_request(2, {"max_tokens": 2, "prompt": "hi"}),
            p.encode_cancel(1),
            p.encode_request(3, "x" * 3000, 5, stop_ids=[1] * 100),
            p.encode_pong(b""),
        ]
    )


def client_bound_stream() -> bytes:
    return b"".join(
        [
            p.encode_welcome(1 << 20, 8, 256, -1, 512, "m"),
            p.encode_token(1, [1, 2], b"ab"),
            p.encode_token(1, [], b"c"),
            p.encode_done(1, p.Done(0, 0, 3, 2, 1, 2, 3)),
            p.encode_error(2, ErrorCode.RATE_LIMITED, "slow down", 10),
            p.encode_token(3, list(range(2000)), b"z" * 500),
            p.encode_goaway(1, "bye"),
            p.encode_error(0, ErrorCode.IDLE_TIMEOUT, "idle"),
        ]
    )


@pytest.mark.parametrize(
    ("role", "make"), [("server", server_bound_stream), ("client", client_bound_stream)]
)
def test_byte_by_byte_equals_one_feed(role: str, make) -> None:
    data = make()
    whole = decode_all(role, data)
    assert len(whole) == 7 if role == "server" else len(whole) == 8
    assert decode_all(role, data, [1] * len(data), initial_size=24) == whole


@pytest.mark.parametrize(
    ("role", "make"), [("server", server_bound_stream), ("client", client_bound_stream)]
)
def test_random_splits_equal_one_feed(role: str, make) -> None:
    data = make()
    whole = decode_all(role, data)
    rng = random.Random(1234)
    for _ in range(30):
        initial = rng.choice([24, 64, 1000, 65536])
        assert decode_all(role, data, random_splits(rng, len(data)), initial_size=initial) == whole


def test_many_frames_in_one_feed_come_out_in_order() -> None:
    frames = [p.encode_token(s, [s, s + 1], str(s).encode()) for s in range(1, 301)]
    out = decode_all("client", b"".join(frames), initial_size=64)
    assert [f[2] for f in out] == list(range(1, 301))
    for ftype, _, stream, payload in out:
        assert ftype == FrameType.TOKEN
        ids, text = p.parse_token(memoryview(payload))
        assert ids.tolist() == [stream, stream + 1] and text == str(stream).encode()


def test_partial_header_and_partial_payload_return_none() -> None:
    wire = p.encode_token(1, [1, 2, 3], b"xyz")
    dec = p.FrameDecoder("client", MAX)
    dec.feed(wire[:11])
    assert dec.next_frame() is None
    dec.feed(wire[11:-1])
    assert dec.next_frame() is None
    dec.feed(wire[-1:])
    frame = dec.next_frame()
    assert frame is not None and bytes(frame[3]) == wire[12:]
    assert dec.next_frame() is None


def pump(dec: p.FrameDecoder, data: bytes, rng: random.Random, limit: int) -> list[bytes]:
    """Drive the decoder like the server's BufferedProtocol: get_buffer, write, advance, drain."""
    out: list[bytes] = []
    pos = 0
    while pos < len(data):
        view = dec.get_buffer()
        assert len(view) > 0
        n = min(len(view), len(data) - pos, rng.randint(1, 3 * limit))
        view[:n] = data[pos : pos + n]
        dec.advance(n)
        pos += n
        while (frame := dec.next_frame()) is not None:
            out.append(bytes(frame[3]))
        assert dec.capacity <= max(64, limit + p.HEADER_SIZE)
    return out


def test_buffer_grows_only_to_one_max_frame() -> None:
    limit = 4096
    rng = random.Random(7)
    frames = [p.encode_request(s, b"a" * rng.randint(1, limit - 32), 1) for s in range(1, 60)] + [
        p.encode_request(99, b"b" * (limit - 32), 1)
    ]  # exactly max_frame_bytes of payload
    dec = p.FrameDecoder("server", limit, initial_size=64)
    payloads = pump(dec, b"".join(frames), rng, limit)
    assert payloads == [f[12:] for f in frames]
    assert dec.capacity == limit + p.HEADER_SIZE  # it did grow, but not past one full frame


def test_buffer_grows_only_to_one_max_frame_with_feed() -> None:
    # Fed one frame at a time (and drained), feed() stays within the same bound.
    limit = 2048
    dec = p.FrameDecoder("server", limit, initial_size=64)
    for size in (10, 500, limit - 32, 7, limit - 32, 1):
        dec.feed(p.encode_request(1, b"q" * size, 1))
        frame = dec.next_frame()
        assert frame is not None and len(frame[3]) == 32 + size
        assert dec.capacity <= limit + p.HEADER_SIZE


# ------------------------------------------------------------------------------ zero-copy views


def test_payload_is_a_memoryview_into_the_buffer() -> None:
    dec = p.FrameDecoder("client", MAX)
    dec.feed(p.encode_token(1, [10, 20, 30], b"hey"))
    *_, payload = dec.next_frame()
    assert isinstance(payload, memoryview)
    # Writing through the view changes what parse_token reads: no copy was made.
    ids, _ = p.parse_token(payload)
    assert ids.tolist() == [10, 20, 30]
    assert not ids.flags.owndata
    assert np.shares_memory(ids, np.frombuffer(payload, dtype=np.uint8))
    payload[4:8] = struct.pack("<i", 99)
    assert ids[0] == 99


def test_token_ids_are_int32_views() -> None:
    ids, text = p.parse_token(decode_one("client", p.encode_token(2, [1, -1, 7], b""))[3])
    assert ids.dtype == np.int32 and ids.dtype.itemsize == 4
    assert text == b""
    assert ids.base is not None


def test_request_prompt_ids_are_copied_out_of_the_buffer() -> None:
    # The receive buffer is reused; a parsed Request must not alias it.
    payload = decode_one("server", p.encode_request(1, [4, 5, 6], 2, stop_ids=[8]))[3]
    req = requests.parse_request(0, payload)
    raw_bytes = np.frombuffer(payload, dtype=np.uint8)
    assert not np.shares_memory(req.prompt_ids, raw_bytes)
    assert not np.shares_memory(req.stop_ids, raw_bytes)
    payload[32:36] = b"\0\0\0\0"
    assert req.stop_ids.tolist() == [8] and req.prompt_ids.tolist() == [4, 5, 6]


# --------------------------------------------------------------------------------- header errors


@pytest.mark.parametrize("ftype", [0x00, 0x0C, 0x7F, 0xFF])
@pytest.mark.parametrize("role", ["server", "client"])
def test_unknown_type(ftype: int, role: str) -> None:
    err = header_error(role, raw(ftype, 0))
    assert err.code == ErrorCode.MALFORMED_FRAME


@pytest.mark.parametrize(
    ("role", "ftype", "stream", "flags"),
    [
        ("server", FrameType.REQUEST, 1, 0x02),
        ("server", FrameType.REQUEST, 1, 0x80),
        ("server", FrameType.PING, 0, 0x01),
        ("server", FrameType.CANCEL, 1, 0x01),
        ("server", FrameType.HELLO, 0, 0x01),
        ("client", FrameType.TOKEN, 1, 0x01),
        ("client", FrameType.ERROR, 0, 0x01),
    ],
)
def test_unknown_flag_bits(role: str, ftype: int, stream: int, flags: int) -> None:
    assert header_error(role, raw(ftype, stream, flags=flags)).code == ErrorCode.MALFORMED_FRAME


@pytest.mark.parametrize("reserved", [1, 0x8000, 0xFFFF])
def test_nonzero_reserved(reserved: int) -> None:
    err = header_error("server", raw(FrameType.CANCEL, 1, reserved=reserved))
    assert err.code == ErrorCode.MALFORMED_FRAME


@pytest.mark.parametrize(
    ("ftype", "stream"),
    [
        (FrameType.TOKEN, 1),
        (FrameType.DONE, 1),
        (FrameType.ERROR, 1),
        (FrameType.ERROR, 0),
        (FrameType.WELCOME, 0),
        (FrameType.GOAWAY, 0),
    ],
)
def test_server_receiving_server_frames(ftype: int, stream: int) -> None:
    assert header_error("server", raw(ftype, stream)).code == ErrorCode.MALFORMED_FRAME


@pytest.mark.parametrize(
    ("ftype", "stream"), [(FrameType.REQUEST, 1), (FrameType.CANCEL, 1), (FrameType.HELLO, 0)]
)
def test_client_receiving_client_frames(ftype: int, stream: int) -> None:
    assert header_error("client", raw(ftype, stream)).code == ErrorCode.MALFORMED_FRAME


@pytest.mark.parametrize(
    ("role", "ftype", "stream"),
    [
        ("server", FrameType.REQUEST, 0),
        ("server", FrameType.CANCEL, 0),
        ("server", FrameType.PING, 1),
        ("server", FrameType.PONG, 2),
        ("server", FrameType.HELLO, 3),
        ("client", FrameType.TOKEN, 0),
        ("client", FrameType.DONE, 0),
        ("client", FrameType.PING, 1),
        ("client", FrameType.PONG, 1),
        ("client", FrameType.WELCOME, 1),
        ("client", FrameType.GOAWAY, 5),
    ],
)
def test_wrong_kind_of_stream(role: str, ftype: int, stream: int) -> None:
    err = header_error(role, raw(ftype, stream, b"" if ftype != FrameType.REQUEST else b"x" * 32))
    assert err.code == ErrorCode.MALFORMED_FRAME


def test_error_frame_allowed_on_any_stream() -> None:
    for stream in (0, 1, 2**32 - 1):
        assert decode_one("client", raw(FrameType.ERROR, stream, bytes(8)))[2] == stream


def test_frame_too_large_from_the_header_alone() -> None:
    dec = p.FrameDecoder("server", 1000, initial_size=64)
    dec.feed(HDR.pack(1001, FrameType.REQUEST, 0, 0, 1)[:11])
    assert dec.next_frame() is None
    dec.feed(HDR.pack(1001, FrameType.REQUEST, 0, 0, 1)[11:])  # no payload byte sent
    with pytest.raises(ProtocolError) as exc:
        dec.next_frame()
    assert exc.value.code == ErrorCode.FRAME_TOO_LARGE
    assert dec.capacity == 64  # nothing was allocated for the refused payload


def test_frame_too_large_for_huge_lengths_without_allocating() -> None:
    dec = p.FrameDecoder("client", 1 << 16, initial_size=64)
    dec.feed(HDR.pack(2**32 - 1, FrameType.TOKEN, 0, 0, 1))
    with pytest.raises(ProtocolError) as exc:
        dec.next_frame()
    assert exc.value.code == ErrorCode.FRAME_TOO_LARGE
    assert dec.capacity == 64


def test_length_equal_to_max_is_accepted() -> None:
    out = decode_all("server", p.encode_request(1, b"z" * (1000 - 32), 1), max_frame_bytes=1000)
    assert len(out) == 1 and len(out[0][3]) == 1000


def test_invalid_role() -> None:
    with pytest.raises(ValueError):
        p.FrameDecoder("peer", MAX)


# ------------------------------------------------------------------ connection-level payload rules


@pytest.mark.parametrize(
    "payload",
    [
        b"",
        b"\x01\x00",
        b"\x01\x00\x03\x00ab",  # key_len 3, 2 key bytes
        b"\x01\x00\x01\x00ab",  # key_len 1, 2 key bytes
        b"\x01\x00\xff\xff",
    ],
)
def test_hello_key_len_mismatch(payload: bytes) -> None:
    with pytest.raises(ProtocolError) as exc:
        p.parse_hello(memoryview(payload))
    assert exc.value.code == ErrorCode.MALFORMED_FRAME


def test_ping_over_64_bytes() -> None:
    p.check_ping(memoryview(bytes(64)))
    payload = decode_one("server", p.encode_ping(bytes(65)))[3]  # the header itself is fine
    with pytest.raises(ProtocolError) as exc:
        p.check_ping(payload)
    assert exc.value.code == ErrorCode.MALFORMED_FRAME


def test_cancel_with_payload() -> None:
    payload = decode_one("server", raw(FrameType.CANCEL, 4, b"\0"))[3]
    with pytest.raises(ProtocolError) as exc:
        p.check_cancel(payload)
    assert exc.value.code == ErrorCode.MALFORMED_FRAME


# ----------------------------------------------------------------------- binary REQUEST errors


@pytest.mark.parametrize("size", [0, 1, 31])
def test_request_short_payload(size: int) -> None:
    request_error(bytes(binary_payload())[:size])


@pytest.mark.parametrize("options", [0x0040, 0x0080, 0x8000, 0xFFFF])
def test_request_unknown_option_bits(options: int) -> None:
    assert "option" in request_error(binary_payload(options=options)).message


def test_request_max_tokens_zero() -> None:
    assert "max_tokens" in request_error(binary_payload(max_tokens=0)).message


@pytest.mark.parametrize(("n_stop", "tail"), [(1, b""), (2, b"\0" * 4), (0xFFFF, b"\0" * 40)])
def test_request_n_stop_does_not_fit(n_stop: int, tail: bytes) -> None:
    assert "n_stop" in request_error(binary_payload(n_stop=n_stop, tail=tail)).message


def test_request_n_stop_exactly_fits_with_prompt_id() -> None:
    req = requests.parse_request(0, binary_payload(n_stop=2, prompt_id=3, tail=bytes(8)))
    assert req.stop_ids.tolist() == [0, 0] and len(req.prompt_ids) == 0


@pytest.mark.parametrize("tail", [b"\x01", b"\x01\0\0\0\x02", b"\x01\0\0\0\x02\0\0"])
def test_request_token_prompt_not_multiple_of_4(tail: bytes) -> None:
    assert "multiple of 4" in request_error(binary_payload(tail=tail)).message


@pytest.mark.parametrize("tail", [b"\xff", b"\xc3", b"ab\xe2\x82", b"\xed\xa0\x80"])
def test_request_invalid_utf8_text(tail: bytes) -> None:
    err = request_error(binary_payload(options=p.OPT_TEXT_PROMPT, tail=tail))
    assert "UTF-8" in err.message


@pytest.mark.parametrize("options", [0, p.OPT_TEXT_PROMPT])
def test_request_empty_prompt_without_prompt_id(options: int) -> None:
    request_error(binary_payload(options=options, tail=b""))
    req = requests.parse_request(0, binary_payload(options=options, tail=b"", prompt_id=1))
    assert req.prompt_id == 1


@pytest.mark.parametrize("temperature", [float("nan"), float("inf"), -0.5, float("-inf")])
def test_request_bad_temperature(temperature: float) -> None:
    assert "temperature" in request_error(binary_payload(temperature=temperature)).message


@pytest.mark.parametrize("top_p", [0.0, -0.1, 1.0001, 2.0, float("nan")])
def test_request_bad_top_p(top_p: float) -> None:
    assert "top_p" in request_error(binary_payload(top_p=top_p)).message


def test_request_seed_ignored_without_option_bit() -> None:
    assert requests.parse_request(0, binary_payload(seed=77)).sampling.seed is None
    with_bit = requests.parse_request(0, binary_payload(seed=77, options=p.OPT_SEED))
    assert with_bit.sampling.seed == 77


def test_request_refusal_names_its_field() -> None:
    assert request_error(binary_payload(max_tokens=0)).field == "max_tokens"
    assert request_error(binary_payload(temperature=2.5)).field == "temperature"
    assert request_error(binary_payload(top_k=2**31)).field == "top_k"


# ------------------------------------------------------------------------- JSON REQUEST errors


@pytest.mark.parametrize(
    "body",
    [b"", b"{", b"{'max_tokens': 1}", b"nul", b'{"max_tokens": 1,}', b"\xff\xfe", b"[" * 100000],
)
def test_json_invalid(body: bytes) -> None:
    json_error(body)


@pytest.mark.parametrize("obj", [[], [1], "prompt", 3, None, True])
def test_json_not_an_object(obj: object) -> None:
    assert "object" in json_error(obj).message


def test_json_unknown_keys() -> None:
    err = json_error({"max_tokens": 1, "prompt": "x", "stream": True, "model": "y"})
    assert "model" in err.message and "stream" in err.message


def test_json_missing_max_tokens() -> None:
    assert "max_tokens" in json_error({"prompt": "x"}).message


@pytest.mark.parametrize(
    "obj",
    [
        {"max_tokens": 1},
        {"max_tokens": 1, "prompt": "x", "messages": [{"role": "user", "content": "x"}]},
    ],
)
def test_json_both_or_neither_prompt_and_messages(obj: dict) -> None:
    assert "exactly one" in json_error(obj).message


@pytest.mark.parametrize(
    "messages",
    [
        [],
        "hi",
        [{"role": "system", "content": "x"}],
        [{"role": "tool", "content": "x"}],
        [{"role": "User", "content": "x"}],
        [{"role": "user"}],
        [{"content": "x"}],
        [{"role": "user", "content": 5}],
        [{"role": "user", "content": None}],
        [{"role": "user", "content": "x", "name": "bob"}],
        ["user: hi"],
        [{"role": "user", "content": "ok"}, {"role": "bot", "content": "x"}],
    ],
)
def test_json_bad_messages(messages: object) -> None:
    json_error({"max_tokens": 1, "messages": messages})


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("max_tokens", 0),
        ("max_tokens", -1),
        ("max_tokens", 2**32),
        ("max_tokens", 1.5),
        ("max_tokens", "8"),
        ("max_tokens", True),
        ("max_tokens", None),
        ("temperature", "hot"),
        ("temperature", True),
        ("temperature", -1),
        ("temperature", 2.001),
        pytest.param("temperature", 10**400, id="temperature-huge-int"),
        ("top_p", 0),
        ("top_p", 1.5),
        ("top_p", [1]),
        ("top_k", -2),
        ("top_k", 2.0),
        ("top_k", 2**31),
        ("prompt_id", -1),
        ("prompt_id", "1"),
        ("prompt", 5),
        ("prompt", None),
        ("system", 5),
        ("system", ["x"]),
    ],
)
def test_json_bad_types_and_ranges(key: str, value: object) -> None:
    obj = {"max_tokens": 4, "prompt": "hello", key: value}
    assert key in json_error(obj).message


def test_json_min_p_is_read_and_its_range_checked() -> None:
    assert parse_json({"max_tokens": 1, "prompt": "x", "min_p": 0.05}).sampling.min_p == 0.05
    assert parse_json({"max_tokens": 1, "prompt": "x", "min_p": None}).sampling.min_p == 0.0
    for bad in (-0.01, 1.01, "0.1", True):
        err = json_error({"max_tokens": 1, "prompt": "x", "min_p": bad})
        assert err.field == "min_p", bad
    # JSON only: the binary layout of version 2 has no field for it.
    assert "min_p" not in p.RequestOptions.__optional_keys__


@pytest.mark.parametrize("key", ["+5", " 5", "5 ", "1_0", "05", "-0", "\u0663", "1e3", "x"])
def test_json_logit_bias_keys_other_than_canonical_decimals_are_refused(key: str) -> None:
    # As on the HTTP door: "+5", " 5" and "1_0" used to be read here (the last as 10).
    err = json_error({"max_tokens": 1, "prompt": "x", "logit_bias": {key: 1.0}})
    assert err.field == "logit_bias" and repr(key) in err.message


def test_json_logit_bias_keys_are_token_ids_the_vocabulary_check_is_the_input_processors() -> None:
    req = parse_json({"max_tokens": 1, "prompt": "x", "logit_bias": {"0": 1, "-1": 2, "42": None}})
    assert req.sampling.logit_bias == {0: 1.0, -1: 2.0}  # null: absent; -1: refused by inputs


@pytest.mark.parametrize("seed", [-(2**63) - 1, 2**64, 1.0, "1", True])
def test_json_seed_out_of_range(seed: object) -> None:
    assert "seed" in json_error({"max_tokens": 1, "prompt": "x", "seed": seed}).message


@pytest.mark.parametrize("seed", [0, 1, 2**64 - 1, -1, -(2**63)])
def test_json_seed_in_range(seed: int) -> None:
    # A negative seed (OpenAI's are int64) is its two's complement, as on the HTTP door.
    assert parse_json({"max_tokens": 1, "prompt": "x", "seed": seed}).sampling.seed == seed % 2**64


def test_json_nulls_are_absent_and_minus_one_top_k_is_off() -> None:
    # The JSON conventions of every door (zerolayer.request_path.validation): null = absent, top_k
    # -1 = off.
    req = parse_json(
        {"max_tokens": 1, "prompt": "x", "temperature": None, "seed": None, "top_k": -1}
    )
    s = req.sampling
    assert (s.temperature, s.seed, s.top_k) == (0.0, None, 0)


@pytest.mark.parametrize("stops", ["\n", [1], [""], ["ok", None], {"a": 1}, [["x"]]])
def test_json_stop_sequences_types(stops: object) -> None:
    err = json_error({"max_tokens": 1, "prompt": "x", "stop_sequences": stops})
    assert "stop_sequences" in err.message


def test_json_empty_prompt() -> None:
    json_error({"max_tokens": 1, "prompt": ""})
    # An empty prompt is fine when something else gives the model its input.
    assert parse_json({"max_tokens": 1, "prompt": "", "prompt_id": 3}).prompt_id == 3
    assert parse_json({"max_tokens": 1, "prompt": "", "system": "s"}).system == "s"


@pytest.mark.parametrize(
    "body",
    [
        b'{"max_tokens":1,"prompt":"\\ud800"}',
        b'{"max_tokens":1,"prompt":"x","system":"\\udfff"}',
        b'{"max_tokens":1,"prompt":"x","stop_sequences":["\\ud83d"]}',
        b'{"max_tokens":1,"messages":[{"role":"user","content":"a\\ud800b"}]}',
    ],
)
def test_json_lone_surrogates_are_invalid_utf8(body: bytes) -> None:
    json_error(body)


def test_json_surrogate_pair_is_fine() -> None:
    req = parse_json(b'{"max_tokens":1,"prompt":"\\ud83d\\ude00"}')
    assert req.prompt_text == "\U0001f600"


def test_json_refusal_names_its_field() -> None:
    assert json_error({"prompt": "x"}).field == "max_tokens"
    assert json_error({"max_tokens": 1, "prompt": "x", "top_p": 0}).field == "top_p"


# -------------------------------------------------------------- client-side payload parsing errors


def test_client_side_parsers_reject_short_payloads() -> None:
    for parse, size in (
        (p.parse_token, 4),
        (p.parse_error, 8),
        (p.parse_welcome, 24),
        (p.parse_goaway, 4),
    ):
        with pytest.raises(ProtocolError):
            parse(memoryview(bytes(size - 1)))
    for size in (0, 23, 25):
        with pytest.raises(ProtocolError):
            p.parse_done(memoryview(bytes(size)))
    with pytest.raises(ProtocolError):
        p.parse_token(memoryview(b"\x02\x00\x00\x00" + bytes(7)))  # n_ids 2, 7 id bytes


# ------------------------------------------------------------------------------- hot-path packers


@pytest.mark.parametrize(
    ("ids", "text"),
    [([], b""), ([], b"tail"), ([7], b""), ([7], "✓".encode()), ([1, -2, 3, 2**31 - 1], b"abc")],
)
def test_pack_token_into_equals_encode_token(ids: list[int], text: bytes) -> None:
    expected = p.encode_token(77, ids, text)
    assert len(expected) == p.token_frame_size(len(ids), len(text))
    buf = bytearray(b"\xaa" * (len(expected) + 20))
    end = p.pack_token_into(buf, 5, 77, ids, text)
    assert end == 5 + len(expected)
    assert bytes(buf[5:end]) == expected
    assert buf[:5] == b"\xaa" * 5 and buf[end:] == b"\xaa" * 15  # nothing outside was touched


@pytest.mark.parametrize(("token", "text"), [(0, b""), (-1, b""), (2**31 - 1, "é✓".encode())])
def test_pack_token1_into_equals_encode_token(token: int, text: bytes) -> None:
    expected = p.encode_token(9, [token], text)
    buf = bytearray(b"\xaa" * (len(expected) + 8))
    end = p.pack_token1_into(buf, 3, 9, token, text)
    assert end == 3 + len(expected) == 3 + p.TOKEN1_FRAME_SIZE + len(text)
    assert bytes(buf[3:end]) == expected
    assert buf[:3] == b"\xaa" * 3 and buf[end:] == b"\xaa" * 5


def test_pack_done_into_equals_encode_done() -> None:
    done = p.Done(FinishReason.MAX_TOKENS, p.CACHE_PROMPT, 12, 34, 56, 78, 90)
    expected = p.encode_done(3, done)
    assert len(expected) == p.DONE_FRAME_SIZE == 36
    buf = bytearray(p.DONE_FRAME_SIZE * 3)
    end = p.pack_done_into(buf, p.DONE_FRAME_SIZE, 3, *_done_args(done))
    assert end == 2 * p.DONE_FRAME_SIZE
    assert bytes(buf[p.DONE_FRAME_SIZE : end]) == expected
    assert buf[: p.DONE_FRAME_SIZE] == bytes(p.DONE_FRAME_SIZE)


def _done_args(d: p.Done) -> tuple[int, ...]:
    return (
        d.finish_reason,
        d.cache,
        d.prompt_tokens,
        d.completion_tokens,
        d.queue_us,
        d.ttft_us,
        d.total_us,
    )


def test_pack_done_into_clamps_timings_to_u32() -> None:
    buf = bytearray(p.DONE_FRAME_SIZE)
    p.pack_done_into(buf, 0, 1, 0, 0, 1, 1, 2**40, 2**33, 2**32)
    done = p.parse_done(decode_one("client", bytes(buf))[3])
    assert (done.queue_us, done.ttft_us, done.total_us) == (2**32 - 1,) * 3


def test_packed_frames_in_one_buffer_decode_in_order() -> None:
    buf = bytearray(4096)
    end = 0
    for s in range(1, 6):
        end = p.pack_token_into(buf, end, s, [s] * s, b"t" * s)
    end = p.pack_done_into(buf, end, 5, FinishReason.EOS, 0, 1, 15, 0, 0, 0)
    out = decode_all("client", bytes(buf[:end]))
    assert [(f[0], f[2]) for f in out] == [(FrameType.TOKEN, s) for s in range(1, 6)] + [
        (FrameType.DONE, 5)
    ]
    completion = sum(len(p.parse_token(memoryview(f[3]))[0]) for f in out[:-1])
    assert p.parse_done(memoryview(out[-1][3])).completion_tokens == completion


def test_protocol_error_fields() -> None:
    err = ProtocolError(ErrorCode.MALFORMED_FRAME, "msg")
    assert (err.code, err.message, str(err)) == (ErrorCode.MALFORMED_FRAME, "msg", "msg")
    assert not isinstance(err, Refusal)  # a connection error is not one stream's refusal


def test_request_cache_bypass_bit_and_json_key() -> None:
    binary = p.encode_request(1, "Hi", 4, cache=False)
    assert requests.parse_request(0, memoryview(binary)[p.HEADER.size :]).use_cache is False
    plain = p.encode_request(1, "Hi", 4)
    assert requests.parse_request(0, memoryview(plain)[p.HEADER.size :]).use_cache is True
    for value, want in ((False, False), (True, True)):
        body = json.dumps({"max_tokens": 4, "prompt": "Hi", "cache": value}).encode()
        assert requests.parse_request(p.FLAG_JSON, memoryview(body)).use_cache is want
    body = json.dumps({"max_tokens": 4, "prompt": "Hi", "cache": 0}).encode()
    assert "cache" in request_error(body, flags=p.FLAG_JSON).message
