"""zerolayer.request_path.validation: the ranges every door applies, and the refusal type they
raise."""

from __future__ import annotations

import pytest

from tests.support.sampling import SAMPLING_FIELDS, with_sampling
from zerolayer.codes import ErrorCode, Refusal
from zerolayer.hooks import HookError
from zerolayer.request_path.request import Request
from zerolayer.request_path.validation import FIELDS, check_keys, range_of, validate


def refused(**kw) -> Refusal:
    kw.setdefault("max_tokens", 4)
    with pytest.raises(Refusal) as err:
        validate(Request(**with_sampling(kw)))
    assert err.value.code == ErrorCode.INVALID_REQUEST
    return err.value


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("max_tokens", 0),
        ("max_tokens", 2**32),
        ("temperature", -0.0001),
        ("temperature", 2.0001),
        ("temperature", float("nan")),
        ("temperature", float("inf")),
        ("top_p", 0.0),
        ("top_p", 1.0001),
        ("top_p", float("nan")),
        ("top_k", -2),
        ("top_k", 2**31),
        ("seed", 2**64),
        ("seed", -(2**63) - 1),
        ("prompt_id", -1),
        ("prompt_id", 2**32),
        ("n", 0),
        ("n", 129),
        ("n", 2**32 - 1),
    ],
)
def test_out_of_range_is_refused_naming_the_field(field: str, value: object) -> None:
    err = refused(**{field: value})
    assert err.field == field and field in err.message and range_of(field).text in err.message


@pytest.mark.parametrize(
    ("field", "value", "stored"),
    [
        ("max_tokens", 1, 1),
        ("max_tokens", 2**32 - 1, 2**32 - 1),
        ("max_tokens", None, None),
        ("temperature", 0.0, 0.0),
        ("temperature", 2.0, 2.0),
        ("top_p", 1e-9, 1e-9),
        ("top_p", 1.0, 1.0),
        ("top_k", -1, 0),
        ("top_k", 0, 0),
        ("top_k", 2**31 - 1, 2**31 - 1),
        ("seed", -1, 2**64 - 1),
        ("seed", -(2**63), 2**63),
        ("seed", 2**64 - 1, 2**64 - 1),
        ("prompt_id", 2**32 - 1, 2**32 - 1),
    ],
)
def test_edges_are_accepted_and_normalized(field: str, value: object, stored: object) -> None:
    req = validate(Request(**with_sampling({"max_tokens": 4, field: value})))
    assert getattr(req.sampling if field in SAMPLING_FIELDS else req, field) == stored


def test_stop_sequence_count() -> None:
    validate(Request(max_tokens=1, stop_sequences=("x",) * 64))
    assert refused(stop_sequences=("x",) * 65).field == "stop_sequences"


def test_unknown_keys_are_all_named_and_the_first_is_the_field() -> None:
    with pytest.raises(Refusal) as err:
        check_keys({"a": 1, "stream": 1, "model": 2}, ("a",))
    assert err.value.field == "stream" and "stream, model" in err.value.message
    assert err.value.reason == "unsupported_parameter"


def test_refusal_fields_and_the_hook_name() -> None:
    # HookError (docs/hooks.md) is the one refusal type under the name hooks use.
    assert HookError is Refusal
    err = HookError(ErrorCode.RATE_LIMITED, "slow down", 2**40)
    assert (err.code, err.message, err.retry_after_ms, err.field) == (
        ErrorCode.RATE_LIMITED,
        "slow down",
        2**32 - 1,  # clamped to the wire's u32
        None,
    )
    assert err.reason == "rate_limited" and str(err) == "slow down"
    unknown = Refusal(99, "boom")
    assert unknown.code == ErrorCode.INTERNAL and "unknown error code 99" in unknown.message


def test_the_range_texts_are_made_from_the_bounds() -> None:
    texts = {name: range_of(name).text for name in ("max_tokens", "top_p", "seed", "top_k")}
    assert texts == {
        "max_tokens": "an integer in [1, 4294967295]",
        "top_p": "a number in (0, 1]",
        "seed": "an integer in [-2**63, 2**64)",
        "top_k": "an integer in [-1, 2147483647] (0 or -1 = off)",
    }


def test_every_sampling_parameter_has_its_parser_and_range_in_the_one_table() -> None:
    # A field added to SamplingParams without a FIELDS entry would be neither read from JSON nor
    # checked: the table is the whole list.
    assert FIELDS.keys() >= SAMPLING_FIELDS


@pytest.mark.parametrize(
    ("bias", "value"),
    [({7: 100.5}, 100.5), ({7: float("nan")}, float("nan")), ({1: 1.0, 2: -101.0}, -101.0)],
)
def test_a_logit_bias_value_out_of_range_is_named(bias: dict, value: float) -> None:
    err = refused(logit_bias=bias)
    assert err.field == "logit_bias"
    assert f"must be {range_of('logit_bias').text}, got {value!r}" in err.message
