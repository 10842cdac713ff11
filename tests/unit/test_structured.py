"""zerolayer.structured: constraints from request fields, compiled with llguidance on SmolLM2's
tokenizer, per-row matchers walking real token sequences, the cache and the refusals."""

from __future__ import annotations

import asyncio
import json

import jsonschema
import pytest
import torch

from zerolayer.engine.backend import Backend
from zerolayer.engine.sampling import unpack_bitmask
from zerolayer.request_path.request import Request
from zerolayer.structured import Constraint, GrammarError, Grammars, closed, from_response_format

pytest.importorskip("llguidance")


@pytest.fixture(scope="module")
def model_dir():
    from zerolayer.models.bundled import smollm2_gguf
    from zerolayer.models.gguf_import import ensure_converted

    return ensure_converted(smollm2_gguf())


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    from zerolayer.models.hf_tokenizer import HFTokenizer

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
        ids = tokenizer.encode(json.dumps(instance))  # the separators the grammar writes
        assert _walk(grammars, grammar, ids, eos), name
        jsonschema.validate(instance, schema)


def test_mask_refuses_what_the_schema_forbids(grammars, tokenizer) -> None:
    grammar = grammars.compile_sync(
        Constraint.json_schema(
            {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
        )
    )
    eos = tokenizer.eos_token_id
    assert _walk(grammars, grammar, tokenizer.encode('{"n": 5}'), eos)
    assert not _walk(grammars, grammar, tokenizer.encode('{"n": "five"}'), eos)
    # Closed to other keys (nothing said of additionalProperties), and no free whitespace.
    assert not _walk(grammars, grammar, tokenizer.encode('{"n": 5, "m": 6}'), eos)
    assert not _walk(grammars, grammar, tokenizer.encode('{\n  "n": 5}'), eos)
    assert not _walk(grammars, grammar, tokenizer.encode('{"n":5}'), eos)


def test_a_schema_that_allows_other_keys_keeps_them(grammars, tokenizer) -> None:
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"],
              "additionalProperties": True}  # fmt: skip
    grammar = grammars.compile_sync(Constraint.json_schema(schema))
    assert _walk(grammars, grammar, tokenizer.encode('{"n": 5, "m": 6}'), tokenizer.eos_token_id)


def test_closed_reaches_every_subschema_and_copies() -> None:
    obj = {"type": "object", "properties": {"a": {"type": "integer"}}}
    schema = {
        "type": "object",
        "properties": {"properties": obj, "list": {"type": "array", "items": obj}},
        "$defs": {"d": obj},
        "anyOf": [obj, {"type": "object", "properties": {}, "patternProperties": {"^x": {}}}],
    }
    before = json.dumps(schema)
    out = closed(schema)
    assert json.dumps(schema) == before  # the request's schema is not changed
    assert out["additionalProperties"] is False
    assert set(out["properties"]) == {"properties", "list"}  # a property named "properties" kept
    assert out["properties"]["properties"]["additionalProperties"] is False
    assert out["properties"]["list"]["items"]["additionalProperties"] is False
    assert out["$defs"]["d"]["additionalProperties"] is False
    assert out["anyOf"][0]["additionalProperties"] is False
    assert "additionalProperties" not in out["anyOf"][1]  # patternProperties: left open
    both = closed({"allOf": [{"properties": {"a": obj}}, {"properties": {"b": {}}}]})
    assert [sorted(m) for m in both["allOf"]] == [["properties"], ["properties"]]
    assert both["allOf"][0]["properties"]["a"]["additionalProperties"] is False


def test_an_allof_of_objects_stays_satisfiable(grammars, tokenizer) -> None:
    a = {"type": "object", "properties": {"a": {"type": "string"}}, "required": ["a"]}
    b = {"type": "object", "properties": {"b": {"type": "integer"}}, "required": ["b"]}
    schema = {"allOf": [a, b]}
    grammar = grammars.compile_sync(Constraint.json_schema(schema))
    assert _walk(grammars, grammar, tokenizer.encode('{"a": "x", "b": 2}'), tokenizer.eos_token_id)


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


def _constrained_run(grammars, tokenizer, constraints: dict[str, object]) -> dict:  # noqa: ANN001
    """Rows with these constraints (None: free) in one engine batch on the synthetic backend
    over SmolLM2's vocabulary: each owner's text and finish."""
    import numpy as np

    from zerolayer.engine.backends.synthetic import SyntheticBackend
    from zerolayer.engine.engine import Engine, Sequence
    from zerolayer.sampling_params import SamplingParams
    from zerolayer.tokenizer import Detokenizer

    backend = SyntheticBackend(len(constraints), tokenizer.vocab_size, 256)
    engine = Engine(backend, tokenizer, lambda _: None, max_queue=8, max_step_tokens=256,
                    prefill_chunk=64)  # fmt: skip
    for name, constraint in constraints.items():
        grammar = grammars.compile_sync(constraint) if constraint is not None else None
        prompt = np.array(tokenizer.encode_prompt(f"Answer {name}:"), np.int32)
        engine.submit(
            Sequence(
                name,
                prompt,
                40,
                SamplingParams(),
                detokenizer=Detokenizer(tokenizer),
                grammar=grammar,
            )  # fmt: skip
        )
    out: dict = {name: {"text": "", "finish": None, "ids": []} for name in constraints}
    widest = 0
    for _ in range(200):
        step = engine.step()
        widest = max(widest, len(step.owners))
        for i, owner in enumerate(step.owners):
            out[owner]["text"] += step.text.get(i, "")
            if int(step.tokens[i]) >= 0:
                out[owner]["ids"].append(int(step.tokens[i]))
        for f in step.finished:
            out[f.owner]["finish"] = f.finish
        if engine.idle:
            break
    assert widest == len(constraints)  # one batch: constrained and free rows together
    return out


def test_constrained_rows_in_an_engine_batch_match_their_grammars(grammars, tokenizer) -> None:
    from zerolayer.codes import FinishReason

    schema = {
        "type": "object",
        "properties": {"ok": {"type": "boolean"}, "n": {"enum": [1, 2, 3]}},
        "required": ["ok", "n"],
        "additionalProperties": False,
    }
    out = _constrained_run(
        grammars,
        tokenizer,
        {
            "free": None,
            "digits": Constraint.regex("[0-9]{3}"),
            "pick": Constraint.choice(["alpha", "beta"]),
            "json": Constraint.json_schema(schema),
        },
    )
    assert len(out["digits"]["text"]) == 3 and out["digits"]["text"].isdigit()
    assert out["pick"]["text"] in ("alpha", "beta")
    jsonschema.validate(json.loads(out["json"]["text"]), schema)
    for name in ("digits", "pick", "json"):  # the grammar completing ended each row (STOP)
        assert out[name]["finish"] in (FinishReason.STOP, FinishReason.EOS), name
    assert out["free"]["finish"] == FinishReason.MAX_TOKENS and len(out["free"]["ids"]) == 40
    # The free row is the synthetic backend's own text: constraints elsewhere do not touch it.
    alone = _constrained_run(grammars, tokenizer, {"free": None})
    assert alone["free"]["ids"] == out["free"]["ids"]


def test_every_end_of_generation_id_is_allowed_where_the_grammar_allows_eos(
    grammars, tokenizer
) -> None:
    """SmolLM2 has two end-of-generation ids; the grammar knows one. The rows' mask allows both
    wherever the grammar allows its own (each ends the row)."""
    import numpy as np

    from zerolayer.engine.rows import Rows

    ends = sorted(tokenizer.eos_token_ids)
    assert len(ends) >= 2
    rows = Rows(1, 64, tokenizer.vocab_size, tokenizer.eos_token_ids)
    mask = np.zeros(grammars.words, np.int32)
    eos = tokenizer.eos_token_id
    mask.view(np.uint32)[eos // 32] |= np.uint32(1 << (eos % 32))
    rows._every_eos(mask)
    allowed = unpack_bitmask(torch.from_numpy(mask[None, :]), tokenizer.vocab_size)[0]
    assert all(bool(allowed[e]) for e in ends)
    assert int(allowed.sum()) == len(ends)
    empty = np.zeros(grammars.words, np.int32)
    rows._every_eos(empty)  # no EOS allowed: none added
    assert not empty.any()


def test_the_request_path_refuses_a_constraint_naming_the_field(grammars) -> None:
    """Compiled in phase PREPARING: an uncompilable schema, or a model without a tokenizer.json
    (no grammars), ends the stream with INVALID_REQUEST naming the constraint's field."""
    from tests.unit.test_lifecycle import make_path
    from tests.unit.test_lifecycle_choices import ChoiceDoor
    from zerolayer.codes import ErrorCode
    from zerolayer.hooks import Principal
    from zerolayer.request_path.stream import Phase, Stream

    async def main(with_grammars: bool, constraint: Constraint) -> tuple[list, list[str]]:
        path, door = make_path(async_gate=False), ChoiceDoor()
        path.grammars = grammars if with_grammars else None
        st = Stream(door, 1, "openai")
        req = Request(max_tokens=4, prompt_text="hi", constraint=constraint)
        path.open(st, Principal("anonymous"), req)
        assert st.phase is Phase.PREPARING
        for _ in range(200):
            if st.phase is Phase.ENDED:
                break
            await asyncio.sleep(0.01)
        return door.endings, door.messages

    bad = Constraint.json_schema({"type": "object", "properties": {"a": {"type": "nonsense"}}})
    endings, messages = asyncio.run(main(True, bad))
    assert endings == [(1, 0, "error", ErrorCode.INVALID_REQUEST)]
    assert messages[0].startswith("response_format.json_schema.schema: ")
    endings, messages = asyncio.run(main(False, Constraint.regex("[a-z]+")))
    assert endings == [(1, 0, "error", ErrorCode.INVALID_REQUEST)]
    assert messages[0].startswith("structured_outputs.regex: ") and "tokenizer.json" in messages[0]


def test_filling_a_mask_does_not_import_torch_dynamo(model_dir, tokenizer) -> None:
    """llguidance.torch imports torch._dynamo (seconds): were a row's mask filled through it, the
    first constrained step would stall every row of the engine for that long."""
    import subprocess
    import sys

    path = str(model_dir / "tokenizer.json")
    code = f"""
import sys, torch
from zerolayer.structured import Constraint, Grammars
g = Grammars({path!r}, {tokenizer.eos_token_id}, {tokenizer.vocab_size})
m = g.compile_now(Constraint.json_object()).matcher()
mask = g.bitmask(1)
m.fill(mask, 0)
assert mask.any(), "an empty mask"
print("torch._dynamo" in sys.modules)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"


# ---- issue #40: hostile grammars are refused on the worker, never on the step ----------------


def _hostile(kind: str, spec: object) -> Constraint:
    return Constraint.json_schema(spec) if kind == "json_schema" else Constraint.regex(spec)


def test_each_hostile_grammar_is_refused_naming_the_field_and_why(grammars) -> None:
    from benchmarks.hostile_grammars import REFUSED

    for name, (kind, spec, field) in REFUSED.items():
        with pytest.raises(GrammarError) as err:
            grammars.compile_sync(_hostile(kind, spec))
        assert err.value.field == field, name
        assert "bytes" in err.value.why or "too complex" in err.value.why, (name, err.value.why)


def test_the_size_cap_is_checked_before_parsing(model_dir, tokenizer) -> None:
    small = Grammars(model_dir / "tokenizer.json", tokenizer.eos_token_id, tokenizer.vocab_size,
                     max_bytes=20)  # fmt: skip
    try:
        with pytest.raises(GrammarError, match="at most 20 .engine.grammar_max_bytes."):
            small.compile_now(Constraint.regex("[a-z]{1,30}@[a-z]{1,30}"))
        assert small.compile_now(Constraint.regex("yes|no")) is not None
    finally:
        small.close()


def test_a_failed_compile_is_cached_and_not_built_again(model_dir, tokenizer, monkeypatch) -> None:
    from benchmarks.hostile_grammars import RECURSIVE_OBJECT

    g = Grammars(model_dir / "tokenizer.json", tokenizer.eos_token_id, tokenizer.vocab_size)
    builds: list[str] = []
    build = g._build
    monkeypatch.setattr(g, "_build", lambda c: (builds.append(c.text), build(c))[1])
    try:
        for _ in range(3):
            with pytest.raises(GrammarError):
                g.compile_sync(Constraint.json_schema(RECURSIVE_OBJECT))
        # the same text from another field is refused naming that field, from the cache
        with pytest.raises(GrammarError) as err:
            g.compile_sync(Constraint.json_schema(RECURSIVE_OBJECT, field="tools[0].parameters"))
        assert err.value.field == "tools[0].parameters"
        assert len(builds) == 1
    finally:
        g.close()


def test_the_cache_holds_at_most_its_size(model_dir, tokenizer) -> None:
    g = Grammars(model_dir / "tokenizer.json", tokenizer.eos_token_id, tokenizer.vocab_size,
                 cache_size=2)  # fmt: skip
    try:
        for word in ("a", "b", "c"):
            g.compile_now(Constraint.regex(word))
        assert g.cached(Constraint.regex("a")) is None
        assert g.cached(Constraint.regex("c")) is not None
    finally:
        g.close()


def test_a_full_compile_queue_refuses_busy(model_dir, tokenizer, monkeypatch) -> None:
    import threading

    from zerolayer.structured import MAX_WAITING, GrammarBusy

    g = Grammars(model_dir / "tokenizer.json", tokenizer.eos_token_id, tokenizer.vocab_size)
    release = threading.Event()
    build = g._build
    monkeypatch.setattr(g, "_build", lambda c: (release.wait(30), build(c))[1])
    try:
        futures = [g._submit(Constraint.regex(f"w{i}")) for i in range(MAX_WAITING)]
        with pytest.raises(GrammarBusy):
            g._submit(Constraint.regex("one too many"))
        release.set()
        assert all(f.result(30) is not None for f in futures)
        assert g.compile_sync(Constraint.regex("now there is room")) is not None
    finally:
        release.set()
        g.close()


def test_a_compile_past_its_timeout_is_refused_and_still_fills_the_cache(
    model_dir, tokenizer, monkeypatch
) -> None:
    import threading

    g = Grammars(model_dir / "tokenizer.json", tokenizer.eos_token_id, tokenizer.vocab_size,
                 timeout_s=0.01)  # fmt: skip
    release = threading.Event()
    build = g._build
    monkeypatch.setattr(g, "_build", lambda c: (release.wait(30), build(c))[1])
    try:
        c = Constraint.regex("late")
        with pytest.raises(GrammarError, match="engine.grammar_timeout_s") as err:
            asyncio.run(g.compile(c))
        assert err.value.field == "structured_outputs.regex"
        release.set()
        g._pool.submit(lambda: None).result(30)  # the worker is past the compile
        assert g.cached(c) is not None
    finally:
        release.set()
        g.close()


def test_a_late_compile_that_fails_leaves_no_unretrieved_exception(
    model_dir, tokenizer, monkeypatch
) -> None:
    """A compile that fails after its request timed out is read by the request path: asyncio
    does not report "Future exception was never retrieved" (hostile.py's daemon logged 7)."""
    import gc
    import threading

    g = Grammars(model_dir / "tokenizer.json", tokenizer.eos_token_id, tokenizer.vocab_size,
                 timeout_s=0.01)  # fmt: skip
    release = threading.Event()

    def late_failure(c: Constraint) -> None:
        release.wait(30)
        raise GrammarError(c.field, "late and wrong")

    monkeypatch.setattr(g, "_build", late_failure)
    reported: list[str] = []

    async def run() -> None:
        loop = asyncio.get_running_loop()
        loop.set_exception_handler(lambda _, context: reported.append(context["message"]))
        with pytest.raises(GrammarError, match="engine.grammar_timeout_s"):
            await g.compile(Constraint.regex("late"))
        release.set()
        await loop.run_in_executor(None, lambda: g._pool.submit(lambda: None).result(30))
        for _ in range(3):  # the worker's outcome reaches the loop's future by a callback
            await asyncio.sleep(0.01)
        gc.collect()

    try:
        asyncio.run(run())
        gc.collect()
        assert release.is_set() and reported == []
    finally:
        release.set()
        g.close()


def test_row_matchers_are_independent_copies(grammars, tokenizer) -> None:
    grammar = grammars.compile_sync(Constraint.choice(["yes", "no"]))
    a, b = grammar.matcher(), grammar.matcher()
    for t in tokenizer.encode("yes"):
        assert a.accept(t)
    assert a.accepting and not b.accepting
    for t in tokenizer.encode("no"):
        assert b.accept(t)
    assert b.accepting
    assert grammar.matcher().accepting is False


def test_every_benchmark_schema_compiles_under_the_limits(grammars) -> None:
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
    from json_schemas import CASES

    for name, schema, _ in CASES:
        assert grammars.compile_sync(Constraint.json_schema(schema)) is not None, name


def test_a_late_failing_grammar_fails_its_row_with_a_reason(grammars, tokenizer) -> None:
    from benchmarks.hostile_grammars import LATE

    kind, spec, _ = LATE["nested regex (issue)"]
    grammar = grammars.compile_sync(_hostile(kind, spec))  # passes the probe: fails later
    row = grammar.matcher()
    mask = grammars.bitmask(1)
    for _ in range(200):  # the lowest allowed token each time: a walk that exceeds the limits
        row.fill(mask, 0)
        allowed = unpack_bitmask(torch.from_numpy(mask), grammars.vocab_size)[0].nonzero()
        allowed = allowed[allowed != tokenizer.eos_token_id]
        if row.error or not len(allowed) or not row.accept(int(allowed[0])):
            break
    assert "too many expressions" in row.error
    assert "\n" not in row.error


def test_integers_and_numbers_without_bounds_stay_inside_int64(grammars, tokenizer) -> None:
    """Issue #39: a literal a client's parser cannot hold is not generated; a bound the schema
    gives is kept."""

    def accepts(schema: dict, literal: str) -> bool:
        wrapped = {"type": "object", "properties": {"n": schema}, "required": ["n"]}
        m = grammars.compile_sync(Constraint.json_schema(wrapped)).matcher()
        ids = [i for ch in '{"n": ' + literal + "}" for i in tokenizer.encode(ch)]
        return all(m.accept(i) for i in ids) and m.accepting

    for kind in ("integer", ["integer", "null"]):
        assert accepts({"type": kind}, str(-(2**62)))
        assert not accepts({"type": kind}, "9" * 19)  # above 2**63 - 1024
        assert not accepts({"type": kind}, "-" + "9" * 20)
    assert accepts({"type": "number"}, "-12.5")
    assert not accepts({"type": "number"}, "9" * 20)
    assert not accepts({"type": "number"}, "1e30")
    assert accepts({"type": "integer", "maximum": 10**15}, "9" * 15)  # the schema's own bound
    assert not accepts({"type": "integer", "maximum": 10**15}, "9" * 16)
    assert closed({"type": "integer", "minimum": 0}) == {
        "type": "integer", "minimum": 0, "maximum": 2**63 - 1024}  # fmt: skip


# ---- budget steering (issue #39) -----------------------------------------------------------

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "population": {"type": "integer"},
        "hobbies": {"type": "array", "items": {"type": "string"}},
        "address": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "minLength": 3},
                "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
            },
            "required": ["city", "zip"],
        },
        "ok": {"type": "boolean"},
        "size": {"enum": ["small", "large"]},
    },
    "required": ["name", "population", "hobbies", "address"],
}
CALLS = {  # the shape of zerolayer.http.tools.forced_schema's list
    "type": "array",
    "items": {
        "type": "object",
        "properties": {
            "name": {"const": "get_weather"},
            "arguments": {
                "type": "object",
                "properties": {"city": {"type": "string"}, "days": {"type": "integer"},
                               "tags": {"type": "array", "items": {"type": "string"}}},
                "required": ["city"],
            },
        },
        "required": ["name", "arguments"],
    },
    "minItems": 1,
    "maxItems": 16,
}  # fmt: skip
STEERED = {
    "person": Constraint.json_schema(PERSON),
    "calls": Constraint.json_schema(CALLS),
    "object": Constraint.json_object(),
}
SCHEMAS = {"person": PERSON, "calls": CALLS, "object": {"type": "object"}}


class Adversary(Backend):
    """A backend whose rows pick, within each row's mask, what runs away: structure openers,
    separators, digits (seeded), never an end token while anything else is allowed."""

    def __init__(self, tokenizer, seed: int, slots: int) -> None:  # noqa: ANN001
        import numpy as np

        from zerolayer.engine.backend import ModelInfo

        self.num_slots = slots
        self.info = ModelInfo("adversary", tokenizer.vocab_size, tokenizer.eos_token_id, 4096)
        self.rng = np.random.default_rng(seed)
        self.eos = sorted(tokenizer.eos_token_ids)
        texts = [tokenizer.decode([i]) for i in range(tokenizer.vocab_size)]
        self.runaway = np.array([any(c in t for c in '[{",1') for t in texts], np.bool_)

    def _pick(self, words) -> int:  # noqa: ANN001
        import numpy as np

        allowed = np.unpackbits(np.ascontiguousarray(words).view(np.uint8), bitorder="little")[
            : self.info.vocab_size
        ].astype(np.bool_)
        ends = allowed.copy()
        allowed[self.eos] = False
        if not allowed.any():
            return int(np.flatnonzero(ends)[0])
        pool = np.flatnonzero(allowed & self.runaway)
        if not len(pool) or self.rng.random() < 0.3:
            pool = np.flatnonzero(allowed)
        return int(self.rng.choice(pool))

    def _sample(self, proc, n: int):  # noqa: ANN001, ANN202
        import numpy as np

        assert proc is not None and proc.allowed is not None
        return np.array([self._pick(proc.allowed[r]) for r in range(n)], np.int32)

    def prefill(self, chunks):  # noqa: ANN001, ANN201
        import numpy as np

        return np.array(
            [self._sample(c.processing, 1)[0] if c.last else 0 for c in chunks], np.int32
        )

    def decode(self, batch):  # noqa: ANN001, ANN201
        return self._sample(batch.processing, batch.size)

    def free(self, slot: int) -> None:
        pass

    def close(self) -> None:
        pass


def _shortest(grammars, constraint) -> int:  # noqa: ANN001
    """The close path's length from the grammar's start: the least max_tokens steered."""
    m = grammars.compile_sync(constraint).matcher()
    plan = m._walk(4096)
    assert plan is not None
    return len(plan)


def _steered_run(grammars, tokenizer, budgets: dict[str, int], seed: int) -> dict:  # noqa: ANN001
    import numpy as np

    from zerolayer.engine.engine import Engine, Sequence
    from zerolayer.sampling_params import SamplingParams

    engine = Engine(Adversary(tokenizer, seed, len(budgets)), tokenizer, lambda _: None,
                    max_queue=8, max_step_tokens=512, prefill_chunk=64)  # fmt: skip
    for name, budget in budgets.items():
        grammar = grammars.compile_sync(STEERED[name])
        prompt = np.array(tokenizer.encode_prompt(f"Answer {name}:"), np.int32)
        engine.submit(Sequence(name, prompt, budget, SamplingParams(), grammar=grammar))
    out: dict = {name: {"ids": [], "finish": None} for name in budgets}
    for _ in range(2000):
        step = engine.step()
        for i, owner in enumerate(step.owners):
            if int(step.tokens[i]) >= 0:
                out[owner]["ids"].append(int(step.tokens[i]))
        for f in step.finished:
            out[f.owner]["finish"] = (f.finish, f.n_tokens)
        if engine.idle:
            break
    engine.stop()
    return out


def test_close_paths_keep_the_schema(grammars, tokenizer) -> None:
    """The close path from inside a runaway number: the rest of the required keys, each value
    its cheapest valid form (minLength, pattern)."""
    m = grammars.compile_sync(STEERED["person"]).matcher()
    mask = grammars.bitmask(1)
    for t in tokenizer.encode('{"name": "Jo", "population": 1111111'):
        m.fill(mask, 0)
        assert m.accept(t)
    m._scan.feed(m._steer.tokenizer.decode_bytes(m._unscanned))
    plan = m._walk(100)
    assert tokenizer.decode(plan) == ', "hobbies": [], "address": {"city": "000", "zip": "00000"}}'


def test_steered_rows_end_length_with_text_that_validates(grammars, tokenizer) -> None:
    """Issue #39: for every max_tokens from the shortest instance on, an adversarial sampler
    (structure openers, digits, never an end token) gets JSON that parses and validates; a row
    its budget closed ends MAX_TOKENS with at most its max_tokens."""
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    from zerolayer.codes import FinishReason

    least = {name: _shortest(grammars, c) for name, c in STEERED.items()}
    assert least["object"] == 1  # {}
    seen: dict = {"length": 0}

    @settings(max_examples=20, deadline=None, suppress_health_check=list(HealthCheck))
    @given(
        st.integers(0, 2**31),
        st.fixed_dictionaries({name: st.integers(0, 90) for name in STEERED}),
    )
    def run(seed: int, over: dict[str, int]) -> None:
        budgets = {name: least[name] + over[name] for name in STEERED}
        out = _steered_run(grammars, tokenizer, budgets, seed)
        for name, got in out.items():
            text = tokenizer.decode(got["ids"])
            jsonschema.validate(json.loads(text), SCHEMAS[name])
            finish, count = got["finish"]
            assert count == len(got["ids"]) <= budgets[name]
            assert finish in (FinishReason.MAX_TOKENS, FinishReason.STOP, FinishReason.EOS)
            seen["length"] += finish == FinishReason.MAX_TOKENS

    run()
    assert seen["length"] > 10  # the adversary runs away: most rows were steered


def test_budget_bounds_of_a_branching_recursive_schema_are_capped() -> None:
    """A recursive schema whose every level branches three ways: the jump bound stops at its
    cap after a bounded number of subschemas (no exponential walk on the compile worker)."""
    from zerolayer.structured import VISITS, WALK_MAX, budget_bounds

    calls = 0
    import zerolayer.structured as structured

    real = structured._instance_bound

    def counting(*args):  # noqa: ANN002, ANN202
        nonlocal calls
        calls += 1
        return real(*args)

    node = {"type": "object", "properties": {k: {"$ref": "#/$defs/n"} for k in "abc"}}
    schema = {"$defs": {"n": node}, "$ref": "#/$defs/n"}
    structured._instance_bound = counting  # type: ignore[assignment]
    try:
        jump, margin = budget_bounds(Constraint.json_schema(schema))
    finally:
        structured._instance_bound = real  # type: ignore[assignment]
    assert (jump, margin) == (WALK_MAX, 4)
    assert calls <= 3 * VISITS
