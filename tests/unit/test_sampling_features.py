"""Sampling features (zerolayer.engine.sampling): penalties, logit_bias, min_tokens, grammar masks
and logprobs, batched per row, checked against a plain per-row reference and against transformers'
logits processors; seeded rows stay independent of the batch with every feature on."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from transformers import (
    MinNewTokensLengthLogitsProcessor,
    RepetitionPenaltyLogitsProcessor,
    SequenceBiasLogitsProcessor,
)

from zerolayer.engine.sampling import (
    Processing,
    Sampler,
    SparseRows,
    child_seed,
    process_logits,
    unpack_bitmask,
)
from zerolayer.sampling_params import SamplingParams, sampling_rows

VOCAB = 300
SLOTS = 8


def _reference_row(
    logits: list[float],
    prompt: list[int],
    output: list[int],
    *,
    presence: float = 0.0,
    frequency: float = 0.0,
    repetition: float = 1.0,
    bias: dict[int, float] | None = None,
    banned: list[int] | None = None,
    allowed: set[int] | None = None,
) -> list[float]:
    """One row processed the obvious way, one token at a time."""
    x = list(logits)
    for t in range(len(x)):
        masked = (allowed is not None and t not in allowed) or (banned and t in banned)
        if masked:
            x[t] = -math.inf
    if banned and all(v == -math.inf for v in x):
        x = [v if allowed is None or t in allowed else -math.inf for t, v in enumerate(logits)]
    for t, v in (bias or {}).items():
        x[t] += v
    for t in set(prompt) | set(output):
        x[t] = x[t] / repetition if x[t] > 0 else x[t] * repetition
    for t in set(output):
        x[t] -= output.count(t) * frequency + presence
    return x


def _bitmask(allowed: list[set[int] | None], vocab: int) -> tuple[torch.Tensor, np.ndarray]:
    words = (vocab + 31) // 32
    mask = np.zeros((len(allowed), words), np.uint32)
    for r, ids in enumerate(allowed):
        for t in ids if ids is not None else range(vocab):
            mask[r, t // 32] |= np.uint32(1 << (t % 32))
    constrained = np.array([a is not None for a in allowed])
    return torch.from_numpy(mask.view(np.int32)), constrained


def _counts(prompts: list[list[int]], outputs: list[list[int]]) -> dict[str, np.ndarray]:
    """Processing's ``counts`` and ``seen`` for rows with these prompts and outputs."""
    counts = np.zeros((len(prompts), VOCAB), np.int32)
    seen = np.zeros((len(prompts), VOCAB), np.bool_)
    for r, (prompt, output) in enumerate(zip(prompts, outputs, strict=True)):
        seen[r, prompt] = True
        for t in output:
            counts[r, t] += 1
            seen[r, t] = True
    return {"counts": counts, "seen": seen}


def test_bitmask_unpacks_to_the_tokens_it_names() -> None:
    allowed = [{0, 31, 32, 299}, None, set()]
    mask, _ = _bitmask(allowed, VOCAB)
    got = unpack_bitmask(mask, VOCAB)
    assert set(torch.nonzero(got[0]).flatten().tolist()) == {0, 31, 32, 299}
    assert bool(got[1].all())
    assert not bool(got[2].any())


def test_batched_processing_matches_per_row_reference() -> None:
    rng = np.random.default_rng(3)
    b = 6
    logits = torch.randn(b, VOCAB) * 3
    prompts = [list(rng.integers(0, VOCAB, 20)) for _ in range(b)]
    outputs = [list(rng.integers(0, 40, 15)) for _ in range(b)]  # repeats: counts > 1
    params = [
        {},  # a free row
        {"presence": 0.7, "frequency": 0.3},
        {"repetition": 1.3},
        {"bias": {5: 10.0, 7: -100.0, 299: 2.5}},
        {"banned": [0, 1, 2], "allowed": set(range(0, 64))},
        {"presence": -0.5, "frequency": 1.1, "repetition": 0.8, "bias": {3: 1.0}},
    ]
    mask, constrained = _bitmask([p.get("allowed") for p in params], VOCAB)
    proc = Processing(
        **_counts(prompts, outputs),
        presence=np.array([p.get("presence", 0.0) for p in params], np.float32),
        frequency=np.array([p.get("frequency", 0.0) for p in params], np.float32),
        repetition=np.array([p.get("repetition", 1.0) for p in params], np.float32),
        bias=SparseRows.from_rows([p.get("bias") for p in params]),
        banned=SparseRows.from_rows([p.get("banned") for p in params]),
        allowed=mask,
        constrained=constrained,
    )
    got = process_logits(logits, proc)
    for r, p in enumerate(params):
        ref = _reference_row(logits[r].tolist(), prompts[r], outputs[r], **p)
        np.testing.assert_allclose(got[r].numpy(), np.array(ref, np.float32), rtol=1e-5, atol=1e-5)


def test_repetition_penalty_equals_transformers() -> None:
    torch.manual_seed(0)
    logits = torch.randn(3, VOCAB) * 4
    seqs = [list(range(10, 40)), [5, 5, 6, 250], [1]]
    penalties = [1.2, 0.7, 2.0]
    counts = _counts(seqs, [[] for _ in seqs])
    proc = Processing(**counts, repetition=np.array(penalties, np.float32))
    got = process_logits(logits, proc)
    for r in range(3):
        hf = RepetitionPenaltyLogitsProcessor(penalties[r])(
            torch.tensor([seqs[r]]), logits[r : r + 1].clone()
        )
        torch.testing.assert_close(got[r], hf[0])


def test_logit_bias_equals_transformers_sequence_bias() -> None:
    logits = torch.randn(2, VOCAB)
    bias = [{4: 3.0, 9: -2.0}, {100: 50.0}]
    got = process_logits(logits, Processing(bias=SparseRows.from_rows(bias)))
    for r in range(2):
        hf = SequenceBiasLogitsProcessor({(t,): v for t, v in bias[r].items()})
        want = hf(torch.tensor([[1, 2]]), logits[r : r + 1].clone())
        torch.testing.assert_close(got[r], want[0])


def test_min_tokens_masks_stop_ids_like_transformers() -> None:
    logits = torch.randn(1, VOCAB)
    eos = [0, 7]
    got = process_logits(logits, Processing(banned=SparseRows.from_rows([eos])))
    hf = MinNewTokensLengthLogitsProcessor(
        prompt_length_to_skip=2, min_new_tokens=5, eos_token_id=eos
    )(torch.tensor([[1, 2, 3]]), logits.clone())
    torch.testing.assert_close(got, hf.float())


def test_min_tokens_gives_way_when_the_grammar_allows_only_stop_ids() -> None:
    logits = torch.randn(1, VOCAB)
    mask, constrained = _bitmask([{0}], VOCAB)  # a finished grammar: only EOS
    proc = Processing(banned=SparseRows.from_rows([[0]]), allowed=mask, constrained=constrained)
    x = process_logits(logits, proc)
    assert torch.isfinite(x[0, 0])
    assert torch.isinf(x[0, 1:]).all()


def test_grammar_rows_only_sample_allowed_tokens_free_rows_unchanged() -> None:
    torch.manual_seed(4)
    b = 8
    logits = torch.randn(b, VOCAB) * 2
    allowed = [{3, 50, 77} if r % 2 else None for r in range(b)]
    mask, constrained = _bitmask(allowed, VOCAB)
    sampler = Sampler(0)
    params = sampling_rows(SamplingParams(temperature=1.5, seed=r) for r in range(b))
    free = sampler.sample(logits, params, np.zeros(b)).ids
    for step in range(30):
        out = sampler.sample(
            logits, params, np.full(b, step), Processing(allowed=mask, constrained=constrained)
        )
        for r in range(1, b, 2):
            assert int(out.ids[r]) in {3, 50, 77}
        if step == 0:  # the same positions as `free`: the free rows drew the same tokens
            np.testing.assert_array_equal(out.ids[::2], free[::2])


def test_logprobs_are_log_softmax_after_processing_and_temperature() -> None:
    torch.manual_seed(5)
    b = 4
    logits = torch.randn(b, VOCAB)
    temperature = np.array([1.0, 0.5, 0.0, 2.0], np.float32)
    want = np.array([5, 20, 0, -1], np.int32)
    bias = [None, {7: 3.0}, None, None]
    params = sampling_rows(
        SamplingParams(temperature=float(t), top_k=k, top_p=p)
        for t, k, p in zip(temperature, [0, 10, 0, 0], [1.0, 1.0, 1.0, 0.5], strict=True)
    )
    out = Sampler(1).sample(
        logits,
        params,
        np.zeros(b),
        Processing(bias=SparseRows.from_rows(bias), logprobs=want),
    )
    assert out.top_ids is not None and out.top_logprobs is not None and out.logprob is not None
    assert out.top_ids.shape == (b, 20)
    for r in range(3):
        x = logits[r].clone()
        if bias[r]:
            for t, v in bias[r].items():
                x[t] += v
        ref = torch.log_softmax(x / (temperature[r] or 1.0), dim=-1)
        assert out.logprob[r] == pytest.approx(float(ref[out.ids[r]]), abs=1e-5)
        k = int(want[r])
        top = torch.topk(ref, k)
        np.testing.assert_array_equal(out.top_ids[r, :k], top.indices.numpy())
        np.testing.assert_allclose(out.top_logprobs[r, :k], top.values.numpy(), atol=1e-5)
    assert math.isnan(out.logprob[3])  # did not ask
    assert out.ids[2] == int(logits[2].argmax())  # greedy row's logprob is at T = 1


@pytest.mark.parametrize("where", [0, 5, 16])
def test_seeded_row_with_every_feature_is_independent_of_the_batch(where: int) -> None:
    torch.manual_seed(6)
    row = torch.randn(1, VOCAB)
    others = torch.randn(16, VOCAB)

    def run(batch: torch.Tensor, at: int, sampler_seed: int) -> list[int]:
        b = batch.shape[0]
        sampler = Sampler(sampler_seed)
        outputs: list[list[int]] = [[] for _ in range(b)]
        mask, constrained = _bitmask(
            [set(range(100, 200)) if r == at else None for r in range(b)], VOCAB
        )
        tokens = []
        for step in range(12):
            proc = Processing(
                **_counts([[r, 3, 9] for r in range(b)], outputs),
                presence=np.full(b, 0.4, np.float32),
                frequency=np.full(b, 0.2, np.float32),
                repetition=np.full(b, 1.1, np.float32),
                bias=SparseRows.from_rows([{150: 1.5} if r == at else {1: 2.0} for r in range(b)]),
                banned=SparseRows.from_rows(
                    [[101] if r == at and step < 4 else [] for r in range(b)]
                ),
                allowed=mask,
                constrained=constrained,
                logprobs=np.full(b, 3, np.int32),
            )
            params = sampling_rows(
                SamplingParams(temperature=0.9, top_k=50, top_p=0.95, seed=777 if r == at else None)
                for r in range(b)
            )
            out = sampler.sample(batch, params, np.full(b, 10 + step), proc)
            tokens.append(int(out.ids[at]))
            for r in range(b):  # the engine's rows count every sampled token of a row
                outputs[r].append(int(out.ids[r]))
        return tokens

    alone = run(row, 0, 0)
    batch = torch.cat([others[:where], row, others[where:]])
    assert run(batch, where, where + 11) == alone
    assert all(100 <= t < 200 for t in alone)


def test_child_seeds_are_distinct_streams() -> None:
    assert child_seed(1234, 0) == 1234
    seeds = {child_seed(1234, i) for i in range(8)}
    assert len(seeds) == 8
    assert child_seed(1234, 3) == child_seed(1234, 3)
