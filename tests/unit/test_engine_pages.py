"""The engine on KV pages (zerolayer.engine.kv_pages) with the paged synthetic backend, whose
tokens depend on every digest read through the page tables: with a pool too small for the
demand, requests wait and are preempted, and every output still equals the same request run
alone on a pool that never runs out."""

from __future__ import annotations

import logging

import numpy as np
import pytest

from zerolayer.codes import ErrorCode, Refusal
from zerolayer.engine.backends.synthetic import SyntheticBackend
from zerolayer.engine.engine import NO_TOKEN, NOT_FINISHED, Engine, Sequence
from zerolayer.engine.prefix_store import PrefixStore
from zerolayer.frames.protocol import FinishReason
from zerolayer.sampling_params import SamplingParams
from zerolayer.tokenizer import ByteTokenizer, Detokenizer

TOK = ByteTokenizer()
CONTEXT = 256


def backend(pages: int = 0, slots: int = 4) -> SyntheticBackend:
    return SyntheticBackend(num_slots=slots, vocab_size=259, max_context=CONTEXT, num_pages=pages)


def engine_on(b: SyntheticBackend, store: bool = False, chunk: int = 32) -> Engine:
    return Engine(
        b, TOK, lambda _: None, max_queue=64, max_step_tokens=64, prefill_chunk=chunk,
        prefix_store=PrefixStore(b, 1 << 20) if store else None,
    )  # fmt: skip


def request(i: int, prompt_len: int = 20, max_tokens: int = 40, **sampling) -> Sequence:
    rng = np.random.default_rng(i)
    prompt = rng.integers(97, 123, prompt_len).astype(np.int32)
    return Sequence(
        f"r{i}", prompt, max_tokens, SamplingParams(**sampling),
        detokenizer=Detokenizer(TOK), fair_key=f"k{i}",
    )  # fmt: skip


def run(engine: Engine, seqs: list[Sequence], limit: int = 5000) -> dict[object, list[int]]:
    for s in seqs:
        engine.submit(s)
    out: dict[object, list[int]] = {}
    ends: dict[object, int] = {}
    for _ in range(limit):
        for owner, token, _text, finish in engine.step().outputs():
            if token != NO_TOKEN:
                out.setdefault(owner, []).append(token)
            if finish != NOT_FINISHED:
                ends[owner] = finish
        if engine.idle:
            break
    assert engine.idle, "the engine did not finish its work"
    assert all(f == FinishReason.MAX_TOKENS for f in ends.values()), ends
    assert set(ends) == {s.owner for s in seqs}
    return out


def alone(make: list[Sequence]) -> dict[object, list[int]]:
    """Each request run by itself on a pool that never runs out."""
    out: dict[object, list[int]] = {}
    for s in make:
        out.update(run(engine_on(backend()), [s]))
    return out


KINDS = [  # plain, seeded sampling, penalties (the rows' counts), greedy with a bias
    {},
    {"temperature": 1.0, "seed": 7},
    {"presence_penalty": 1.5, "frequency_penalty": 0.5},
    {"logit_bias": {97: 5.0}},
]


def requests(n: int, **kw) -> list[Sequence]:
    return [request(i, **KINDS[i % len(KINDS)], **kw) for i in range(n)]


def test_a_small_pool_makes_requests_wait_and_preempts_without_changing_outputs(caplog):
    want = alone(requests(8))
    b = backend(pages=9, slots=8)  # 144 positions; 8 requests of up to 60 positions each
    engine = engine_on(b)
    with caplog.at_level(logging.INFO, logger="zerolayer.engine"):
        got = run(engine, requests(8))
    assert got == want
    assert engine.kv_admission_waits > 0  # the pool, not the 8 rows, held them back
    assert engine.kv_preemptions > 0
    warned = [r for r in caplog.records if "preempted sequence" in r.getMessage()]
    assert len(warned) == engine.kv_preemptions and warned[0].levelno == logging.WARNING
    assert sum("KV pool full" in r.getMessage() for r in caplog.records) == 1  # rate-limited
    assert b.kv_pages.available == b.kv_pages.num_pages  # every page came back


def test_the_most_recently_admitted_is_preempted_and_rejoins_with_its_own_tokens():
    b = backend(pages=6, slots=2)  # 96 positions: two rows of 20 + 40 cannot both grow
    engine = engine_on(b)
    old, new = request(1), request(2)
    order: list[str] = []
    engine.submit(old)
    engine.submit(new)
    while not engine.idle:
        before = engine.kv_preemptions
        engine.step()
        if engine.kv_preemptions != before:
            order.append("new" if new.recompute is not None else "old")
    assert order and set(order) == {"new"}  # the older one always had its pages
    want = alone([request(1), request(2)])
    assert run(engine_on(backend(pages=6, slots=2)), [request(1), request(2)]) == want


def test_a_preempted_prompt_in_chunks_restarts_and_n_choices_share_pages():
    """Long prompts prefilled in chunks of 16 under a tight pool; choices of one request start
    from their prompt's pages (shared, copied on write) and still give their own tokens."""
    make = lambda: [request(i, prompt_len=70, max_tokens=30) for i in range(4)]  # noqa: E731
    want = alone(make())
    assert run(engine_on(backend(pages=12), chunk=16), make()) == want
    b = backend(pages=40)
    engine = engine_on(b)
    first = request(9, prompt_len=37, max_tokens=5, temperature=1.0, seed=3)
    first.choices = [request(9, prompt_len=37, max_tokens=5, temperature=1.0, seed=s)
                     for s in (4, 5)]  # fmt: skip
    for c in first.choices:
        c.parent = first
    engine.submit(first)
    engine.step()  # the prompt: 37 positions in 3 pages
    engine.step()  # the choices join from its pages
    pool = b.kv_pages
    shared = pool.pages_of(first.slot)[:2].tolist()
    assert all(pool.pages_of(c.slot)[:2].tolist() == shared for c in first.choices)
    assert all(pool.refs[p] == 3 for p in shared)


def test_the_prefix_store_shares_pages_and_gives_them_back_under_pressure():
    make = lambda: [request(i % 2, prompt_len=40, max_tokens=20) for i in range(6)]  # noqa: E731
    for s, owner in zip(make(), range(6), strict=True):
        s.owner = owner
    want = run(engine_on(backend(), store=True), _owned(make()))
    b = backend(pages=10)
    engine = engine_on(b, store=True)
    assert run(engine, _owned(make())) == want
    store = engine._store
    assert store is not None and store.hit_tokens > 0  # loaded by reference
    assert b.kv_pages.used == sum(len(e.handle) for e in store._blocks.values())


def _owned(seqs: list[Sequence]) -> list[Sequence]:
    for i, s in enumerate(seqs):
        s.owner = i
    return seqs


def test_a_request_beyond_the_whole_pool_is_refused_naming_the_setting():
    from zerolayer.request_path.inputs import InputProcessor
    from zerolayer.request_path.request import Request

    b = backend(pages=4)  # 64 positions
    inputs = InputProcessor(TOK, b.info, None, 4)
    ok = inputs.prepare(Request(prompt_ids=np.arange(97, 117, dtype=np.int32), max_tokens=44))
    assert ok.max_tokens == 44
    with pytest.raises(Refusal) as err:
        inputs.prepare(Request(prompt_ids=np.arange(97, 117, dtype=np.int32), max_tokens=45))
    assert err.value.code == ErrorCode.PROMPT_TOO_LONG and err.value.field == "max_tokens"
    assert "KV pool's 64 positions (engine.kv_cache_bytes)" in err.value.message
    default = inputs.prepare(Request(None, prompt_ids=np.arange(97, 117, dtype=np.int32)))
    assert default.max_tokens == 64 - 20


def test_the_budget_setting_sizes_the_synthetic_pool(caplog):
    from zerolayer.config.settings import EngineConfig, Settings
    from zerolayer.engine.backends.factory import build_backend

    def built(budget: int) -> SyntheticBackend:
        cfg = EngineConfig(backend="synthetic", kv_cache_bytes=budget, max_context=256)
        b, _ = build_backend(Settings(engine=cfg))
        assert isinstance(b, SyntheticBackend)
        return b

    with caplog.at_level(logging.INFO, logger="zerolayer.engine"):
        b = built(10 * 128 + 5)
    assert b.kv_pages.num_pages == 10 and b.info.kv_positions == 160
    assert "KV pool 1.2 KiB: 10 pages of 16 positions (160 positions, 8 bytes a position; " \
        "engine.kv_cache_bytes=1285)" in caplog.text  # fmt: skip
    auto = built(0)
    assert auto.kv_pages.num_pages == 32 * 16  # every slot's whole context
    with pytest.raises(ValueError, match="engine.kv_cache_bytes 100 holds no KV page"):
        built(100)


def test_a_second_key_is_admitted_before_the_first_keys_long_rows_end():
    """Key A holds every row with long requests; B's request is admitted in the next step, as
    A's youngest row is preempted (it waits, then recomputes): every output is the one each
    request gives alone, and the preemption is counted for A's class."""
    from zerolayer.ops.metrics import Metrics

    def make() -> list[Sequence]:
        # the youngest (preempted) row has penalties: their counts must survive its wait
        seqs = [request(i, max_tokens=120, **KINDS[(i + 3) % len(KINDS)]) for i in range(4)]
        for s in seqs:
            s.fair_key = "A"
        late = request(9, max_tokens=10)
        late.fair_key = "B"
        return [*seqs, late]

    want = alone(make())
    engine = engine_on(backend(slots=4))
    *a, b = make()
    out: dict[object, list[int]] = {}
    ended: dict[object, int] = {}

    def step() -> None:
        for owner, token, _text, finish in engine.step().outputs():
            if token != NO_TOKEN:
                out.setdefault(owner, []).append(token)
            if finish != NOT_FINISHED:
                ended[owner] = engine.steps

    for s in a:
        engine.submit(s)
    for _ in range(5):
        step()
    assert engine.running == 4 and all(s.slot >= 0 for s in a)
    engine.submit(b)
    step()
    assert b.slot >= 0  # admitted at once, not after A's 120-token rows
    assert engine.class_preempted == {"default": 1}
    assert a[3].slot < 0 and a[3] in engine._saved  # the youngest A row waits
    while not engine.idle:
        step()
    assert ended[b.owner] < min(ended[s.owner] for s in a)  # B ended before A's long rows
    assert out == want
    metrics = Metrics()
    metrics.set_classes(engine.class_rows, engine.class_preempted)
    text = metrics.render().decode()
    assert 'zerolayer_principal_rows_preempted_total{principal_class="default"} 1.0' in text
