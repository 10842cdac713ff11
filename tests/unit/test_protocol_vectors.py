"""The hex test vectors of docs/protocol.md, checked against our codec in both directions.

Each valid vector is encoded from its stated fields and compared byte for byte, then decoded with a
``FrameDecoder`` on the receiving side and the matching ``parse_*`` and compared field by field.
Each reject vector must make the decoder raise the stated connection error.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from zerolayer.frames import protocol as p
from zerolayer.frames import requests
from zerolayer.frames.protocol import ErrorCode, FrameType, ProtocolError

DOC = Path(__file__).resolve().parents[2] / "docs" / "protocol.md"

_BLOCK = re.compile(
    r"^(Vector|Reject vector): `([a-z0-9_]+)`\n.*?```json\n(.*?)\n```\s*```hex\n(.*?)\n```",
    re.MULTILINE | re.DOTALL,
)

# Every frame type must have a vector, and these by name (the brief of the doc).
REQUIRED = {
    "request_binary_ids",
    "request_binary_text",
    "request_json",
    "token_ids_text",
    "token_text_only",
    "done",
    "ping",
    "pong",
    "error_stream",
    "error_connection",
    "cancel",
    "hello_key",
    "hello_no_key",
    "welcome",
    "goaway",
    # version 2
    "request_binary_v2",
    "logprobs",
    "hello_v2",
    "welcome_v2",
}


def _hex_to_bytes(block: str) -> bytes:
    """The frame bytes of a ```hex block: its hex digits, with ``# comments`` and spaces dropped."""
    return bytes.fromhex("".join("".join(ln.split("#", 1)[0].split()) for ln in block.splitlines()))


def _load() -> tuple[dict[str, tuple[dict, bytes]], dict[str, tuple[dict, bytes]]]:
    valid: dict[str, tuple[dict, bytes]] = {}
    rejects: dict[str, tuple[dict, bytes]] = {}
    for kind, name, fields, hexblock in _BLOCK.findall(DOC.read_text(encoding="utf-8")):
        target = valid if kind == "Vector" else rejects
        assert name not in target, f"duplicate vector {name}"
        target[name] = (json.loads(fields), _hex_to_bytes(hexblock))
    return valid, rejects


VALID, REJECTS = _load()

RECEIVER = {
    "REQUEST": "server",
    "CANCEL": "server",
    "HELLO": "server",
    "TOKEN": "client",
    "DONE": "client",
    "ERROR": "client",
    "WELCOME": "client",
    "GOAWAY": "client",
    "LOGPROBS": "client",
}


def encode(f: dict[str, Any]) -> bytes:
    """Our encoder called with the vector's stated field values."""
    kind, stream = f["frame"], f["stream"]
    if kind == "REQUEST" and "json" in f:
        return p.encode_json_request(stream, f["json"])
    if kind == "REQUEST":
        return p.encode_request(
            stream,
            f["prompt_text"] if "prompt_text" in f else f["prompt_ids"],
            f["max_tokens"],
            temperature=f["temperature"],
            top_p=f["top_p"],
            top_k=f["top_k"],
            seed=f["seed"],
            prompt_id=f["prompt_id"],
            stop_ids=f["stop_ids"],
            text_deltas=f["text_deltas"],
            cache=f.get("cache", True),
            logprobs=f.get("logprobs", False),
            top_logprobs=f.get("top_logprobs", 0),
            presence_penalty=f.get("presence_penalty", 0.0),
            frequency_penalty=f.get("frequency_penalty", 0.0),
            repetition_penalty=f.get("repetition_penalty", 1.0),
            min_tokens=f.get("min_tokens", 0),
            logit_bias={int(k): v for k, v in f.get("logit_bias", {}).items()} or None,
        )
    if kind == "TOKEN":
        return p.encode_token(stream, f["ids"], f["text"].encode("utf-8"))
    if kind == "DONE":
        return p.encode_done(stream, _done(f))
    if kind == "PING":
        return p.encode_ping(bytes.fromhex(f["data_hex"]))
    if kind == "PONG":
        return p.encode_pong(bytes.fromhex(f["data_hex"]))
    if kind == "ERROR":
        return p.encode_error(stream, ErrorCode[f["code"]], f["message"], f["retry_after_ms"])
    if kind == "CANCEL":
        return p.encode_cancel(stream)
    if kind == "HELLO":
        return p.encode_hello(f["key"], f["version"])
    if kind == "WELCOME":
        assert f["version"] in p.SUPPORTED_VERSIONS
        return p.encode_welcome(
            f["max_frame_bytes"],
            f["max_streams"],
            f["vocab_size"],
            f["eos_token_id"],
            f["max_context"],
            f["model"],
            f["version"],
        )
    if kind == "LOGPROBS":
        return p.encode_logprobs(
            stream,
            np.array(f["token_logprobs"], np.float32),
            np.array(f["top_ids"], np.int32).reshape(len(f["token_logprobs"]), -1),
            np.array(f["top_logprobs"], np.float32).reshape(len(f["token_logprobs"]), -1),
        )
    if kind == "GOAWAY":
        return p.encode_goaway(f["in_flight"], f["reason"])
    raise AssertionError(f"no encoder for {kind}")


def _done(f: dict[str, Any]) -> p.Done:
    return p.Done(
        p.FinishReason[f["finish_reason"]],
        f["cache"],
        f["prompt_tokens"],
        f["completion_tokens"],
        f["queue_us"],
        f["ttft_us"],
        f["total_us"],
    )


def decode_one(role: str, data: bytes) -> tuple[int, int, int, memoryview]:
    dec = p.FrameDecoder(role, 1 << 20, initial_size=64)
    dec.feed(data)
    frame = dec.next_frame()
    assert frame is not None
    assert dec.next_frame() is None
    assert dec.buffered == 0
    return frame


def check_decoded(f: dict[str, Any], ftype: int, flags: int, stream: int, payload: memoryview):
    """The decoded frame carries exactly the vector's fields."""
    kind = f["frame"]
    assert FrameType(ftype).name == kind
    assert stream == f["stream"]
    if kind == "REQUEST":
        req = requests.parse_request(flags, payload)
        if "json" in f:
            obj = f["json"]
            assert flags == p.FLAG_JSON and req.want_text
            assert req.max_tokens == obj["max_tokens"]
            assert req.messages == obj.get("messages")
            assert req.prompt_text == obj.get("prompt")
            assert req.system == obj.get("system")
            assert req.sampling.temperature == obj.get("temperature", 0.0)
            assert req.sampling.top_p == obj.get("top_p", 1.0)
            assert req.sampling.top_k == obj.get("top_k", 0)
            assert req.sampling.seed == obj.get("seed")
            assert req.prompt_id == obj.get("prompt_id", 0)
            assert req.stop_sequences == tuple(obj.get("stop_sequences", ()))
            assert req.use_cache == obj.get("cache", True)
            return
        assert flags == 0
        assert req.max_tokens == f["max_tokens"]
        # The stated floats are exact in binary32, so equality is the right check.
        assert req.sampling.temperature == f["temperature"]
        assert req.sampling.top_p == f["top_p"]
        assert req.sampling.top_k == f["top_k"]
        assert req.sampling.seed == f["seed"]
        assert req.prompt_id == f["prompt_id"]
        assert req.stop_ids.tolist() == f["stop_ids"]
        assert req.want_text == f["text_deltas"]
        assert req.use_cache == f.get("cache", True)
        assert req.sampling.logprobs == f.get("logprobs", False)
        assert req.sampling.top_logprobs == f.get("top_logprobs", 0)
        assert req.sampling.presence_penalty == f.get("presence_penalty", 0.0)
        assert req.sampling.frequency_penalty == f.get("frequency_penalty", 0.0)
        assert req.sampling.repetition_penalty == f.get("repetition_penalty", 1.0)
        assert req.sampling.min_tokens == f.get("min_tokens", 0)
        bias = {int(k): v for k, v in f.get("logit_bias", {}).items()} or None
        assert req.sampling.logit_bias == bias
        if "prompt_text" in f:
            assert req.prompt_text == f["prompt_text"] and req.prompt_ids is None
        else:
            assert req.prompt_ids is not None and req.prompt_ids.dtype == np.int32
            assert req.prompt_ids.tolist() == f["prompt_ids"] and req.prompt_text is None
    elif kind == "TOKEN":
        ids, text = p.parse_token(payload)
        assert ids.tolist() == f["ids"]
        assert text == f["text"].encode("utf-8")
    elif kind == "DONE":
        assert p.parse_done(payload) == _done(f)
    elif kind in ("PING", "PONG"):
        if kind == "PING":
            p.check_ping(payload)
        assert bytes(payload) == bytes.fromhex(f["data_hex"])
    elif kind == "ERROR":
        assert p.parse_error(payload) == (ErrorCode[f["code"]], f["retry_after_ms"], f["message"])
    elif kind == "CANCEL":
        p.check_cancel(payload)
        assert len(payload) == 0
    elif kind == "HELLO":
        assert p.parse_hello(payload) == (f["version"], f["key"].encode("utf-8"))
    elif kind == "WELCOME":
        w = p.parse_welcome(payload)
        assert w == p.Welcome(
            f["version"],
            f["max_frame_bytes"],
            f["max_streams"],
            f["vocab_size"],
            f["eos_token_id"],
            f["max_context"],
            f["model"],
        )
    elif kind == "GOAWAY":
        assert p.parse_goaway(payload) == (f["in_flight"], f["reason"])
    elif kind == "LOGPROBS":
        token, ids, top = p.parse_logprobs(payload)
        assert token.tolist() == f["token_logprobs"]
        assert ids.reshape(-1).tolist() == f["top_ids"]
        assert top.reshape(-1).tolist() == f["top_logprobs"]
    else:
        raise AssertionError(f"no decoder check for {kind}")


def test_doc_has_every_required_vector_and_every_frame_type() -> None:
    assert VALID.keys() >= REQUIRED, f"missing vectors: {sorted(REQUIRED - VALID.keys())}"
    assert {f["frame"] for f, _ in VALID.values()} == {t.name for t in FrameType}
    assert REJECTS, "the doc should list frames a receiver must refuse"


def test_every_vector_block_parsed() -> None:
    # A vector heading whose blocks the regex missed would silently go untested.
    text = DOC.read_text(encoding="utf-8")
    headings = re.findall(r"^(?:Vector|Reject vector): `", text, re.MULTILINE)
    assert len(headings) == len(VALID) + len(REJECTS)


@pytest.mark.parametrize("name", sorted(VALID))
def test_encoder_produces_vector_bytes(name: str) -> None:
    fields, wire = VALID[name]
    assert encode(fields) == wire


@pytest.mark.parametrize("name", sorted(VALID))
def test_decoder_gives_back_vector_fields(name: str) -> None:
    fields, wire = VALID[name]
    roles = [RECEIVER[fields["frame"]]] if fields["frame"] in RECEIVER else ["server", "client"]
    for role in roles:
        check_decoded(fields, *decode_one(role, wire))


@pytest.mark.parametrize("name", sorted(VALID))
def test_vector_header_matches_layout(name: str) -> None:
    # Independent of the codec: the header's length field counts the payload only.
    fields, wire = VALID[name]
    length, ftype, flags, reserved, stream = p.HEADER.unpack_from(wire)
    assert length == len(wire) - 12
    assert reserved == 0
    assert stream == fields["stream"]
    assert FrameType(ftype).name == fields["frame"]


@pytest.mark.parametrize("name", sorted(n for n, (f, _) in VALID.items() if f["frame"] in RECEIVER))
def test_vector_refused_by_the_sender_side(name: str) -> None:
    # A one-directional frame arriving at its own sender's side is the wrong direction.
    fields, wire = VALID[name]
    receiver = RECEIVER[fields["frame"]]
    dec = p.FrameDecoder("client" if receiver == "server" else "server", 1 << 20)
    dec.feed(wire)
    with pytest.raises(ProtocolError) as exc:
        dec.next_frame()
    assert exc.value.code == ErrorCode.MALFORMED_FRAME


@pytest.mark.parametrize("name", sorted(REJECTS))
def test_reject_vector_raises_from_header(name: str) -> None:
    fields, wire = REJECTS[name]
    dec = p.FrameDecoder(fields["role"], fields["max_frame_bytes"], initial_size=64)
    dec.feed(wire[: p.HEADER_SIZE])  # the header alone is enough to refuse
    with pytest.raises(ProtocolError) as exc:
        dec.next_frame()
    assert exc.value.code == ErrorCode[fields["error"]]
