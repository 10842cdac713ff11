"""Property tests of the frame codec: any valid frame survives encode -> FrameDecoder (fed in any
chunking) -> parse, arbitrary bytes make the decoder and every payload parser raise nothing but
``ProtocolError`` (or a REQUEST's ``Refusal``), what the parser accepts fits the engine's columns,
and the fuzz corpus decodes safely."""

from __future__ import annotations

import contextlib
import json
import struct
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from benchmarks._support.fuzzframes import corpus_files, read_corpus
from zerolayer.codes import DONE_REASONS, Refusal
from zerolayer.engine.backend import ModelInfo
from zerolayer.frames import protocol as p
from zerolayer.frames import requests
from zerolayer.frames.protocol import ErrorCode, FrameType, ProtocolError
from zerolayer.request_path.inputs import InputProcessor
from zerolayer.request_path.request import Request
from zerolayer.sampling_params import SAMPLING_ROW, SamplingParams
from zerolayer.tokenizer import ByteTokenizer

MAX = 1 << 20
U16 = 2**16 - 1
U32 = 2**32 - 1
U64 = 2**64 - 1
I32 = st.integers(-(2**31), 2**31 - 1)
STREAM = st.integers(1, U32)

ROUND_TRIP = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
FUZZ = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])

# A frame under test: the bytes, and what decoding them must give back.
Case = tuple[bytes, tuple[Any, ...]]


def request_fields(req: Request) -> tuple[Any, ...]:
    return (
        req.max_tokens,
        req.sampling.temperature,
        req.sampling.top_p,
        req.sampling.top_k,
        req.sampling.seed,
        req.prompt_id,
        tuple(req.stop_ids.tolist()),
        None if req.prompt_ids is None else tuple(req.prompt_ids.tolist()),
        req.prompt_text,
        req.messages,
        req.system,
        req.stop_sequences,
        req.want_text,
    )


def decoded(ftype: int, flags: int, stream: int, payload: memoryview) -> tuple[Any, ...]:
    """What a receiver learns from one frame, through the public parsers."""
    if ftype == FrameType.REQUEST:
        body: Any = request_fields(requests.parse_request(flags, payload))
    elif ftype == FrameType.TOKEN:
        ids, text = p.parse_token(payload)
        body = (tuple(ids.tolist()), text)
    elif ftype == FrameType.DONE:
        body = p.parse_done(payload)
    elif ftype in (FrameType.PING, FrameType.PONG):
        if ftype == FrameType.PING:
            p.check_ping(payload)
        body = bytes(payload)
    elif ftype == FrameType.ERROR:
        body = p.parse_error(payload)
    elif ftype == FrameType.CANCEL:
        p.check_cancel(payload)
        body = None
    elif ftype == FrameType.HELLO:
        body = p.parse_hello(payload)
    elif ftype == FrameType.WELCOME:
        body = p.parse_welcome(payload)
    else:
        body = p.parse_goaway(payload)
    return (ftype, flags, stream, body)


# ------------------------------------------------------------------------ valid frame strategies

f32_temperature = st.floats(
    min_value=0, max_value=2, width=32
)  # zerolayer.request_path.validation's range
f32_top_p = st.floats(min_value=0, max_value=1, exclude_min=True, width=32)
text = st.text(max_size=40)  # hypothesis' default alphabet has no lone surrogates


@st.composite
def binary_requests(draw: st.DrawFn) -> Case:
    stream = draw(STREAM)
    max_tokens = draw(st.integers(1, U32))
    temperature, top_p = draw(f32_temperature), draw(f32_top_p)
    top_k, prompt_id = draw(st.integers(0, 2**31 - 1)), draw(st.integers(0, U32))
    seed = draw(st.none() | st.integers(0, U64))
    stop_ids = draw(st.lists(I32, max_size=8))
    text_deltas = draw(st.booleans())
    as_text = draw(st.booleans())
    prompt: Any = draw(text) if as_text else draw(st.lists(I32, max_size=32))
    if not prompt and not prompt_id:
        prompt_id = draw(st.integers(1, U32))
    wire = p.encode_request(
        stream,
        prompt,
        max_tokens,
        temperature=temperature,
        top_p=top_p,
        top_k=top_k,
        seed=seed,
        prompt_id=prompt_id,
        stop_ids=stop_ids,
        text_deltas=text_deltas,
    )
    fields = (
        max_tokens,
        temperature,
        top_p,
        top_k,
        seed,
        prompt_id,
        tuple(stop_ids),
        None if as_text else tuple(prompt),
        prompt if as_text else None,
        None,
        None,
        (),
        text_deltas,
    )
    return wire, (FrameType.REQUEST, 0, stream, fields)


@st.composite
def json_requests(draw: st.DrawFn) -> Case:
    stream = draw(STREAM)
    obj: dict[str, Any] = {"max_tokens": draw(st.integers(1, U32))}
    optional = {
        "system": text,
        "prompt_id": st.integers(0, U32),
        "temperature": st.floats(min_value=0, max_value=2),
        "top_p": st.floats(min_value=0, max_value=1, exclude_min=True),
        "top_k": st.integers(0, 2**31 - 1),
        "seed": st.integers(0, U64),
        "stop_sequences": st.lists(st.text(min_size=1, max_size=8), max_size=4),
    }
    for key, strategy in optional.items():
        if draw(st.booleans()):
            obj[key] = draw(strategy)
    if draw(st.booleans()):
        obj["prompt"] = draw(st.text(min_size=1, max_size=40))
    else:
        message = st.fixed_dictionaries(
            {"role": st.sampled_from(["user", "assistant"]), "content": text}
        )
        obj["messages"] = draw(st.lists(message, min_size=1, max_size=4))
    keys = list(obj)
    order = draw(st.permutations(keys))
    obj = {k: obj[k] for k in order}
    fields = (
        obj["max_tokens"],
        float(obj.get("temperature", 0.0)),
        float(obj.get("top_p", 1.0)),
        obj.get("top_k", 0),
        obj.get("seed"),
        obj.get("prompt_id", 0),
        (),
        None,
        obj.get("prompt"),
        obj.get("messages"),
        obj.get("system") or None,
        tuple(obj.get("stop_sequences", ())),
        True,
    )
    return p.encode_json_request(stream, obj), (FrameType.REQUEST, p.FLAG_JSON, stream, fields)


@st.composite
def pings_and_pongs(draw: st.DrawFn) -> Case:
    data = draw(st.binary(max_size=p.MAX_PING_BYTES))
    if draw(st.booleans()):
        return p.encode_ping(data), (FrameType.PING, 0, 0, data)
    return p.encode_pong(data), (FrameType.PONG, 0, 0, data)


@st.composite
def cancels(draw: st.DrawFn) -> Case:
    stream = draw(STREAM)
    return p.encode_cancel(stream), (FrameType.CANCEL, 0, stream, None)


@st.composite
def hellos(draw: st.DrawFn) -> Case:
    key, version = draw(st.binary(max_size=300)), draw(st.integers(0, U16))
    return p.encode_hello(key, version), (FrameType.HELLO, 0, 0, (version, key))


@st.composite
def tokens(draw: st.DrawFn) -> Case:
    stream = draw(STREAM)
    ids = draw(st.lists(I32, max_size=64))
    delta = draw(text).encode("utf-8")
    return p.encode_token(stream, ids, delta), (FrameType.TOKEN, 0, stream, (tuple(ids), delta))


@st.composite
def dones(draw: st.DrawFn) -> Case:
    stream = draw(STREAM)
    done = p.Done(
        draw(st.sampled_from(DONE_REASONS)),
        draw(st.integers(0, 3)),
        *(draw(st.integers(0, U32)) for _ in range(5)),
    )
    return p.encode_done(stream, done), (FrameType.DONE, 0, stream, done)


@st.composite
def errors(draw: st.DrawFn) -> Case:
    stream = draw(st.integers(0, U32))
    code, retry, message = (
        draw(st.sampled_from(list(ErrorCode))),
        draw(st.integers(0, U32)),
        draw(text),
    )
    wire = p.encode_error(stream, code, message, retry)
    return wire, (FrameType.ERROR, 0, stream, (code, retry, message))


@st.composite
def welcomes(draw: st.DrawFn) -> Case:
    mfb, streams, vocab, ctx = (draw(st.integers(0, U32)) for _ in range(4))
    eos, model = draw(I32), draw(text)
    wire = p.encode_welcome(mfb, streams, vocab, eos, ctx, model)
    return wire, (
        FrameType.WELCOME,
        0,
        0,
        p.Welcome(p.VERSION, mfb, streams, vocab, eos, ctx, model),
    )


@st.composite
def goaways(draw: st.DrawFn) -> Case:
    in_flight, reason = draw(st.integers(0, U32)), draw(text)
    return p.encode_goaway(in_flight, reason), (FrameType.GOAWAY, 0, 0, (in_flight, reason))


TO_SERVER = st.one_of(binary_requests(), json_requests(), pings_and_pongs(), cancels(), hellos())
TO_CLIENT = st.one_of(tokens(), dones(), pings_and_pongs(), errors(), welcomes(), goaways())


def split(data: bytes, cuts: list[int]) -> list[bytes]:
    points = sorted({c % (len(data) + 1) for c in cuts})
    bounds = [0, *points, len(data)]
    return [data[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]


def decode_chunks(role: str, chunks: list[bytes], initial_size: int) -> list[tuple[Any, ...]]:
    dec = p.FrameDecoder(role, MAX, initial_size=initial_size)
    out = []
    for chunk in chunks:
        dec.feed(chunk)
        while (frame := dec.next_frame()) is not None:
            out.append(decoded(*frame))  # parse now: the payload view dies on the next feed
    assert dec.buffered == 0
    return out


@ROUND_TRIP
@given(
    role=st.sampled_from(["server", "client"]),
    data=st.data(),
    cuts=st.lists(st.integers(0, 10**6), max_size=20),
    initial_size=st.sampled_from([24, 100, 4096]),
)
def test_valid_frames_round_trip_in_any_chunking(
    role: str, data: st.DataObject, cuts: list[int], initial_size: int
) -> None:
    cases = data.draw(
        st.lists(TO_SERVER if role == "server" else TO_CLIENT, min_size=1, max_size=6)
    )
    wire = b"".join(w for w, _ in cases)
    assert decode_chunks(role, split(wire, cuts), initial_size) == [e for _, e in cases]


@ROUND_TRIP
@given(case=TO_SERVER, cuts=st.lists(st.integers(0, 10**6), max_size=8))
def test_server_bound_frame_round_trips_through_get_buffer(case: Case, cuts: list[int]) -> None:
    # The server's path: write into get_buffer() and advance(), as asyncio's BufferedProtocol does.
    wire, expected = case
    dec = p.FrameDecoder("server", MAX, initial_size=24)
    out = []
    for chunk in split(wire, cuts):
        while chunk:
            view = dec.get_buffer()
            n = min(len(view), len(chunk))
            view[:n] = chunk[:n]
            dec.advance(n)
            chunk = chunk[n:]
            while (frame := dec.next_frame()) is not None:
                out.append(decoded(*frame))
    assert out == [expected]


# ------------------------------------------------------------------------------------- fuzzing


def drain(role: str, chunks: list[bytes], max_frame_bytes: int) -> None:
    """Feed arbitrary bytes and parse whatever frames come out; only ProtocolError (the
    connection's) or Refusal (one REQUEST's) may escape."""
    dec = p.FrameDecoder(role, max_frame_bytes, initial_size=24)
    try:
        for chunk in chunks:
            dec.feed(chunk)
            while (frame := dec.next_frame()) is not None:
                decoded(*frame)
    except ProtocolError as exc:
        assert isinstance(exc.code, ErrorCode)
    except Refusal as exc:
        assert exc.code == ErrorCode.INVALID_REQUEST


@FUZZ
@given(
    role=st.sampled_from(["server", "client"]),
    blob=st.binary(max_size=400),
    cuts=st.lists(st.integers(0, 400), max_size=10),
    max_frame_bytes=st.sampled_from([0, 16, 64, MAX]),
)
def test_random_bytes_into_decoder_raise_only_protocol_error(
    role: str, blob: bytes, cuts: list[int], max_frame_bytes: int
) -> None:
    drain(role, split(blob, cuts), max_frame_bytes)


@st.composite
def plausible_frames(draw: st.DrawFn) -> bytes:
    """A header of a real type (mostly valid bits, small length) over random payload bytes, so the
    payload parsers see more than what the header checks already reject."""
    payload = draw(st.binary(max_size=120))
    ftype = draw(st.sampled_from(list(FrameType)))
    flags = draw(st.sampled_from([0, 0, 0, 1, 2]))
    stream = draw(st.sampled_from([0, 1, 7, U32]))
    return struct.pack("<IBBHI", len(payload), ftype, flags, 0, stream) + payload


@FUZZ
@given(role=st.sampled_from(["server", "client"]), frames=st.lists(plausible_frames(), max_size=5))
def test_plausible_frames_raise_only_protocol_error(role: str, frames: list[bytes]) -> None:
    drain(role, [b"".join(frames)], MAX)


PARSERS = [
    p.parse_hello,
    p.parse_token,
    p.parse_done,
    p.parse_error,
    p.parse_welcome,
    p.parse_goaway,
]


@FUZZ
@given(payload=st.binary(max_size=200))
def test_payload_parsers_raise_only_protocol_error(payload: bytes) -> None:
    for parse in PARSERS:
        with contextlib.suppress(ProtocolError):
            parse(memoryview(payload))
    for flags in (0, p.FLAG_JSON):
        try:
            requests.parse_request(flags, memoryview(payload))
        except Refusal as exc:
            assert exc.code == ErrorCode.INVALID_REQUEST


@FUZZ
@given(
    fixed=st.tuples(
        st.integers(0, U32),
        st.floats(width=32),
        st.floats(width=32),
        st.integers(0, U32),
        st.integers(0, U64),
        st.integers(0, U32),
        st.integers(0, 40),
        st.integers(0, 0xFFFF) | st.integers(0, 7),
    ),
    tail=st.binary(max_size=200),
)
def test_binary_request_with_random_fields_raises_only_invalid_request(
    fixed: tuple, tail: bytes
) -> None:
    payload = memoryview(p.REQUEST_FIXED.pack(*fixed) + tail)
    try:
        req = requests.parse_request(0, payload)
    except Refusal as exc:
        assert exc.code == ErrorCode.INVALID_REQUEST
    else:
        assert req.max_tokens >= 1 and req.sampling.temperature >= 0 and 0 < req.sampling.top_p <= 1


json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.sampled_from([10**400, -(10**400), 2**64, 2**32])  # past every range, and past float
    | st.floats()
    | st.text(alphabet=st.characters(), max_size=8),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3)
    ),
    max_leaves=12,
)
# Values at or past the edges of what the keys accept, drawn often so each key meets each of them.
EDGE_VALUES = st.sampled_from(
    [10**400, -(10**400), 2**64, 2**64 - 1, 2**32, -1, 0, 1, 0.0, 1.5, float("nan"), float("inf")]
    + ["", "x", [], [""], {}, True, None, [{"role": "user", "content": 1}]]
)
# The protocol's JSON REQUEST keys (sorted: hypothesis needs a stable order), and a message's.
REQUEST_KEYS = [*sorted(requests.JSON_KEYS), "role", "content"]


def parse_json_fuzzed(body: bytes) -> None:
    try:
        requests.parse_request(p.FLAG_JSON, memoryview(body))
    except Refusal as exc:
        assert exc.code == ErrorCode.INVALID_REQUEST


@FUZZ
@given(
    obj=st.dictionaries(st.sampled_from(REQUEST_KEYS), json_values, max_size=6) | json_values,
    surrogate=st.booleans(),
)
def test_json_request_with_random_values_raises_only_invalid_request(
    obj: object, surrogate: bool
) -> None:
    body = json.dumps(obj, allow_nan=True)
    if surrogate:
        body = body.replace('"', '"\\ud800', 1)  # a lone surrogate escape somewhere
    parse_json_fuzzed(body.encode("ascii"))


@FUZZ
@given(case=json_requests(), key=st.sampled_from(REQUEST_KEYS), value=EDGE_VALUES | json_values)
def test_valid_json_request_with_one_random_value_raises_only_invalid_request(
    case: Case, key: str, value: object
) -> None:
    # Start from a valid request so the random value reaches the checks deep in the parser.
    obj = json.loads(case[0][p.HEADER_SIZE :])
    obj[key] = value
    parse_json_fuzzed(json.dumps(obj, allow_nan=True).encode("ascii"))


@ROUND_TRIP
@given(case=json_requests(), at=st.integers(0, 100))
def test_json_request_with_a_lone_surrogate_is_invalid(case: Case, at: int) -> None:
    # JSON can spell a lone surrogate (\ud800) that no UTF-8 text can carry; wherever it lands in
    # a string value of a valid request, the request becomes INVALID_REQUEST.
    wire, _ = case
    body = wire[p.HEADER_SIZE :].decode("ascii")
    starts = [
        i + len(k)
        for k in ('"prompt":"', '"system":"', '"content":"', '"stop_sequences":["')
        for i in _find_all(body, k)
    ]
    if not starts:
        return  # only messages with empty contents and no other strings: nothing to corrupt
    pos = starts[at % len(starts)]
    bad = (body[:pos] + "\\ud800" + body[pos:]).encode("ascii")
    try:
        requests.parse_request(p.FLAG_JSON, memoryview(bad))
    except Refusal as exc:
        assert exc.code == ErrorCode.INVALID_REQUEST
    else:
        raise AssertionError("a lone surrogate was accepted")


def _find_all(text: str, needle: str) -> list[int]:
    out, i = [], text.find(needle)
    while i >= 0:
        out.append(i)
        i = text.find(needle, i + 1)
    return out


# ------------------------------------------------- what the request path accepts, the engine holds

# The engine keeps each running request's sampling in fixed-width columns (float32 temperature
# and top_p, int32 top_k, uint64 seed). Whatever the parser and the input processor accept must
# fit them: a value that did not failed the engine step for every stream in flight and leaked a
# slot (found by benchmarks/fuzz.py: top_k >= 2**31; fixed in
# gateway/zerolayer/request_path/inputs.py).
INFO = ModelInfo("m", 259, 257, 4096)


def _engine_columns(sampling: SamplingParams) -> None:
    """Store a row the way the engine does (zerolayer.engine.rows); numpy raises on a value out
    of range."""
    with np.errstate(over="raise"):
        np.zeros(1, SAMPLING_ROW)[0] = sampling.row()


@FUZZ
@given(
    top_k=st.integers(0, U32),
    temperature=st.floats(min_value=0, allow_nan=False, allow_infinity=False),
    top_p=st.floats(min_value=0, max_value=1, exclude_min=True),
    seed=st.none() | st.integers(0, U64),
    json_door=st.booleans(),
)
def test_what_the_request_path_accepts_fits_the_engine_columns(
    top_k: int, temperature: float, top_p: float, seed: int | None, json_door: bool
) -> None:
    if json_door:
        obj = {"max_tokens": 1, "prompt": "x", "top_k": top_k, "temperature": temperature}
        obj["top_p"] = top_p
        if seed is not None:
            obj["seed"] = seed
        payload, flags = json.dumps(obj).encode(), p.FLAG_JSON
    else:
        t32, p32 = struct.unpack("<ff", struct.pack("<ff", min(temperature, 3e38), top_p))
        options = 4 if seed is not None else 0
        fixed = p.REQUEST_FIXED.pack(1, t32, p32, top_k, seed or 0, 0, 0, options)
        payload, flags = fixed + b"\x01\x00\x00\x00", 0
    try:
        req = requests.parse_request(flags, memoryview(payload))
        prepared = InputProcessor(ByteTokenizer(), INFO).prepare(req)
    except Refusal as exc:
        assert exc.code == ErrorCode.INVALID_REQUEST
    else:
        _engine_columns(prepared.sampling)


# ---------------------------------------------------------------- the fuzz corpus, frame by frame


@pytest.mark.parametrize("path", corpus_files(), ids=lambda path: path.stem)
def test_corpus_inputs_raise_only_protocol_error(path) -> None:
    """Every kept input (tests/fixtures/fuzz-corpus; replayed against a daemon in tests/e2e),
    fed to the server's decoder in one piece and byte by byte, raises only ProtocolError."""
    comment, data = read_corpus(path)
    assert "expect: " in comment, f"{path.name} does not say what the server must answer"
    drain("server", [data], MAX)
    drain("server", [data[i : i + 1] for i in range(min(len(data), 4096))], MAX)
