"""Every door accepts and refuses exactly the same values (zerolayer.request_path.validation, one
table).

Each boundary value of each request field goes, against one real daemon (synthetic backend),
through the frame door (zerolayer.client.connection: a JSON REQUEST, and a binary REQUEST where the
binary layout can spell the value) and the HTTP door (the official openai and anthropic SDKs, which
send these values as given). Expected: served, or refused with the same ErrorCode: an ERROR
frame carrying it, an HTTP status from the one table with OpenAI's ``error.code`` naming it.
"""

from __future__ import annotations

import asyncio
import json
import struct
import urllib.error
import urllib.request

import anthropic
import openai
import pytest

from benchmarks._support.daemon import Daemon
from zerolayer.client import Client, ServerError
from zerolayer.codes import ErrorCode
from zerolayer.http.errors import STATUS

MODEL = "synthetic"
USER = [{"role": "user", "content": "hi"}]
OK = None
INVALID = ErrorCode.INVALID_REQUEST

# (field, value, expected): expected is OK (served) or the ErrorCode every door refuses with.
CASES = [
    ("temperature", -0.01, INVALID),
    ("temperature", 0, OK),
    ("temperature", 2, OK),
    ("temperature", 2.01, INVALID),
    ("temperature", 3, INVALID),  # `zerolayer generate --temperature 3`: refused on frames too
    ("top_p", 0, INVALID),
    ("top_p", 1e-6, OK),
    ("top_p", 1, OK),
    ("top_p", 1.01, INVALID),
    ("top_k", -2, INVALID),
    ("top_k", -1, OK),  # off, as in vLLM
    ("top_k", 0, OK),
    ("top_k", 2**31 - 1, OK),
    ("top_k", 2**31, INVALID),
    ("min_p", -0.01, INVALID),  # JSON and HTTP only: the binary REQUEST has no min_p
    ("min_p", 0, OK),
    ("min_p", 1, OK),
    ("min_p", 1.01, INVALID),
    ("max_tokens", 0, INVALID),
    ("max_tokens", 1, OK),
    ("max_tokens", 2**32 - 1, ErrorCode.PROMPT_TOO_LONG),  # in range, past the context
    ("max_tokens", 2**32, INVALID),
    ("seed", -(2**63) - 1, INVALID),
    ("seed", -1, OK),  # an int64 seed, as OpenAI's
    ("seed", 0, OK),
    ("seed", 2**64 - 1, OK),
    ("seed", 2**64, INVALID),
    ("prompt_id", -1, INVALID),
    ("prompt_id", 0, OK),
    ("prompt_id", 7, ErrorCode.UNKNOWN_PROMPT),  # in range, not registered
    ("prompt_id", 2**32, INVALID),
    ("stop", [], OK),
    ("stop", ["zz"] * 64, OK),
    ("stop", ["zz"] * 65, INVALID),
    ("stop", [""], INVALID),
    ("stop", [5], INVALID),
]
IDS = [f"{f}={v if not isinstance(v, list) else f'{len(v)}x{v[:1]}'}" for f, v, _ in CASES]


@pytest.fixture(scope="module")
def daemon():
    with Daemon({"ENGINE__MAX_CONTEXT": "512"}) as d:
        yield d


def frame_outcome(d: Daemon, send) -> ErrorCode | None:  # noqa: ANN001
    async def run() -> ErrorCode | None:
        # HELLO version 2 (auth is off: an empty key): min_p is a version 2 field.
        async with await Client.connect(d.endpoint, api_key=b"") as client:
            try:
                await (await send(client)).collect()
            except ServerError as err:
                assert err.stream != 0, err  # a refused request, never the connection
                return ErrorCode(err.code)
            return None

    return asyncio.run(run())


def json_frame(d: Daemon, field: str, value: object) -> ErrorCode | None:
    key = "stop_sequences" if field == "stop" else field
    body = {"max_tokens": 2, "prompt": "hi", key: value}
    return frame_outcome(d, lambda c: c.generate_json(body))


def f32(value: float) -> float:
    return struct.unpack("<f", struct.pack("<f", value))[0]


# What the binary REQUEST can spell: unsigned integers of its widths, float32 (stop strings and
# negative numbers have no binary form).
_BINARY_WIDTH = {"max_tokens": 32, "top_k": 32, "seed": 64, "prompt_id": 32}


def binary_spellable(field: str, value: object) -> bool:
    if field in ("temperature", "top_p"):
        return True
    bits = _BINARY_WIDTH.get(field)
    return bits is not None and isinstance(value, int) and 0 <= value < 2**bits


def binary_frame(d: Daemon, field: str, value: object) -> ErrorCode | None:
    kw: dict = {"max_tokens": 2, field: value}
    if field in ("temperature", "top_p"):
        kw[field] = f32(float(value))  # type: ignore[arg-type]  # the case table gives a number
    max_tokens = kw.pop("max_tokens")
    return frame_outcome(d, lambda c: c.generate("hi", max_tokens, **kw))


def http_outcome(call, api: str) -> ErrorCode | None:  # noqa: ANN001
    try:
        call()
    except (openai.APIStatusError, anthropic.APIStatusError) as err:
        body = err.body if isinstance(err.body, dict) else {}
        if api == "openai":
            code = ErrorCode[body["code"].upper()]
        else:  # Anthropic's body has a type only: the status must be the table's
            code = INVALID if err.status_code == 400 else ErrorCode.INTERNAL
        assert err.status_code == STATUS[code], (err.status_code, body)
        return code
    return None


def openai_chat(d: Daemon, field: str, value: object) -> ErrorCode | None:
    client = openai.OpenAI(base_url=d.http_url + "/v1", api_key="none", max_retries=0)
    kw: dict = {"model": MODEL, "messages": USER, "max_tokens": 2}
    if field in ("top_k", "prompt_id", "min_p"):  # vLLM's extensions: not SDK parameters
        kw["extra_body"] = {field: value}
    else:
        kw[field] = value
    return http_outcome(lambda: client.chat.completions.create(**kw), "openai")


def anthropic_messages(d: Daemon, field: str, value: object) -> ErrorCode | None:
    client = anthropic.Anthropic(base_url=d.http_url, api_key="none", max_retries=0)
    kw: dict = {"model": MODEL, "messages": USER, "max_tokens": 2}
    if field in ("max_tokens", "stop"):
        kw["stop_sequences" if field == "stop" else field] = value
    else:  # sampling fields the SDK no longer has parameters for; the Messages API takes them
        kw["extra_body"] = {field: value}
    if field == "max_tokens" and value > 2**20:
        return anthropic_raw(d, kw)  # the SDK refuses these client-side (asks for streaming)
    return http_outcome(lambda: client.messages.create(**kw), "anthropic")


def anthropic_raw(d: Daemon, kw: dict) -> ErrorCode | None:
    body = json.dumps(kw).encode()
    req = urllib.request.Request(
        d.http_url + "/v1/messages", body, {"content-type": "application/json"}
    )
    try:
        with urllib.request.urlopen(req, timeout=30) as reply:
            assert json.loads(reply.read())["type"] == "message"
    except urllib.error.HTTPError as err:
        assert json.loads(err.read())["type"] == "error"
        assert err.code == 400
        return INVALID
    return None


@pytest.mark.parametrize(("field", "value", "expected"), CASES, ids=IDS)
def test_every_door_accepts_and_refuses_the_same_values(daemon, field, value, expected):
    outcomes = {
        "frames-json": json_frame(daemon, field, value),
        "openai-chat": openai_chat(daemon, field, value),
    }
    if binary_spellable(field, value):
        outcomes["frames-binary"] = binary_frame(daemon, field, value)
    if field not in ("seed", "prompt_id"):  # not fields of the Messages API
        got = anthropic_messages(daemon, field, value)
        # Anthropic's error body names no code: PROMPT_TOO_LONG and UNKNOWN_PROMPT are its 400s.
        outcomes["anthropic-messages"] = INVALID if got is not None else None
        if expected is not None:
            assert STATUS[expected] == 400
            expected_anthropic = INVALID
        else:
            expected_anthropic = None
        assert outcomes.pop("anthropic-messages") == expected_anthropic, (field, value)
    assert outcomes == dict.fromkeys(outcomes, expected), (field, value)
