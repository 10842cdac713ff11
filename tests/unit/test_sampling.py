"""Sampling: greedy, filters, batch-independent seeded draws, and the sampled distribution."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from zerolayer.engine.sampling import Sampler, sample_with_uniforms, seeded_uniform, splitmix64
from zerolayer.sampling_params import SAMPLING_ROW

VOCAB = 500


def _rows(b: int, **kw: object) -> dict[str, np.ndarray]:
    """``Sampler.sample``'s row arguments: ``params`` (SAMPLING_ROW [b]) and ``positions``."""
    params = np.zeros(b, SAMPLING_ROW)
    params["temperature"] = kw.get("temperature", 1.0)
    params["top_k"] = kw.get("top_k", 0)
    params["top_p"] = kw.get("top_p", 1.0)
    params["min_p"] = kw.get("min_p", 0.0)
    params["seed"] = np.arange(b, dtype=np.uint64) + np.uint64(kw.get("seed", 1))
    params["seeded"] = kw.get("seeded", True)
    return {"params": params, "positions": np.full(b, kw.get("position", 7), np.int64)}


def test_splitmix64_known_values() -> None:
    # First outputs of the reference splitmix64 generator started at state 0.
    first = splitmix64(np.array([0], np.uint64))[0]
    second = splitmix64(np.array([0x9E3779B97F4A7C15], np.uint64))[0]
    assert first == np.uint64(0xE220A8397B1DCDAF)
    assert second == np.uint64(0x6E789E6AA1B965F4)


def test_seeded_uniform_range_and_dependence() -> None:
    u = seeded_uniform(np.arange(1000, dtype=np.uint64), np.zeros(1000, np.int64))
    assert ((u >= 0) & (u < 1)).all()
    assert 0.4 < u.mean() < 0.6
    a = seeded_uniform(np.array([5], np.uint64), np.array([3]))
    assert a == seeded_uniform(np.array([5], np.uint64), np.array([3]))
    assert a != seeded_uniform(np.array([5], np.uint64), np.array([4]))
    assert a != seeded_uniform(np.array([6], np.uint64), np.array([3]))


def test_greedy_is_argmax() -> None:
    logits = torch.randn(16, VOCAB)
    ids = Sampler(0).sample(logits, **_rows(16, temperature=0.0, seeded=False)).ids
    assert ids.dtype == np.int32
    np.testing.assert_array_equal(ids, logits.argmax(-1).numpy())


def test_top_k_one_and_tiny_top_p_are_greedy() -> None:
    logits = torch.randn(16, VOCAB)
    sampler = Sampler(0)
    expected = logits.argmax(-1).numpy()
    np.testing.assert_array_equal(sampler.sample(logits, **_rows(16, top_k=1)).ids, expected)
    np.testing.assert_array_equal(sampler.sample(logits, **_rows(16, top_p=1e-6)).ids, expected)
    np.testing.assert_array_equal(
        sampler.sample(logits, **_rows(16, top_p=1e-6, temperature=5.0, seeded=False)).ids, expected
    )


def test_sampling_is_not_greedy_at_high_temperature() -> None:
    logits = torch.randn(64, VOCAB)
    ids = Sampler(0).sample(logits, **_rows(64, temperature=10.0)).ids
    assert (ids != logits.argmax(-1).numpy()).sum() > 32


def test_top_k_restricts_to_k_best() -> None:
    logits = torch.randn(1, VOCAB)
    best5 = set(torch.topk(logits[0], 5).indices.tolist())
    seen = set()
    for seed in range(200):
        ids = Sampler().sample(logits, **_rows(1, top_k=5, temperature=100.0, seed=seed)).ids
        seen.add(int(ids[0]))
    assert seen <= best5
    assert len(seen) == 5


def test_top_p_keeps_smallest_prefix_reaching_p() -> None:
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    logits = probs.log()
    seen = set()
    for seed in range(300):
        ids = Sampler().sample(logits, **_rows(1, top_p=0.7, seed=seed)).ids
        seen.add(int(ids[0]))
    assert seen == {0, 1}  # 0.5 < 0.7 needs the second token; 0.8 >= 0.7 stops there


@pytest.mark.parametrize("params", [{}, {"top_k": 40}, {"top_p": 0.9}, {"temperature": 0.7}])
def test_seeded_row_independent_of_batch(params: dict) -> None:
    torch.manual_seed(1)
    row = torch.randn(1, VOCAB)
    others = torch.randn(32, VOCAB)
    alone = Sampler(0).sample(row, **_rows(1, seed=1234, position=99, **params)).ids
    for where in (0, 13, 32):
        batch = torch.cat([others[:where], row, others[where:]])
        p = _rows(33, seeded=False, temperature=0.8, top_k=7, **{"position": 3})
        target = p["params"][where : where + 1]  # a view: writes go into the batch's rows
        target["seeded"], target["seed"] = True, 1234
        target["temperature"] = params.get("temperature", 1.0)
        target["top_k"] = params.get("top_k", 0)
        target["top_p"] = params.get("top_p", 1.0)
        p["positions"][where] = 99
        assert Sampler(where + 1).sample(batch, **p).ids[where] == alone[0]


def test_seeded_rows_reproducible_unseeded_vary() -> None:
    logits = torch.zeros(1, VOCAB)  # uniform distribution
    seeded = {int(Sampler(i).sample(logits, **_rows(1, seed=42)).ids[0]) for i in range(5)}
    assert len(seeded) == 1
    sampler = Sampler(0)
    unseeded = {int(sampler.sample(logits, **_rows(1, seeded=False)).ids[0]) for _ in range(20)}
    assert len(unseeded) > 5


def test_distribution_matches_probabilities() -> None:
    probs = np.array([0.6, 0.3, 0.1])
    logits = torch.tensor(np.log(probs), dtype=torch.float32)[None].repeat(4000, 1)
    p = _rows(4000, seed=0)
    p["params"]["seed"] = np.arange(4000, dtype=np.uint64) * np.uint64(7919)
    ids = Sampler().sample(logits, **p).ids
    freq = np.bincount(ids, minlength=3) / len(ids)
    np.testing.assert_allclose(freq, probs, atol=0.03)


def test_inverse_cdf_boundaries() -> None:
    logits = torch.tensor([[0.0, 0.0, 0.0, float("-inf")]])
    t, k, p, m = torch.ones(1), torch.zeros(1, dtype=torch.int64), torch.ones(1), torch.zeros(1)
    assert sample_with_uniforms(logits, t, k, p, m, torch.tensor([0.0], dtype=torch.float64)) == 0
    near_one = torch.tensor([1 - 2**-53], dtype=torch.float64)
    # Never lands on the zero-probability token, even at the top of [0, 1).
    assert sample_with_uniforms(logits, t, k, p, m, near_one) == 2


# Token weights 8 : 4 : 2 : 1 (probabilities 8/15, 4/15, 2/15, 1/15 at temperature 1).
WEIGHTS = torch.tensor([[8.0, 4.0, 2.0, 1.0]]).log()


def _cdf_edges(temperature: float, min_p: float) -> list[int]:
    """The token each of 1000 evenly spread uniforms draws (inverse CDF, one row)."""
    u = (torch.arange(1000, dtype=torch.float64) + 0.5) / 1000  # no u on a CDF step
    b = len(u)
    return sample_with_uniforms(
        WEIGHTS.repeat(b, 1), torch.full((b,), temperature), torch.zeros(b, dtype=torch.int64),
        torch.ones(b), torch.full((b,), min_p), u,
    ).tolist()  # fmt: skip


def test_min_p_keeps_the_tokens_at_least_min_p_times_as_likely_as_the_top_one() -> None:
    # T = 1, min_p 0.3: the bar is 0.3 x 8/15 = 2.4/15, so tokens 0 and 1 stay (8/15, 4/15) and
    # tokens 2 and 3 go (2/15, 1/15); the two left, renormalised: 2/3 and 1/3.
    draws = _cdf_edges(1.0, 0.3)
    assert draws.count(0) == 667 and draws.count(1) == 333  # u < 2/3 -> token 0
    # min_p 0: off, every token drawn in proportion (8, 4, 2, 1 of 15).
    assert [_cdf_edges(1.0, 0.0).count(t) for t in range(4)] == [533, 267, 133, 67]
    # min_p 1: only the top token (nothing else is as likely).
    assert set(_cdf_edges(1.0, 1.0)) == {0}


def test_min_p_applies_after_the_temperature() -> None:
    # T = 2 flattens the weights to their square roots: 2.83 : 2 : 1.41 : 1. With min_p 0.3 the
    # bar is 0.3 x 2.83 = 0.85, so all four stay (before the temperature, token 3's 1/15 would
    # be under 0.3 x 8/15 and go). With min_p 0.6 (bar 1.70) tokens 0 and 1 stay, in
    # proportion 2.83 : 2, i.e. 0.586 and 0.414.
    assert set(_cdf_edges(2.0, 0.3)) == {0, 1, 2, 3}
    draws = _cdf_edges(2.0, 0.6)
    share = 2 * 2**0.5 / (2 * 2**0.5 + 2)
    assert set(draws) == {0, 1} and abs(draws.count(0) / 1000 - share) < 0.002


def test_min_p_through_the_sampler_seeded_rows_follow_the_cut_distribution() -> None:
    logits = WEIGHTS.repeat(3000, 1)
    p = _rows(3000, min_p=0.3)
    p["params"]["seed"] = np.arange(3000, dtype=np.uint64) * np.uint64(7919)
    freq = np.bincount(Sampler().sample(logits, **p).ids, minlength=4) / 3000
    np.testing.assert_allclose(freq, [2 / 3, 1 / 3, 0, 0], atol=0.03)
    # A greedy row is the argmax whatever its min_p.
    greedy = Sampler().sample(logits[:4], **_rows(4, temperature=0.0, min_p=0.9)).ids
    assert greedy.tolist() == [0, 0, 0, 0]
