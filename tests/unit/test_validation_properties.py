"""Both doors accept and refuse exactly the same requests (zerolayer.request_path.validation).

Generated requests with the fields every door shares (every field of ``FIELDS``: valid values,
values at and just past each bound, NaN and the infinities, integers too large for a double,
null, the wrong types, logit_bias objects with odd keys and values) go to the frame door's JSON
parser and to the OpenAI chat parser, each in the same JSON object beside a valid conversation.
Either both accept, with the same value in every field, or both refuse, with the same error
code, field and message. The strategies are made from ``FIELDS`` itself, so a field added to
the table is generated here too (and must be accepted by both doors' key lists).
"""

from __future__ import annotations

import json
import math
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.strategies import SearchStrategy

from zerolayer.codes import Refusal
from zerolayer.frames import protocol as p
from zerolayer.frames import requests
from zerolayer.http import openai
from zerolayer.request_path.request import Request
from zerolayer.request_path.validation import (
    FIELDS,
    INTEGER,
    REQUEST_FIELDS,
    Range,
    as_bool,
    as_int,
    as_logit_bias,
    as_number,
)

CHECKED = settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
MESSAGES = [{"role": "user", "content": "hi"}]

# Values of no field's type, and null (which counts as absent).
WRONG = st.one_of(
    st.none(),
    st.booleans(),
    st.text(max_size=3),
    st.lists(st.integers(0, 9), max_size=2),
    st.just({}),
    st.just({"a": 1}),
)
HUGE = st.sampled_from([2**64, 10**30, -(10**30), 10**400, -(10**400)])  # 10**400: no double


def integers(rng: Range | None) -> SearchStrategy[Any]:
    """Integers around the range's bounds and anywhere, and numbers that are not integers."""
    edges: list[int] = []
    if rng is not None:
        lo, hi = int(rng.lo), int(rng.hi)
        edges = [lo - 1, lo, lo + 1, hi - 1, hi, hi + 1]
    return st.one_of(
        st.sampled_from(edges or [0]),
        st.integers(-5, 40),
        st.integers(),
        HUGE,
        st.sampled_from([1.0, 0.5, -1.0, math.nan, math.inf]),
        WRONG,
    )


def numbers(rng: Range | None) -> SearchStrategy[Any]:
    """Floats and integers around the range's bounds and anywhere, NaN, the infinities, integers
    too large for a double, and values that are not numbers."""
    edges: list[float] = [0.0]
    if rng is not None:
        edges = [
            rng.lo, rng.hi, math.nextafter(rng.lo, -math.inf), math.nextafter(rng.hi, math.inf),
            math.nextafter(rng.lo, math.inf), math.nextafter(rng.hi, -math.inf),
        ]  # fmt: skip
    return st.one_of(
        st.sampled_from(edges),
        st.sampled_from([int(e) for e in edges]),
        st.floats(-150, 150),
        st.floats(allow_nan=True, allow_infinity=True),
        st.integers(-150, 150),
        HUGE,
        WRONG,
    )


# JSON object keys for logit_bias: token ids as OpenAI writes them, and spellings of numbers
# that are not canonical decimal integers (a sign, spaces, underscores, leading zeros, other
# digits, exponents), and text.
ODD_KEYS = st.one_of(
    st.integers(-3, 300).map(str),
    st.sampled_from(
        [
            "0",
            "7",
            "-1",
            "-0",
            "+5",
            " 5",
            "5 ",
            "1_0",
            "05",
            "00",
            "\u0663",
            "\uff15",
            "1e3",
            "0x10",
            "5.0",
            "",
            "abc",
            "99999999999999999999",
            "1" * 5000,
        ]
    ),  # fmt: skip
    st.text(max_size=3),
)


def logit_biases(rng: Range | None) -> SearchStrategy[Any]:
    return st.one_of(
        st.dictionaries(ODD_KEYS, numbers(rng), min_size=1, max_size=3),
        st.dictionaries(ODD_KEYS, st.integers(-100, 100), min_size=1, max_size=3),
        st.dictionaries(st.integers(0, 300).map(str), numbers(rng), max_size=3),
        WRONG,
        st.integers(),
    )


def booleans(_: Range | None) -> SearchStrategy[Any]:
    return st.one_of(st.booleans(), st.sampled_from([0, 1, "true", 1.0]), WRONG)


# The strategy of each field, from its parser in the table.
BY_PARSER = {as_int: integers, as_number: numbers, as_bool: booleans, as_logit_bias: logit_biases}


def strategy(name: str) -> SearchStrategy[Any]:
    field = FIELDS[name]
    make = BY_PARSER[field.parse]
    if field.parse is as_int and field.range is not None and field.range.kind != INTEGER:
        raise AssertionError(name)  # the table's kind and parser agree
    values = make(field.range)
    if name == "max_tokens":  # each door requires it or not as its API does: always given here
        values = values.filter(lambda v: v is not None)
    return values


def valid(name: str) -> SearchStrategy[Any]:
    """Values field ``name`` accepts (by its parser's type, inside its range)."""
    field = FIELDS[name]
    rng = field.range
    if field.parse is as_bool:
        return st.booleans()
    if rng is None:
        raise AssertionError(name)
    if field.parse is as_int:
        lo, hi = int(rng.lo) + rng.lo_open, int(rng.hi) - rng.hi_open
        return st.one_of(st.sampled_from([lo, hi]), st.integers(lo, hi))
    inside = st.floats(rng.lo, rng.hi, exclude_min=rng.lo_open, exclude_max=rng.hi_open)
    if field.parse is as_logit_bias:
        return st.dictionaries(st.integers(-3, 300).map(str), inside, max_size=3)
    return inside


def mostly_valid(name: str, odds: int = 2) -> SearchStrategy[Any]:
    """Valid ``odds`` times in ``odds`` + 1, else anything ``strategy`` makes: requests with
    several fields then often have one bad field among good ones, or two whose order decides
    the refusal."""
    return st.sampled_from([True] * odds + [False]).flatmap(
        lambda ok: valid(name) if ok else strategy(name)
    )


def requests_with(names: list[str]) -> SearchStrategy[dict[str, Any]]:
    """JSON requests: max_tokens always, one to four of ``names`` beside it."""
    others = [name for name in names if name != "max_tokens"]
    chosen = st.lists(st.sampled_from(others), min_size=1, max_size=4, unique=True)
    return chosen.flatmap(
        lambda picked: st.fixed_dictionaries(
            {"max_tokens": mostly_valid("max_tokens", 5)} | {n: mostly_valid(n) for n in picked}
        )
    )


def outcome(parse: Any, obj: dict[str, Any]) -> tuple[Any, ...]:
    """("accepted", each shared field's value) or ("refused", code, field, message)."""
    try:
        req: Request = parse(obj)
    except Refusal as err:
        return ("refused", err.code, err.field, err.message)
    given = {k for k, v in obj.items() if v is not None}
    values = {
        name: getattr(req if name in REQUEST_FIELDS else req.sampling, name)
        for name in FIELDS
        if name != "temperature" or name in given  # absent, each door's default applies
    }
    return ("accepted", values)


def frame_json(obj: dict[str, Any]) -> Request:
    body = json.dumps({**obj, "messages": MESSAGES}).encode()
    return requests.parse_request(p.FLAG_JSON, memoryview(body))


def openai_chat(obj: dict[str, Any]) -> Request:
    body = json.dumps({**obj, "messages": MESSAGES}).encode()
    return openai.parse_chat(body, "served").req


def same_on_both_doors(obj: dict[str, Any]) -> tuple[Any, ...]:
    frames, http = outcome(frame_json, obj), outcome(openai_chat, obj)
    assert frames == http, obj
    return frames


@settings(CHECKED, max_examples=600)
@given(obj=requests_with(list(FIELDS)))
def test_both_doors_accept_or_refuse_the_same_requests(obj: dict[str, Any]) -> None:
    same_on_both_doors(obj)


@pytest.mark.parametrize("name", list(FIELDS))
@CHECKED
@given(data=st.data())
def test_both_doors_agree_field_by_field(name: str, data: st.DataObject) -> None:
    obj = {"max_tokens": 8, name: data.draw(strategy(name), label=name)}
    result = same_on_both_doors(obj)
    if result[0] == "refused":  # a refusal of a lone field names that field
        assert result[2] == name, result


def test_odd_logit_bias_keys_are_refused_by_both_doors_naming_logit_bias() -> None:
    # The frame door's JSON used to read "+5", " 5" and "1_0" (as 10) where HTTP refused them.
    for key in ("+5", " 5", "5 ", "1_0", "05", "-0", "\u0663", "1e3", "5.0", ""):
        result = same_on_both_doors({"max_tokens": 8, "logit_bias": {key: 1}})
        assert result[0] == "refused" and result[2] == "logit_bias", key
        assert repr(key) in result[3]
    ok = same_on_both_doors({"max_tokens": 8, "logit_bias": {"0": 1, "42": -2.5, "-1": 3}})
    assert ok == ("accepted", {**ok[1], "logit_bias": {0: 1.0, 42: -2.5, -1: 3.0}})
