"""The prefix store: chained block keys, the one-token rule, LRU eviction under the byte budget,
pinned prompts with a partial tail; and identical outputs with and without reuse through the
real Engine on the synthetic backend, the built-in model (CPU, float32) and a checkpoint made
with transformers: a shared prefix that ends mid-block, and conversations that resend their
history and diverge after a shared start."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from tests.support.checkpoint import checkpoint_backend
from tests.support.engine_run import run_engine
from tests.support.kv import slot_kv
from tests.support.smollm2 import data_dir_of
from zerolayer.config.settings import EngineConfig, ModelConfig
from zerolayer.engine.backend import Backend, ModelInfo
from zerolayer.engine.backends.synthetic import SyntheticBackend
from zerolayer.engine.engine import Sequence
from zerolayer.engine.prefix_store import BLOCK_TOKENS, PrefixStore
from zerolayer.engine.types import PrefillChunk
from zerolayer.sampling_params import SamplingParams
from zerolayer.tokenizer import ByteTokenizer, Tokenizer

B = BLOCK_TOKENS
TOK = ByteTokenizer()
SAMPLED = SamplingParams(temperature=1.0, seed=1234)


def ids(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(3, 250, n).astype(np.int32)


def synthetic(slots: int = 4) -> SyntheticBackend:
    return SyntheticBackend(num_slots=slots, vocab_size=259, max_context=512)


def prefilled(backend: Backend, prompt: np.ndarray, slot: int = 0) -> None:
    pages = backend.kv_pages  # a paged backend: the slot's pages, as the engine reserves them
    if pages is not None:
        pages.release(slot)
        assert pages.prepare_write(slot, 0, len(prompt)) == []
    backend.prefill([PrefillChunk(slot, prompt, 0, True, SamplingParams())])


def load(store: PrefixStore, prompt: np.ndarray, slot: int) -> int:
    """``store.load`` into a slot that holds nothing (as at admission)."""
    pages = store.backend.kv_pages
    if pages is not None:
        pages.release(slot)
    return store.load(prompt, slot)


def offered(store: PrefixStore, prompt: np.ndarray, slot: int = 0) -> int:
    prefilled(store.backend, prompt, slot)
    return store.offer(prompt, slot)


class Recorder:
    def __init__(self) -> None:
        self.lookups: list[tuple[int, int]] = []
        self.bytes: tuple[int, int] = (0, 0)

    def prefix_lookup(self, queried: int, hit: int) -> None:
        self.lookups.append((queried, hit))

    def prefix_bytes(self, pinned: int, cached: int) -> None:
        self.bytes = (pinned, cached)


# --------------------------------------------------------------------------- the store itself


def test_a_block_is_reused_only_after_the_same_history() -> None:
    rec = Recorder()
    store = PrefixStore(synthetic(), 1 << 20, rec)
    a = ids(2 * B + 5, 1)
    assert offered(store, a) == 2  # two full blocks; the 5 ids after them are not kept
    assert store.blocks == 2 and store.cached_bytes == 2 * B * 8
    assert load(store, np.concatenate([a, ids(9, 2)]), 1) == 2 * B
    # The same second block after a different first one: nothing.
    other = np.concatenate([ids(B, 3), a[B:]])
    assert load(store, other, 1) == 0
    # Diverging inside the second block: the first block only.
    assert store.load(np.concatenate([a[: B + 3], ids(20, 4)]), 1) == B
    assert rec.lookups == [(2 * B + 14, 2 * B), (len(other), 0), (B + 23, B)]
    assert (store.queried_tokens, store.hit_tokens) == (5 * B + 42, 3 * B)
    assert rec.bytes == (0, 2 * B * 8)
    # Offering again adds nothing.
    assert offered(store, a, slot=2) == 0 and store.blocks == 2


def test_at_least_one_prompt_token_is_left_to_prefill() -> None:
    store = PrefixStore(synthetic(), 1 << 20)
    a = ids(2 * B, 5)
    assert offered(store, a) == 2
    assert load(store, a, 1) == B  # the whole prompt is known: its last block is prefilled
    assert load(store, a[:1], 1) == 0


def test_loaded_blocks_give_the_tokens_prefilling_them_gives() -> None:
    backend = synthetic()
    store = PrefixStore(backend, 1 << 20)
    shared, user = ids(3 * B, 6), ids(7, 7)
    offered(store, shared)
    full = np.concatenate([shared, user])
    prefilled(backend, full, 1)
    expected = backend.prefill([PrefillChunk(1, full[-1:], len(full) - 1, True, SamplingParams())])
    assert load(store, full, 2) == 3 * B
    pool = backend.kv_pages
    assert pool.pages_of(2).tolist() == pool.pages_of(0)[:3].tolist()  # shared, not copied
    assert pool.prepare_write(2, 3 * B, len(full)) == []
    got = backend.prefill([PrefillChunk(2, user, 3 * B, True, SamplingParams())])
    assert got.tolist() == expected.tolist()
    positions = np.arange(len(full))
    assert (
        backend._kv[backend._where(np.full(len(full), 2), positions)].tolist()
        == backend._kv[backend._where(np.full(len(full), 1), positions)].tolist()
    )


def chain_is_whole(store: PrefixStore) -> bool:
    """Every block's parent is held too (nothing unreachable is kept)."""
    return all(not e.parent or e.parent in store._blocks for e in store._blocks.values())


def test_lru_eviction_keeps_the_budget_and_takes_the_deepest_blocks_first() -> None:
    block_bytes = B * 8  # the synthetic backend: one uint64 per position
    store = PrefixStore(synthetic(), 3 * block_bytes)
    a, b = ids(2 * B + 1, 8), ids(2 * B + 1, 9)
    assert offered(store, a) == 2
    assert offered(store, b) == 2  # a's second block made room
    assert store.cached_bytes == 3 * block_bytes and store.evicted_blocks == 1
    assert chain_is_whole(store)
    assert load(store, a, 1) == B and load(store, b, 1) == 2 * B
    # b was used after a: a's block goes first.
    c = ids(B + 1, 10)
    assert offered(store, c) == 1
    assert load(store, a, 1) == 0 and load(store, b, 1) == 2 * B and load(store, c, 1) == B
    # Now c was used last, b before it: b goes, its deepest block first, c stays.
    assert offered(store, a) == 2
    assert load(store, b, 1) == 0 and load(store, c, 1) == B and load(store, a, 1) == 2 * B
    assert store.evicted_blocks == 4
    assert chain_is_whole(store) and store.cached_bytes <= store.capacity_bytes
    # A chain longer than the whole budget keeps its leading blocks only.
    long = ids(5 * B + 1, 11)
    assert offered(store, long) == 3
    assert load(store, long, 1) == 3 * B and chain_is_whole(store)


def test_zero_capacity_keeps_pinned_prompts_only() -> None:
    store = PrefixStore(synthetic(), 0)
    assert offered(store, ids(3 * B, 12)) == 0 and store.blocks == 0
    pinned = ids(B + 4, 13)
    prefilled(store.backend, pinned)
    assert store.pin(pinned, 0) == (2 * B * 8, 2 * B * 8)  # the tail holds a whole page
    assert load(store, np.concatenate([pinned, ids(3, 14)]), 1) == B + 4


def test_a_pinned_prompt_is_reused_to_its_last_token_and_never_evicted() -> None:
    rec = Recorder()
    store = PrefixStore(synthetic(), 2 * B * 8, rec)
    system = ids(2 * B + 7, 15)  # two full blocks and a 7-token tail
    prefilled(store.backend, system)
    total, new = store.pin(system, 0)
    assert total == new == 3 * B * 8 and store.pinned_bytes == new  # pages: 2 and the tail's
    assert rec.bytes == (new, 0)
    # Pinning the same prompt again shares every entry.
    assert store.pin(system, 0) == (total, 0)
    for seed in range(16, 24):  # pressure on the LRU
        offered(store, ids(3 * B, seed))
    user = ids(5, 30)
    assert load(store, np.concatenate([system, user]), 1) == len(system)
    # Diverging inside the tail: the full blocks only.
    assert load(store, np.concatenate([system[:-2], user]), 1) == 2 * B
    # The prompt alone: everything but its last token comes from a full block or the tail...
    assert load(store, system, 1) == 2 * B
    # ... and a prompt that is exactly the pinned ids plus one token reuses them all.
    assert load(store, np.concatenate([system, user[:1]]), 1) == len(system)
    assert store.pinned_bytes == total and store.cached_bytes <= store.capacity_bytes


class NoKV(Backend):
    """A backend like neuron's: slots and steps, no KV ranges (it is not a PrefixKV)."""

    def __init__(self, num_slots: int, vocab_size: int, max_context: int) -> None:
        self.num_slots = num_slots
        self.info = ModelInfo("nokv", vocab_size, -1, max_context)

    def prefill(self, chunks: list) -> np.ndarray:
        return np.full(len(chunks), -1, np.int32)

    def decode(self, batch) -> np.ndarray:  # noqa: ANN001
        return np.zeros(batch.size, np.int32)


def test_backend_without_kv_ranges_is_refused() -> None:
    with pytest.raises(ValueError, match="cannot save and load KV"):
        PrefixStore(NoKV(num_slots=1, vocab_size=259, max_context=64), 1024)


def test_cpu_kv_ranges_round_trip(builtin) -> None:
    backend, _ = builtin
    prompt = ids(3 * B + 2, 31)
    prefilled(backend, prompt, slot=0)
    assert not backend.cache.native  # the parity mode: decode gathers the pages for SDPA
    head, handle = backend.save_kv(0, 0, B), backend.save_kv(0, B, 2 * B)  # by reference
    layers, _, kv_heads, head_dim = backend.cache.k.shape
    assert len(handle) == B // 16  # pages of 16 positions
    assert backend.kv_nbytes(handle) == 2 * layers * kv_heads * B * head_dim * 4
    backend.kv_pages.release(1)
    with pytest.raises(ValueError, match="holds 0 pages"):  # a range goes where the row ends
        backend.load_kv(handle, 1, B)
    backend.load_kv(head, 1, 0)
    backend.load_kv(handle, 1, B)
    assert (slot_kv(backend, 1, 0, 2 * B)[0] == slot_kv(backend, 0, 0, 2 * B)[0]).all()
    assert list(backend.kv_pages.pages_of(1)) == list(backend.kv_pages.pages_of(0)[:2])
    backend.kv_pages.release(1)
    backend.drop_kv(head)
    backend.drop_kv(handle)


# --------------------------------------------------------------------------- identical outputs


def expected_reuse(prompt: np.ndarray, earlier: list[np.ndarray]) -> int:
    """What the store should load for ``prompt`` after ``earlier`` prompts were prefilled: their
    full blocks that ``prompt`` starts with, leaving ``prompt`` one token."""
    best = 0
    for e in earlier:
        n = min(len(e) // B * B, len(prompt) - 1)
        same = np.flatnonzero(e[:n] != prompt[:n])
        common = int(same[0]) if len(same) else n
        best = max(best, common // B * B)
    return best


class Runs:
    """Sequences run one at a time, each with one shared prefix store and without any; records
    both outputs, the tokens reused and the prompts seen."""

    def __init__(self, backend: Backend, tok: Tokenizer, row: SamplingParams) -> None:
        self.backend, self.tok, self.row = backend, tok, row
        self.store = PrefixStore(backend, 1 << 30)
        self.prompts: list[np.ndarray] = []

    def run(self, prompt: np.ndarray, max_tokens: int) -> list:
        seq = Sequence(0, prompt, max_tokens, self.row)
        got = run_engine(self.backend, self.tok, [seq], self.store, 24)[0]
        plain = Sequence(0, prompt, max_tokens, self.row)
        assert got == run_engine(self.backend, self.tok, [plain], None, 24)[0]
        assert seq.reused == expected_reuse(prompt, self.prompts)
        self.prompts.append(prompt)
        return got

    def conversation(self, turns: list[np.ndarray], max_tokens: int) -> None:
        """Each turn resends the whole history (earlier turns and answers) plus its user turn."""
        history = np.empty(0, np.int32)
        for user in turns:
            prompt = np.concatenate([history, user]).astype(np.int32)
            answer = [t for t in self.run(prompt, max_tokens) if isinstance(t, int)]
            history = np.concatenate([prompt, np.array(answer, np.int32)])


def check_identical(backend: Backend, tok: Tokenizer, words: list[np.ndarray]) -> None:
    """``words``: [shared start, user a, user b, turn 2, turn 2 diverging, turn 3]. Every output
    with reuse equals the one without (greedy; seeded sampling too for the shared start, as it
    notices a changed logit where greedy repeats one token), and the tokens reused are exactly
    the stored blocks the prompt starts with."""
    shared, user_a, user_b, turn2, turn2b, turn3 = words
    assert len(shared) % B, "the shared prefix must end mid-block"
    a, b = np.concatenate([shared, user_a]), np.concatenate([shared, user_b])
    seeded = Runs(backend, tok, SAMPLED)
    seeded.run(a, 8)
    seeded.run(b, 8)  # diverges inside a block
    runs = Runs(backend, tok, SamplingParams())
    runs.run(a, 8)
    runs.run(b, 8)
    runs.run(shared, 8)  # a prompt that is only the shared start
    runs.conversation([shared, turn2, turn3], 8)
    runs.conversation([shared, turn2b, turn3], 8)  # diverges after the first turn
    assert runs.store.hit_tokens > len(shared) * 5


def test_identical_outputs_with_and_without_reuse_on_synthetic() -> None:
    words = [ids(n, 40 + i) for i, n in enumerate((3 * B + 5, 9, 11, 13, 13, 8))]
    check_identical(synthetic(2), TOK, words)


@pytest.fixture(scope="module")
def builtin(smollm2_dir: Path):
    """The default model (SmolLM2 since model.path defaults to it), on the session's
    conversion."""
    from zerolayer.engine.backends.cpu import create_cpu_backend

    # float32 KV, the parity mode: the byte counts below are float32's
    engine_cfg = EngineConfig(
        max_batch_size=2, max_context=512, prefill_chunk=24, kv_dtype="float32"
    )
    model_cfg = ModelConfig(data_dir=data_dir_of(smollm2_dir), dtype="float32")  # parity mode
    return create_cpu_backend(model_cfg, engine_cfg)


def test_identical_outputs_with_and_without_reuse_on_the_builtin_model(builtin) -> None:
    backend, tok = builtin
    text = [
        "<|system|>\nYou are a terse assistant. Answer in one short sentence.\n<|user|>\n",
        "What is a haiku?\n<|assistant|>\n",
        "Name a river.\n<|assistant|>\n",
        "\n<|user|>\nAnd another one?\n<|assistant|>\n",
        "\n<|user|>\nWhy is the sky blue?\n<|assistant|>\n",
        "\n<|user|>\nThanks.\n<|assistant|>\n",
    ]
    words = [np.asarray(tok.encode(t), np.int32) for t in text]
    check_identical(backend, tok, words)


def test_identical_outputs_with_and_without_reuse_on_a_transformers_checkpoint(
    tmp_path: Path,
) -> None:
    pytest.importorskip("transformers")
    backend, tok = checkpoint_backend(tmp_path)
    system = "you are a terse assistant w40 w41 w42 answer in one short sentence " * 2
    shared = tok.encode_prompt(tok.render_chat([{"role": "user", "content": "w50 w51"}], system))
    words = [np.asarray(shared, np.int32)] + [
        np.asarray(tok.encode(t), np.int32)
        for t in ("w60 w61 w62", "w70 w71", "w80 w81 w82 w83", "w90 w91 w92", "w55 w56")
    ]
    check_identical(backend, tok, words)


def test_the_daemon_builds_a_store_only_where_reuse_happens() -> None:
    from zerolayer.config.settings import Settings
    from zerolayer.engine.backends.factory import build_prefix_store

    def settings(**engine) -> Settings:
        return Settings(engine=EngineConfig(backend="synthetic", **engine))

    backend = synthetic()
    store = build_prefix_store(settings(prefix_cache_bytes=4096), backend, None, registered=0)
    assert store is not None and store.capacity_bytes == 4096
    assert build_prefix_store(settings(prefix_cache=False), backend, None, registered=0) is None
    pins_only = build_prefix_store(settings(prefix_cache=False), backend, None, registered=2)
    assert pins_only is not None and pins_only.capacity_bytes == 0

    nokv = NoKV(num_slots=1, vocab_size=259, max_context=64)
    assert build_prefix_store(settings(), nokv, None, registered=0) is None


def test_the_engine_prefills_only_what_the_store_does_not_have() -> None:
    from zerolayer.engine.engine import Engine

    backend = synthetic()
    store = PrefixStore(backend, 1 << 20)
    prompt = ids(3 * B + 5, 50)
    offered(store, prompt)
    backend.kv_pages.release(0)  # slot 0 was borrowed: the store holds its blocks' pages
    engine = Engine(backend, TOK, lambda *_: None, max_queue=4, max_step_tokens=512,
                    prefill_chunk=256, prefix_store=store)  # fmt: skip
    seq = Sequence("a", np.concatenate([prompt, ids(4, 51)]), 2, SamplingParams())
    engine.submit(seq)
    plan = engine.schedule([])
    assert plan is not None and seq.reused == 3 * B
    (chunk,) = plan.chunks
    assert chunk.start == 3 * B and len(chunk.tokens) == len(seq.prompt) - 3 * B and chunk.last
