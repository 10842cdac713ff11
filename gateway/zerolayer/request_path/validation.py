"""Request validation, once for every door: the table of shared fields (``FIELDS``: each one's
JSON parser and range), ``read_common``, which reads them from a JSON request, and ``validate``,
the range check every door's parser ends with.

Each door decodes its own wire (the binary REQUEST's struct, a JSON REQUEST, an OpenAI or
Anthropic body) into a ``zerolayer.request_path.request.Request`` — a JSON door reads the shared
fields with ``read_common``, each by its one parser, in the table's order —, then calls
``validate(req)``, which reads each field's range from the same table: the same values are
accepted and refused, with the same message, whichever door they came through
(tests/unit/test_validation_properties.py feeds the same generated requests to the frame JSON
and the OpenAI parsers; tests/e2e/test_validation_doors.py sends each boundary through every
door). A refusal is a ``zerolayer.codes.Refusal`` naming the field; the doors map it to their
wire form. What depends on the model (token ids inside the vocabulary — logit_bias keys too —,
prompt + max_tokens inside the context, a registered prompt's id) is the input processor's
(zerolayer.request_path.inputs), which refuses the same way.

JSON conventions (both APIs and JSON frames): a field whose value is ``null`` counts as absent
(clients such as LangChain send explicit nulls; so does a logit_bias entry); numbers are
type-checked (a bool is not a number) when read, their range when validated; ``logit_bias`` keys
are token ids written as canonical decimal integers ("42", as OpenAI documents them: no sign
but a minus, no leading zero, no spaces or underscores).
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from zerolayer.codes import Refusal, invalid
from zerolayer.config.settings import MAX_N
from zerolayer.request_path.request import Request
from zerolayer.sampling_params import SamplingParams

#: A decoded JSON object: its values are whatever JSON holds, checked by the getters below.
JsonObject = dict[str, Any]

U32_MAX = 2**32 - 1
U64_MAX = 2**64 - 1
INT32_MAX = 2**31 - 1
INTEGER, NUMBER = "an integer", "a number"


@dataclass(frozen=True, slots=True)
class Range:
    """The values a numeric field accepts: [lo, hi], either end open when said. ``text`` is how
    a refusal says it, made from the bounds."""

    kind: str  # INTEGER or NUMBER
    lo: float
    hi: float
    lo_open: bool = False
    hi_open: bool = False
    note: str = ""  # after the interval: "(0 = none)"

    def holds(self, value: float) -> bool:
        """Whether ``value`` is in the range; NaN never is (every comparison with it is false)."""
        above = self.lo < value if self.lo_open else self.lo <= value
        below = value < self.hi if self.hi_open else value <= self.hi
        return above and below

    @property
    def text(self) -> str:
        left, right = "(" if self.lo_open else "[", ")" if self.hi_open else "]"
        interval = f"{self.kind} in {left}{_bound(self.lo)}, {_bound(self.hi)}{right}"
        return f"{interval} {self.note}" if self.note else interval


def _bound(value: float) -> str:
    """A bound as a refusal writes it: 2 (not 2.0), 2**64 (not 18446744073709551616)."""
    if isinstance(value, int) and abs(value) > U32_MAX and (abs(value) & (abs(value) - 1)) == 0:
        return f"{'-' if value < 0 else ''}2**{abs(value).bit_length() - 1}"
    return f"{value:g}" if isinstance(value, float) else str(value)


def refuse_range(name: str, value: object, rng: Range, field: str | None = None) -> Refusal:
    """The refusal of ``value`` outside ``rng``, naming ``field`` (default: ``name``, how the
    message calls the value: ``logit_bias[42]`` for one of logit_bias' values)."""
    return invalid(f"{name} must be {rng.text}, got {value!r}", field or name)


def range_of(name: str) -> Range:
    """Field ``name``'s range (``FIELDS``)."""
    rng = FIELDS[name].range
    if rng is None:
        raise KeyError(f"{name} has no range")
    return rng


# ------------------------------------------------------------------------ one parser per field


def as_int(value: object, name: str) -> int:
    """A JSON integer (a bool is not one; neither is 1.0)."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise invalid(f"{name} must be an integer, got {value!r}", name)
    return value


def as_number(value: object, name: str, field: str | None = None) -> float:
    """A JSON number as a float. Its range is ``validate``'s: NaN and the infinities (which
    Python's JSON reads) and an integer too large for a double (as an infinity) are refused
    there, as out of range."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise invalid(f"{name} must be a number, got {value!r}", field or name)
    try:
        return float(value)
    except OverflowError:
        return math.inf if value > 0 else -math.inf


def as_bool(value: object, name: str) -> bool:
    if not isinstance(value, bool):
        raise invalid(f"{name} must be true or false", name)
    return value


_TOKEN_ID = re.compile(r"0|-?[1-9][0-9]*")  # a canonical decimal integer, ASCII digits only


def as_logit_bias(value: object, name: str) -> dict[int, float] | None:
    """``{"token id": bias}``: each key a token id written as a canonical decimal integer (any
    other spelling is refused, so two keys never name one id), each bias a number (its range is
    ``validate``'s; the ids' vocabulary the input processor's). ``{}`` is None."""
    if not isinstance(value, dict):
        raise invalid(f"{name} must be an object of token id: bias", name)
    out: dict[int, float] = {}
    for key, bias in present(value).items():
        try:  # int() refuses more than 4300 digits
            token = int(key) if _TOKEN_ID.fullmatch(key) else None
        except ValueError:
            token = None
        if token is None:
            raise invalid(
                f'{name} keys must be token ids written as decimal integers ("42"), got {key!r}',
                name,
            )
        out[token] = as_number(bias, f"{name}[{key}]", name)
    return out or None


@dataclass(frozen=True, slots=True)
class Field:
    """A field every door shares: its one JSON parser and the range ``validate`` checks."""

    parse: Callable[[Any, str], Any]  # (the JSON value, the field's name) -> the field's value
    range: Range | None = None  # None: every value of its type
    each: bool = False  # the range is each value's of a mapping (logit_bias)


#: The fields every door shares, the one table: each one's JSON parser and its range, in the order
#: they are read and checked (so a request with several bad fields is refused for the same one on
#: every door). Ranges, the same for every door (docs/protocol.md and docs/http.md quote them):
#: temperature: OpenAI's [0, 2] (Anthropic documents [0, 1]; the wider range is served on
#: /v1/messages too). top_p: (0, 1]; top_k: 0 or -1 = off (vLLM); min_p: [0, 1] (0 = off). seed:
#: any int64 or uint64 (a negative seed is taken as its two's complement, as OpenAI's int64
#: seeds). presence/frequency penalties: OpenAI's [-2, 2]; repetition_penalty: Hugging Face's
#: multiplicative penalty, (0, 2] (1 = off); logit_bias values: OpenAI's [-100, 100];
#: top_logprobs: OpenAI's [0, 20]. n: OpenAI's [1, 128] here (a door makes a reply for each choice
#: as it parses), at most ``engine.max_n`` (the input processor's: it is configured, up to 128).
#: max_tokens is each door's to read (required on frames and /v1/messages, optional with an alias
#: on the OpenAI API); every other field is read by ``read_common``. ``REQUEST_FIELDS`` are the
#: Request's own, the others its ``SamplingParams``' (every one of which is here).
FIELDS: dict[str, Field] = {
    "max_tokens": Field(as_int, Range(INTEGER, 1, U32_MAX)),
    "prompt_id": Field(as_int, Range(INTEGER, 0, U32_MAX, note="(0 = none)")),
    "n": Field(as_int, Range(INTEGER, 1, MAX_N)),
    "temperature": Field(as_number, Range(NUMBER, 0.0, 2.0)),
    "top_p": Field(as_number, Range(NUMBER, 0.0, 1.0, lo_open=True)),
    "top_k": Field(as_int, Range(INTEGER, -1, INT32_MAX, note="(0 or -1 = off)")),
    "min_p": Field(as_number, Range(NUMBER, 0.0, 1.0)),
    "seed": Field(as_int, Range(INTEGER, -(2**63), 2**64, hi_open=True)),
    "presence_penalty": Field(as_number, Range(NUMBER, -2.0, 2.0)),
    "frequency_penalty": Field(as_number, Range(NUMBER, -2.0, 2.0)),
    "repetition_penalty": Field(as_number, Range(NUMBER, 0.0, 2.0, lo_open=True)),
    "logit_bias": Field(as_logit_bias, Range(NUMBER, -100.0, 100.0), each=True),
    "min_tokens": Field(as_int, Range(INTEGER, 0, U32_MAX)),
    "logprobs": Field(as_bool),
    "top_logprobs": Field(as_int, Range(INTEGER, 0, 20)),
}
REQUEST_FIELDS = frozenset({"max_tokens", "prompt_id", "n"})
MAX_STOP_SEQUENCES = 64  # stop strings a request may give (vLLM: unlimited; OpenAI: 4)
MAX_STOP_IDS = 0xFFFF  # stop token ids (the binary REQUEST's n_stop is a u16)


def read_common(obj: JsonObject, req: Request, temperature: float) -> None:
    """The shared fields of a JSON request but max_tokens (``FIELDS``, each by its parser, in
    the table's order) into ``req``: ``prompt_id``, ``n`` and ``sampling``. An absent field keeps
    its default; ``temperature`` is the door's (the frame protocol's greedy 0, the HTTP APIs' 1).
    A door's own list of accepted keys has refused the fields it does not take before this."""
    values: dict[str, Any] = {"temperature": temperature}
    for name, field in FIELDS.items():
        if name in obj and name != "max_tokens":
            values[name] = field.parse(obj[name], name)
    req.prompt_id = values.pop("prompt_id", 0)
    req.n = values.pop("n", 1)
    req.sampling = SamplingParams(**values)


def validate(req: Request) -> Request:
    """Refuse ``req`` (a Refusal naming the field) unless every field of ``FIELDS`` is in its
    range (in the table's order) and the rules between fields hold, and normalize what has two
    spellings (top_k -1 → 0, a negative seed → its uint64). Every door's parser ends with this;
    returns ``req``."""
    sampling = req.sampling
    for name, field in FIELDS.items():
        value = getattr(req if name in REQUEST_FIELDS else sampling, name)
        if field.range is None or value is None:
            continue
        if name == "max_tokens" and value == 0 and req.returns_prompt:
            continue  # the prompt's own outputs only (an embedding, echo): no completion
        if field.each:
            for key, one in value.items():
                if not field.range.holds(one):
                    raise refuse_range(f"{name}[{key}]", one, field.range, name)
        elif not field.range.holds(value):
            raise refuse_range(name, value, field.range)
    if sampling.top_logprobs and not sampling.logprobs:
        raise invalid("top_logprobs needs logprobs to be true", "top_logprobs")
    if len(req.stop_sequences) > MAX_STOP_SEQUENCES:
        raise invalid(f"at most {MAX_STOP_SEQUENCES} stop sequences", "stop_sequences")
    if len(req.stop_ids) > MAX_STOP_IDS:
        raise invalid(f"at most {MAX_STOP_IDS} stop token ids", "stop_ids")
    if sampling.top_k < 0 or (sampling.seed is not None and sampling.seed < 0):
        req.sampling = replace(
            sampling,
            top_k=max(sampling.top_k, 0),
            seed=None if sampling.seed is None else sampling.seed & U64_MAX,
        )
    return req


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
    return as_int(obj.get(key, default), key)


def get_bool(obj: JsonObject, key: str, default: bool = False) -> bool:
    return as_bool(obj.get(key, default), key)


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
