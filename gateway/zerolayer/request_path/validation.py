"""Request validation, once for every door: the field table, the JSON field getters, and
``validate``, the range check every door's parser ends with.

Each door decodes its own wire (the binary REQUEST's struct, a JSON REQUEST, an OpenAI or
Anthropic body) into a ``zerolayer.request_path.request.Request`` with the getters here, then calls
``validate(req)``: the same values are accepted and refused whichever door they came through
(tests/e2e/test_validation_doors.py sends each boundary through both). A refusal is a
``zerolayer.codes.Refusal`` naming the field; the doors map it to their wire form. What depends on
the model (token ids inside the vocabulary, prompt + max_tokens inside the context, a
registered prompt's id) is the input processor's (zerolayer.request_path.inputs), which refuses the
same way.

JSON conventions (both APIs and JSON frames): a field whose value is ``null`` counts as absent
(clients such as LangChain send explicit nulls); numbers are type-checked (a bool is not a
number) before their range is.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from zerolayer.codes import Refusal, invalid
from zerolayer.request_path.request import Request

#: A decoded JSON object: its values are whatever JSON holds, checked by the getters below.
JsonObject = dict[str, Any]

U32_MAX = 2**32 - 1
U64_MAX = 2**64 - 1
INT32_MAX = 2**31 - 1
MAX_TOP_LOGPROBS = 20  # the most alternatives a row may ask for (OpenAI's limit)


@dataclass(frozen=True, slots=True)
class Range:
    """The values a numeric field accepts, and how a refusal says so."""

    lo: float
    hi: float
    text: str  # as the refusal message says it: "a number in [0, 2]"


#: The ranges of every numeric request field, the same for every door (docs/protocol.md and
#: docs/http.md quote them). temperature: OpenAI's [0, 2] (Anthropic documents [0, 1]; the
#: wider range is served on /v1/messages too). top_k: 0 or -1 = off (vLLM); top_p: (0, 1];
#: seed: any int64 or uint64 (a negative seed is taken as its two's complement, as OpenAI's
#: int64 seeds). presence/frequency penalties: OpenAI's [-2, 2]; repetition_penalty: Hugging
#: Face's multiplicative penalty, (0, 2] (1 = off); logit_bias values: OpenAI's [-100, 100]
#: (its keys' vocabulary check is the input processor's); top_logprobs: OpenAI's [0, 20]; n:
#: at least 1 here, at most ``engine.max_n`` (the input processor's: it is configured).
RANGES: dict[str, Range] = {
    "max_tokens": Range(1, U32_MAX, f"an integer in [1, {U32_MAX}]"),
    "temperature": Range(0.0, 2.0, "a number in [0, 2]"),
    "top_p": Range(0.0, 1.0, "a number in (0, 1]"),  # 0 itself is refused
    "top_k": Range(-1, INT32_MAX, f"an integer in [-1, {INT32_MAX}] (0 or -1 = off)"),
    "seed": Range(-(2**63), U64_MAX, "an integer in [-2**63, 2**64)"),
    "prompt_id": Range(0, U32_MAX, f"an integer in [0, {U32_MAX}] (0 = none)"),
    "presence_penalty": Range(-2.0, 2.0, "a number in [-2, 2]"),
    "frequency_penalty": Range(-2.0, 2.0, "a number in [-2, 2]"),
    "repetition_penalty": Range(0.0, 2.0, "a number in (0, 2]"),  # 0 itself is refused
    "logit_bias": Range(-100.0, 100.0, "a number in [-100, 100]"),  # each value
    "min_tokens": Range(0, U32_MAX, f"an integer in [0, {U32_MAX}]"),
    "top_logprobs": Range(0, MAX_TOP_LOGPROBS, f"an integer in [0, {MAX_TOP_LOGPROBS}]"),
    "n": Range(1, U32_MAX, "an integer of at least 1"),  # the top is engine.max_n (inputs)
}
MAX_STOP_SEQUENCES = 64  # stop strings a request may give (vLLM: unlimited; OpenAI: 4)
MAX_STOP_IDS = 0xFFFF  # stop token ids (the binary REQUEST's n_stop is a u16)


def _out_of_range(name: str, value: object) -> Refusal:
    return invalid(f"{name} must be {RANGES[name].text}, got {value!r}", name)


def validate(req: Request) -> Request:
    """Refuse ``req`` (a Refusal naming the field) unless every field is in its range, and
    normalize what has two spellings (top_k -1 → 0, a negative seed → its uint64). Every door's
    parser ends with this; returns ``req``."""
    if req.max_tokens is not None and not 1 <= req.max_tokens <= U32_MAX:
        raise _out_of_range("max_tokens", req.max_tokens)
    s = req.sampling
    # Written so that NaN fails: every comparison with NaN is false.
    if not 0.0 <= s.temperature <= 2.0:
        raise _out_of_range("temperature", s.temperature)
    if not 0.0 < s.top_p <= 1.0:
        raise _out_of_range("top_p", s.top_p)
    if not -1 <= s.top_k <= INT32_MAX:
        raise _out_of_range("top_k", s.top_k)
    if s.seed is not None and not -(2**63) <= s.seed <= U64_MAX:
        raise _out_of_range("seed", s.seed)
    if not 0 <= req.prompt_id <= U32_MAX:
        raise _out_of_range("prompt_id", req.prompt_id)
    if len(req.stop_sequences) > MAX_STOP_SEQUENCES:
        raise invalid(f"at most {MAX_STOP_SEQUENCES} stop sequences", "stop_sequences")
    if len(req.stop_ids) > MAX_STOP_IDS:
        raise invalid(f"at most {MAX_STOP_IDS} stop token ids", "stop_ids")
    _validate_processing(req)
    if s.top_k < 0 or (s.seed is not None and s.seed < 0):
        req.sampling = replace(
            s, top_k=max(s.top_k, 0), seed=None if s.seed is None else s.seed & U64_MAX
        )
    return req


def _validate_processing(req: Request) -> None:
    """The logits-processing fields of issue #27 (gateway/zerolayer/engine/sampling.py), same rules
    as above."""
    s = req.sampling
    for name in ("presence_penalty", "frequency_penalty"):
        if not -2.0 <= getattr(s, name) <= 2.0:
            raise _out_of_range(name, getattr(s, name))
    if not 0.0 < s.repetition_penalty <= 2.0:
        raise _out_of_range("repetition_penalty", s.repetition_penalty)
    if s.logit_bias:
        for token, value in s.logit_bias.items():
            if not -100.0 <= value <= 100.0:
                raise invalid(
                    f"logit_bias[{token}] must be {RANGES['logit_bias'].text}, got {value!r}",
                    "logit_bias",
                )
    if not 0 <= s.min_tokens <= U32_MAX:
        raise _out_of_range("min_tokens", s.min_tokens)
    if not 0 <= s.top_logprobs <= MAX_TOP_LOGPROBS:
        raise _out_of_range("top_logprobs", s.top_logprobs)
    if s.top_logprobs and not s.logprobs:
        raise invalid("top_logprobs needs logprobs to be true", "top_logprobs")
    if not 1 <= req.n <= U32_MAX:
        raise _out_of_range("n", req.n)


# ------------------------------------------------------------------------ JSON field getters


def load_object(data: bytes | memoryview, what: str = "request body") -> JsonObject:
    """``data`` as a JSON object with its null fields dropped."""
    try:
        obj = json.loads(str(data, "utf-8"))
    except UnicodeDecodeError as exc:
        raise invalid(f"{what} is not valid UTF-8: {exc.reason}") from None
    except ValueError as exc:
        raise invalid(f"{what} is not valid JSON: {exc}") from None
    except RecursionError:  # e.g. "[[[[..." nested deeper than the parser's stack
        raise invalid(f"{what} is not valid JSON: nested too deeply") from None
    if not isinstance(obj, dict):
        raise invalid(f"{what} must be a JSON object")
    return present(obj)


def present(obj: JsonObject) -> JsonObject:
    """``obj`` without its null fields."""
    return {k: v for k, v in obj.items() if v is not None}


def check_keys(obj: JsonObject, known: Iterable[str], where: str = "") -> None:
    """Refuse the fields of ``obj`` that are not in ``known``, by name (``field``: the first)."""
    known = frozenset(known)
    unknown = [f"{where}.{key}" if where else key for key in obj if key not in known]
    if unknown:
        plural = "s" if len(unknown) > 1 else ""
        message = f"unsupported field{plural}: {', '.join(unknown)}"
        raise invalid(message, unknown[0], "unsupported_parameter")


def get_int(obj: JsonObject, key: str, default: int) -> int:
    """An integer field (its range is ``validate``'s, or the caller's)."""
    value = obj.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int):
        raise invalid(f"{key} must be an integer, got {value!r}", key)
    return value


def get_float(obj: JsonObject, key: str, default: float) -> float:
    """A number field as a float (a JSON integer too large for a double is refused)."""
    value = obj.get(key, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise invalid(f"{key} must be a number, got {value!r}", key)
    try:
        value = float(value)
    except OverflowError:
        raise invalid(f"{key} is out of range", key) from None
    if not math.isfinite(value):
        raise _out_of_range(key, value) if key in RANGES else invalid(f"{key} must be finite", key)
    return value


def get_bool(obj: JsonObject, key: str, default: bool = False) -> bool:
    value = obj.get(key, default)
    if not isinstance(value, bool):
        raise invalid(f"{key} must be true or false", key)
    return value


def get_logit_bias(obj: JsonObject, key: str = "logit_bias") -> dict[int, float] | None:
    """``logit_bias``: an object mapping token ids (as JSON keys: decimal strings) to numbers
    (their range is ``validate``'s; the vocabulary the input processor's)."""
    value = obj.get(key)
    if value is None:
        return None
    if not isinstance(value, dict):
        raise invalid(f"{key} must be an object of token id: bias", key)
    out: dict[int, float] = {}
    for token, bias in value.items():
        try:
            token_id = int(token)
        except (TypeError, ValueError):
            raise invalid(f"{key} keys must be token ids, got {token!r}", key) from None
        if not 0 <= token_id <= INT32_MAX:
            raise invalid(f"{key} key {token_id} is outside the vocabulary", key)
        if (
            isinstance(bias, bool)
            or not isinstance(bias, (int, float))
            or not (-100.0 <= float(bias) <= 100.0)
        ):
            raise invalid(f"{key}[{token}] must be {RANGES['logit_bias'].text}, got {bias!r}", key)
        out[token_id] = float(bias)
    return out or None


def get_text(value: object, name: str, allow_empty: bool = True) -> str:
    """A JSON string that is also valid UTF-8 (JSON admits lone surrogates, UTF-8 does not)."""
    if not isinstance(value, str) or not (allow_empty or value):
        raise invalid(f"{name} must be a {'' if allow_empty else 'non-empty '}string", name)
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise invalid(f"{name} is not valid UTF-8 (lone surrogate)", name) from None
    return value


def get_object(value: object, name: str) -> JsonObject:
    """A JSON object (its null fields dropped)."""
    if not isinstance(value, dict):
        raise invalid(f"{name} must be an object", name)
    return present(value)


def get_text_parts(value: object, name: str, type_key: str = "type") -> str:
    """Content given as a string or as a list of text parts ``{"type": "text", "text": ...}``
    (both APIs' form); parts are joined with a newline. Any other part type is refused."""
    if isinstance(value, str):
        return get_text(value, name)
    if not isinstance(value, list):
        raise invalid(f"{name} must be a string or a list of text parts", name)
    texts = []
    for i, part in enumerate(value):
        where = f"{name}[{i}]"
        part = get_object(part, where)
        kind = part.get(type_key)
        if kind != "text":
            raise invalid(f"{where}: content of type {kind!r} is not supported (text only)", where)
        check_keys(part, (type_key, "text", "cache_control"), where)
        texts.append(get_text(part.get("text"), f"{where}.text"))
    return "\n".join(texts)


def get_messages(obj: JsonObject, roles: tuple[str, ...]) -> list[tuple[str, str, str]]:
    """``messages``: a non-empty list of ``{"role", "content"}`` with a role in ``roles`` and
    the content a string or text parts; (role, text, where) for each, ``where`` naming it."""
    messages = obj.get("messages")
    if not isinstance(messages, list) or not messages:
        raise invalid("messages must be a non-empty list", "messages")
    out = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        m = get_object(m, where)
        role = m.get("role")
        if role not in roles:
            raise invalid(f"{where}.role must be {', '.join(roles)}; got {role!r}", f"{where}.role")
        check_keys(m, ("role", "content"), where)
        if "content" not in m:
            raise invalid(f"{where}.content is required", f"{where}.content")
        out.append((role, get_text_parts(m["content"], f"{where}.content"), where))
    return out


def get_stops(obj: JsonObject, key: str, allow_string: bool) -> tuple[str, ...]:
    """Stop strings: a list of non-empty strings (or one string, where the API allows it)."""
    value = obj.get(key, ())
    if allow_string and isinstance(value, str):
        value = [value]
    if not isinstance(value, (list, tuple)) or len(value) > MAX_STOP_SEQUENCES:
        one = "a string or " if allow_string else ""
        raise invalid(f"{key} must be {one}a list of at most {MAX_STOP_SEQUENCES} strings", key)
    return tuple(get_text(s, key, allow_empty=False) for s in value)


def get_token_ids(value: object, name: str) -> np.ndarray:
    """A non-empty list of token ids as int32 (whether each is in the vocabulary is the input
    processor's check)."""
    if (
        not isinstance(value, list)
        or not value
        or not all(isinstance(t, int) and not isinstance(t, bool) for t in value)
    ):
        raise invalid(f"{name} must be a string or a list of token ids", name)
    if not all(0 <= t <= INT32_MAX for t in value):
        raise invalid(f"{name} token ids must be in [0, {INT32_MAX}]", name)
    return np.array(value, np.int32)
