"""gateway.structured: constraints from request fields, compiled with llguidance on SmolLM2's
tokenizer, per-row matchers walking real token sequences, the cache and the refusals."""

from __future__ import annotations

import asyncio
import json

import jsonschema
import pytest
import torch

from gateway.structured import Constraint, GrammarError, Grammars, from_response_format
from kernels.sampling import unpack_bitmask

pytest.importorskip("llguidance")


@pytest.fixture(scope="module")
def model_dir():
    from gateway.models.bundled import smollm2_gguf
    from gateway.models.gguf_import import ensure_converted

    return ensure_converted(smollm2_gguf())


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    from gateway.models.hf_tokenizer import HFTokenizer

    return HFTokenizer(model_dir)


@pytest.fixture(scope="module")
def grammars(model_dir, tokenizer):
    # The model's own EOS is the end token the grammar allows (the engine's rows allow the other
    # end-of-generation ids, such as SmolLM2's <|endoftext|>, wherever it is).
    g = Grammars(model_dir / "tokenizer.json", tokenizer.eos_token_id, tokenizer.vocab_size)
    yield g
    g.close()


def _walk(grammars: Grammars, grammar, ids: list[int], eos: int) -> bool:
    """Every id allowed in turn by the mask, then EOS allowed at the end."""
    m = grammar.matcher()
    mask = grammars.bitmask(1)
    for t in ids:
        m.fill(mask, 0)
        if not unpack_bitmask(torch.from_numpy(mask), grammars.vocab_size)[0, t]:
            return False
        assert m.accept(t)
    m.fill(mask, 0)
    return bool((mask[0, eos // 32] >> (eos % 32)) & 1)


def test_response_format_kinds() -> None:
    assert from_response_format(None) is None
    assert from_response_format({"type": "text"}) is None
    assert from_response_format({"type": "json_object"}).kind == "json_object"
    spec = {"name": "x", "schema": {"type": "object", "properties": {"b": {}, "a": {}}}}
    a = from_response_format({"type": "json_schema", "json_schema": spec})
    b = Constraint.json_schema(json.loads(json.dumps(spec["schema"], indent=2)))
    assert a.text == b.text  # canonical: one cache entry, key order kept
    with pytest.raises(GrammarError) as err:
        from_response_format({"type": "yaml"})
    assert err.value.field == "response_format.type"
    with pytest.raises(GrammarError):
        Constraint.regex("a(")
    with pytest.raises(GrammarError):
        Constraint.choice([])


def test_schema_instances_are_allowed_and_outputs_validate(grammars, tokenizer) -> None:
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
    from json_schemas import CASES

    eos = tokenizer.eos_token_id
    for name, schema, instance in CASES[:12]:
        grammar = grammars.compile_sync(Constraint.json_schema(schema))
        ids = tokenizer.encode(json.dumps(instance, separators=(",", ":")))
        assert _walk(grammars, grammar, ids, eos), name
        jsonschema.validate(instance, schema)


def test_mask_refuses_what_the_schema_forbids(grammars, tokenizer) -> None:
    grammar = grammars.compile_sync(
        Constraint.json_schema(
            {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
        )
    )
    good = tokenizer.encode('{"n":5}')
    bad = tokenizer.encode('{"n":"five"}')
    assert _walk(grammars, grammar, good, tokenizer.eos_token_id)
    assert not _walk(grammars, grammar, bad, tokenizer.eos_token_id)


def test_choice_and_regex(grammars, tokenizer) -> None:
    eos = tokenizer.eos_token_id
    choice = grammars.compile_sync(Constraint.choice(["yes", "no"]))
    assert _walk(grammars, choice, tokenizer.encode("yes"), eos)
    assert not _walk(grammars, choice, tokenizer.encode("maybe"), eos)
    rx = grammars.compile_sync(Constraint.regex(r"[0-9]{3}-[a-z]+"))
    assert _walk(grammars, rx, tokenizer.encode("123-abc"), eos)
    assert not _walk(grammars, rx, tokenizer.encode("12-abc"), eos)


def test_cache_and_async_compile(grammars) -> None:
    c = Constraint.json_schema({"type": "object", "properties": {"z": {"type": "boolean"}}})
    first = asyncio.run(grammars.compile(c))
    assert grammars.cached(c) is first
    assert asyncio.run(grammars.compile(c)) is first


def test_uncompilable_schema_is_refused_naming_why(grammars) -> None:
    with pytest.raises(GrammarError) as err:
        grammars.compile_sync(Constraint.json_schema({"type": "objekt"}))
    assert err.value.field == "response_format.json_schema.schema"
    assert "objekt" in err.value.why


def test_matcher_finishes(grammars, tokenizer) -> None:
    grammar = grammars.compile_sync(Constraint.choice(["ok"]))
    m = grammar.matcher()
    for t in tokenizer.encode("ok"):
        assert m.accept(t)
    assert m.accepting
    assert m.accept(tokenizer.eos_token_id)
    assert m.finished
