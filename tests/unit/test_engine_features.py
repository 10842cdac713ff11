"""Issue #27's sampling features through the engine: per-row penalties, logit_bias, min_tokens,
grammar rows and logprobs mixed with free rows in one batch, and n > 1 sharing one prefill.

The backend computes real logits (a pure function of the KV it holds and the position) and
samples with zerolayer.engine.sampling, as the CPU backend does; each row's expected tokens and
logprobs come from a plain per-row reference over the same logits, written here without the
kernels."""

from __future__ import annotations

import math
import threading

import numpy as np
import torch

from zerolayer.codes import FinishReason
from zerolayer.engine.backend import Backend, LogitsBackend, ModelInfo, PrefixKV
from zerolayer.engine.engine import NO_TOKEN, Engine, Sequence
from zerolayer.engine.sampling import child_seed
from zerolayer.engine.step import StepOutput
from zerolayer.engine.types import DecodeBatch, PrefillChunk
from zerolayer.sampling_params import SamplingParams
from zerolayer.tokenizer import ByteTokenizer

TOK = ByteTokenizer()
VOCAB = TOK.vocab_size
EOS = TOK.eos_token_id


BASE = torch.randn(VOCAB, generator=torch.Generator().manual_seed(7)) * 2.0


def logits_at(history: np.ndarray) -> torch.Tensor:
    """The next-token logits after ``history`` (every id in the slot up to the position): a
    fixed part, so that greedy rows repeat tokens and penalties matter, and a part that depends
    on the whole history."""
    digest = int(np.dot(history.astype(np.int64) + 1, np.arange(1, len(history) + 1)) % 2**31)
    g = torch.Generator().manual_seed(digest)
    x = BASE + torch.randn(VOCAB, generator=g) * 0.7
    x[EOS] -= 20.0  # EOS only when a test biases it
    return x


class HistoryBackend(LogitsBackend, PrefixKV):
    """KV = the ids at each position of a slot; logits = ``logits_at`` of the slot's ids (the
    engine's one sampler does the rest, as on a model backend)."""

    def __init__(self, num_slots: int = 6, max_context: int = 128) -> None:
        super().__init__(0)
        self.num_slots = num_slots
        self.info = ModelInfo("logits", VOCAB, EOS, max_context)
        self.kv = np.full((num_slots, max_context), -1, np.int32)
        self.chunks: list[tuple[int, int, int]] = []  # (slot, start, length) of every chunk

    def prefill_logits(self, chunks: list[PrefillChunk]) -> torch.Tensor | None:
        last = []
        for c in chunks:
            end = c.start + len(c.tokens)
            self.chunks.append((c.slot, c.start, len(c.tokens)))
            self.kv[c.slot, c.start : end] = c.tokens
            if c.last:
                last.append(logits_at(self.kv[c.slot, :end]))
        return torch.stack(last) if last else None

    def decode_logits(self, batch: DecodeBatch) -> torch.Tensor:
        rows = []
        for slot, token, pos in zip(batch.slots, batch.tokens, batch.positions, strict=True):
            self.kv[slot, pos] = token
            rows.append(logits_at(self.kv[slot, : pos + 1]))
        return torch.stack(rows)

    def save_kv(self, slot: int, start: int, end: int) -> object:
        return self.kv[slot, start:end].copy()

    def load_kv(self, handle: object, slot: int, start: int) -> None:
        assert isinstance(handle, np.ndarray)
        self.kv[slot, start : start + len(handle)] = handle

    def kv_nbytes(self, handle: object) -> int:
        return 0


class Allowing:
    """A grammar that allows ``ids`` and is complete after ``length`` tokens."""

    def __init__(self, ids: set[int], length: int) -> None:
        self.ids, self.length = ids, length

    def matcher(self) -> Allowing.Matcher:
        return Allowing.Matcher(self)

    class Matcher:
        def __init__(self, grammar: Allowing) -> None:
            self.g, self.n = grammar, 0

        def fill(self, bitmask: np.ndarray, row: int, left: int = 0) -> None:
            bits = bitmask.view(np.uint32)
            bits[row] = 0
            for t in self.g.ids:
                bits[row, t // 32] |= np.uint32(1 << (t % 32))

        def accept(self, token: int) -> bool:
            self.n += 1
            return token in self.g.ids

        error = ""  # never exceeds its limits
        budget_closed = False  # never steered

        @property
        def finished(self) -> bool:
            return self.n >= self.g.length


def prompt(text: str) -> np.ndarray:
    return np.array(TOK.encode_prompt(text), np.int32)


def make(owner: str, text: str, max_tokens: int = 8, grammar=None, **sampling) -> Sequence:  # noqa: ANN001
    return Sequence(owner, prompt(text), max_tokens, SamplingParams(**sampling), grammar=grammar)


def drive(engine: Engine, limit: int = 500) -> tuple[dict, dict, dict, list[StepOutput]]:
    """Run to idle: each owner's ids, logprobs (one per produced token) and finish."""
    ids: dict = {}
    lps: dict = {}
    finish: dict = {}
    steps = []
    for _ in range(limit):
        out = engine.step()
        steps.append(out)
        for i, owner in enumerate(out.owners):
            token = int(out.tokens[i])
            if token != NO_TOKEN:
                ids.setdefault(owner, []).append(token)
                if i in out.logprobs:
                    lps.setdefault(owner, []).append(out.logprobs[i])
        for f in out.finished:
            assert f.owner not in finish
            finish[f.owner] = (f.finish, f.n_tokens)
        if engine.idle:
            break
    return ids, lps, finish, steps


def engine_on(backend: Backend) -> Engine:
    return Engine(backend, TOK, lambda _: None, max_queue=32, max_step_tokens=256, prefill_chunk=64)


def reference(text: str, max_tokens: int, **p) -> tuple[list[int], list[torch.Tensor]]:  # noqa: ANN003
    """A greedy row's tokens and per-step log_softmax, one token at a time, by the formulas:
    bias added; repetition (HF) over prompt + output; frequency/presence (OpenAI) over output;
    EOS masked below min_tokens; a grammar's allowed set."""
    history = list(prompt(text))
    n_prompt = len(history)
    out: list[int] = []
    lps = []
    for _ in range(max_tokens):
        x = logits_at(np.array(history, np.int32)).clone()
        if "allowed" in p:
            keep = torch.zeros(VOCAB, dtype=torch.bool)
            keep[list(p["allowed"])] = True
            x[~keep] = -math.inf
        if len(out) < p.get("min_tokens", 0):
            x[EOS] = -math.inf
        for t, v in p.get("bias", {}).items():
            x[t] += v
        rep = p.get("repetition", 1.0)
        for t in set(history):
            x[t] = x[t] / rep if x[t] > 0 else x[t] * rep
        for t in set(out):
            x[t] -= out.count(t) * p.get("frequency", 0.0) + p.get("presence", 0.0)
        lps.append(torch.log_softmax(x, dim=-1))
        token = int(torch.argmax(x))
        if token == EOS:
            break
        out.append(token)
        history.append(token)
        if len(out) == p.get("grammar_length", -1):
            break
    assert n_prompt
    return out, lps


def test_feature_rows_and_free_rows_in_one_batch_match_their_references() -> None:
    xy = {ord("x"), ord("y"), ord("z")}
    rows = {
        "free": ({}, {}),
        "penalised": (
            {"presence_penalty": 1.5, "frequency_penalty": 0.5},
            {"presence": 1.5, "frequency": 0.5},
        ),
        "repeating": ({"repetition_penalty": 1.8}, {"repetition": 1.8}),
        "biased": ({"logit_bias": {ord("q"): 4.0, ord("r"): 3.5}}, {"bias": {113: 4.0, 114: 3.5}}),
        "min": (
            {"logit_bias": {EOS: 40.0}, "min_tokens": 3},
            {"bias": {EOS: 40.0}, "min_tokens": 3},
        ),
        "grammar": ({}, {"allowed": xy, "grammar_length": 5}),
        "logprobs": (
            {"logprobs": True, "top_logprobs": 4, "frequency_penalty": 0.3},
            {"frequency": 0.3},
        ),
    }
    engine = engine_on(HistoryBackend(num_slots=8))
    for name, (sampling, _) in rows.items():
        grammar = Allowing(xy, 5) if name == "grammar" else None
        engine.submit(make(name, f"prompt {name}", 10, grammar, **sampling))
    ids, lps, finish, steps = drive(engine)
    assert max(len(s.owners) for s in steps) == len(rows)  # all in one decode batch
    for name, (_, ref_params) in rows.items():
        want, ref_lps = reference(f"prompt {name}", 10, **ref_params)
        assert ids.get(name, []) == want, name
    assert ids["grammar"] and set(ids["grammar"]) <= xy
    assert finish["grammar"] == (FinishReason.STOP, 5)  # the grammar completed: tokens counted
    assert finish["min"] == (FinishReason.EOS, 3)  # EOS was the argmax, masked for 3 tokens
    assert finish["free"][0] == FinishReason.MAX_TOKENS
    # The features change the tokens (else the references above would prove nothing).
    plain = reference("prompt penalised", 10)[0]
    assert plain != ids["penalised"] and reference("prompt biased", 10)[0] != ids["biased"]
    # Logprobs: only the row that asked, one per token, equal to log_softmax of its processed
    # logits (greedy: T = 1), its top 4 in order.
    assert set(lps) == {"logprobs"}
    _, ref = reference("prompt logprobs", 10, frequency=0.3)
    assert len(lps["logprobs"]) == len(ids["logprobs"]) == 10
    for got, want_lp, token in zip(lps["logprobs"], ref, ids["logprobs"], strict=True):
        assert got.token == float(want_lp[token]) or abs(got.token - float(want_lp[token])) < 1e-5
        top = torch.topk(want_lp, 4)
        assert got.top_ids.tolist() == top.indices.tolist()
        np.testing.assert_allclose(got.top, top.values.numpy(), atol=1e-5)


def test_a_plain_batch_carries_no_processing() -> None:
    seen: list[object] = []

    class Watching(HistoryBackend):
        def decode(self, batch: DecodeBatch) -> np.ndarray:
            seen.append(batch.processing)
            return super().decode(batch)

    engine = engine_on(Watching())
    engine.submit(make("a", "one", 5))
    engine.submit(make("b", "two", 5, temperature=0.7, seed=3))
    drive(engine)
    assert seen and all(p is None for p in seen)


def choices(n: int, text: str, seed: int, max_tokens: int = 12) -> list[Sequence]:
    first = make("c0", text, max_tokens, temperature=1.0, seed=seed)
    for c in range(1, n):
        other = make(f"c{c}", text, max_tokens, temperature=1.0, seed=child_seed(seed, c))
        other.parent = first
        first.choices.append(other)
    return [first, *first.choices]


def test_n_choices_share_one_prefill_and_each_equals_its_own_seeded_request() -> None:
    text = "a prompt long enough to prefill in two chunks " * 2
    backend = HistoryBackend(num_slots=6)
    engine = Engine(backend, TOK, lambda _: None, max_queue=8, max_step_tokens=256,
                    prefill_chunk=40)  # fmt: skip
    group = choices(3, text, seed=99)
    engine.submit(make("other", "something else", 12))
    engine.submit(group[0])
    ids, _, finish, _ = drive(engine)
    n, other = len(prompt(text)), len(prompt("something else"))
    # The prompt went through the backend once; each other choice prefilled only its last
    # token, from the first choice's KV copied into its slot.
    assert sum(length for _, _, length in backend.chunks) == n + 2 + other
    assert sorted(c[1:] for c in backend.chunks if c[1] == n - 1) == [(n - 1, 1)] * 2
    assert all(finish[f"c{c}"] == (FinishReason.MAX_TOKENS, 12) for c in range(3))
    outs = [ids[f"c{c}"] for c in range(3)]
    assert len({tuple(o) for o in outs}) == 3  # three distinct streams
    # Each choice equals a request of its own with its seed, alone on a fresh engine, and in
    # another batch: its tokens depend on its seed alone.
    for c in range(3):
        alone = engine_on(HistoryBackend())
        seed = child_seed(99, c)
        alone.submit(make("x", text, 12, temperature=1.0, seed=seed))
        for k in range(3):
            alone.submit(make(f"noise{k}", f"noise {k}", 12, temperature=1.0))
        assert drive(alone)[0]["x"] == outs[c]


def test_n_choices_wait_for_n_free_slots() -> None:
    backend = HistoryBackend(num_slots=3)
    engine = engine_on(backend)
    engine.submit(make("busy", "holds a slot", 6))
    engine.step()
    engine.submit(choices(3, "three at once", seed=1, max_tokens=4)[0])
    while "busy" not in {f.owner for f in engine.step().finished}:
        assert engine.slots_used == 1  # the group waits: 2 slots free, 3 needed
    ids, _, finish, _ = drive(engine)
    assert all(finish[f"c{c}"] == (FinishReason.MAX_TOKENS, 4) for c in range(3))


def test_cancelling_choice_0_before_its_prefill_cancels_the_waiting_choices() -> None:
    engine = engine_on(HistoryBackend(num_slots=4))
    group = choices(3, "cancel me", seed=5)
    engine.submit(group[0])
    engine.cancel(group[0])
    _, _, finish, _ = drive(engine)
    assert {k: v[0] for k, v in finish.items()} == {
        "c0": FinishReason.CANCELLED, "c1": FinishReason.CANCELLED, "c2": FinishReason.CANCELLED
    }  # fmt: skip
    assert engine.slots_used == 0


class Blocking(Allowing):
    """``Allowing``, whose mask for its token number ``at`` (0: the first) waits for ``release``:
    a grammar whose mask computation overruns any budget."""

    def __init__(self, ids: set[int], length: int, at: int) -> None:
        super().__init__(ids, length)
        self.at = at
        self.release = threading.Event()
        self.blocked = threading.Event()  # the mask has started waiting

    def matcher(self) -> Blocking.Matcher:  # type: ignore[override]
        return Blocking.Matcher(self)

    class Matcher(Allowing.Matcher):
        def fill(self, bitmask: np.ndarray, row: int, left: int = 0) -> None:
            g = self.g
            assert isinstance(g, Blocking)
            if self.n == g.at:
                g.blocked.set()
                assert g.release.wait(30)
            super().fill(bitmask, row, left)


class Raising(Allowing.Matcher):
    """A matcher whose mask for its third token raises."""

    def fill(self, bitmask: np.ndarray, row: int, left: int = 0) -> None:
        if self.n == 2:
            raise RuntimeError("grammar engine blew up\nsecond line")
        super().fill(bitmask, row, left)


def counts_of(engine: Engine, steps: int) -> dict[str, int]:
    """Each owner's tokens over ``steps`` steps."""
    got: dict[str, int] = {}
    for _ in range(steps):
        out = engine.step()
        for i, owner in enumerate(out.owners):
            got[owner] = got.get(owner, 0) + int(out.tokens[i] != NO_TOKEN)
    return got


def test_a_row_whose_mask_is_late_is_parked_and_the_others_go_on() -> None:
    """Issue #40: a constrained row whose mask overruns the step's budget is parked (its slot
    and state kept, no token), never the batch; released, it rejoins and ends with its full
    count. A row whose first mask is late holds only its own prompt's last chunk. (The budget
    is generous: a free grammar's mask, microseconds, is never late even on a loaded machine;
    the blocked ones cost it once each.)"""
    xy = {ord("x"), ord("y")}
    mid, first = Blocking(xy, 6, at=2), Blocking(xy, 6, at=0)
    engine = Engine(HistoryBackend(num_slots=6), TOK, lambda _: None, max_queue=8,
                    max_step_tokens=256, prefill_chunk=64, mask_budget_s=1.0)  # fmt: skip
    engine.submit(make("mid", "blocks at its third token", 6, mid))
    engine.submit(make("first", "blocks at its first token", 6, first))
    engine.submit(make("free", "a free row", 30))
    engine.submit(make("grammar", "a constrained row", 30, Allowing(xy, 100)))
    before = counts_of(engine, 12)
    assert first.blocked.is_set() and mid.blocked.is_set()
    assert before.get("first", 0) == 0 and before["mid"] == 2  # held / parked: no tokens
    assert before["free"] == 12 and before["grammar"] == 12  # the others went on
    rows = engine._rows
    slots = {s.owner: s.slot for s in engine._running}
    assert slots["mid"] in rows.parked and slots["mid"] not in rows.decoding
    assert slots["first"] in rows.held and slots["first"] not in rows.decoding
    mid.release.set()
    first.release.set()
    ids, _, finish, _ = drive(engine)
    assert finish["mid"] == (FinishReason.STOP, 6) and len(ids["mid"]) == 6 - 2
    assert finish["first"] == (FinishReason.STOP, 6) and len(ids["first"]) == 6
    assert set(ids["mid"]) | set(ids["first"]) <= xy
    assert finish["free"] == (FinishReason.MAX_TOKENS, 30)
    assert finish["grammar"] == (FinishReason.MAX_TOKENS, 30)
    assert not rows.parked and not rows.held and rows._constrained == 0


def test_a_matcher_that_raises_ends_its_row_alone_as_a_grammar_failure() -> None:
    from zerolayer.engine.finish import GRAMMAR_FAILED

    xy = {ord("x"), ord("y")}

    class Failing(Allowing):
        def matcher(self) -> Raising:  # type: ignore[override]
            return Raising(self)

    engine = engine_on(HistoryBackend(num_slots=4))
    bad = make("bad", "a grammar that raises", 8, Failing(xy, 100))
    engine.submit(bad)
    engine.submit(make("good", "a grammar that holds", 8, Allowing(xy, 100)))
    engine.submit(make("free", "no grammar", 8))
    ids, _, finish, _ = drive(engine)
    assert finish["bad"] == (GRAMMAR_FAILED, 2) and len(ids["bad"]) == 2
    assert bad.grammar_error == "grammar engine blew up"  # its first line
    assert finish["good"] == (FinishReason.MAX_TOKENS, 8)
    assert finish["free"] == (FinishReason.MAX_TOKENS, 8)
