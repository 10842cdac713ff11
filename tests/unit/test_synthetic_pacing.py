"""The synthetic backend's pacing: one pause per engine step, whatever the step carries."""

from __future__ import annotations

import numpy as np

from zerolayer.engine.backends import synthetic
from zerolayer.engine.backends.synthetic import SyntheticBackend
from zerolayer.engine.engine import Engine, Sequence
from zerolayer.sampling_params import SamplingParams
from zerolayer.tokenizer import ByteTokenizer


def _run(monkeypatch, prompts: list[int], arrive_at: dict[int, int], steps: int, **kw):
    """Drive a paced synthetic engine ``steps`` steps; sequence i (prompt length prompts[i])
    is submitted before step arrive_at[i]. Returns the pauses taken per step."""
    pauses: list[float] = []
    monkeypatch.setattr(synthetic.time, "sleep", pauses.append)
    backend = SyntheticBackend(8, 300, 256, step_ms=20.0, **kw)
    engine = Engine(
        backend,
        ByteTokenizer(300),
        lambda *a: None,
        max_queue=16,
        max_step_tokens=12,
        prefill_chunk=8,
    )
    per_step = []
    for step in range(steps):
        for i, at in arrive_at.items():
            if at == step:
                prompt = np.arange(1, prompts[i] + 1, dtype=np.int32)
                engine.submit(Sequence(i, prompt, 6, SamplingParams()))
        before = len(pauses)
        engine.step()
        per_step.append(pauses[before:])
    return per_step


def test_every_step_pauses_once_prefill_decode_or_both(monkeypatch):
    # Step 0 prefills seq 0 alone; step 1 decodes it (its first decode: the rows are exactly
    # what step 0's prefill finished); seq 1 (20 tokens, chunks of 8 within a budget of 12)
    # arrives at step 2 and prefills over three steps alongside seq 0's decode rows.
    per_step = _run(monkeypatch, [4, 20], {0: 0, 1: 2}, steps=9)
    assert [len(p) for p in per_step[:8]] == [1] * 8
    assert all(p == [0.02] for p in per_step[:8])


def test_prefill_tokens_add_their_cost_to_the_steps_pause(monkeypatch):
    per_step = _run(monkeypatch, [4, 6], {0: 0, 1: 0}, steps=3, prefill_us_per_token=1000.0)
    assert per_step[0] == [0.02 + 0.010]  # one pause: 20 ms + 10 prompt tokens x 1 ms
    assert per_step[1] == [0.02] and per_step[2] == [0.02]
