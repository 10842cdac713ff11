"""Issue #40 item 3: logprobs and logit_bias as array operations over the batch — equal to the
per-row references, and a whole-vocabulary bias's sparse rows made once per row set."""

from __future__ import annotations

import numpy as np
import torch

from zerolayer.engine import sampling
from zerolayer.engine.backends.synthetic import SyntheticBackend
from zerolayer.engine.engine import Engine, Sequence
from zerolayer.engine.sampling import Processing, SparseRows, gather_logprobs, process_logits
from zerolayer.sampling_params import SamplingParams
from zerolayer.tokenizer import ByteTokenizer


def test_batched_logprobs_equal_the_log_softmax_of_each_row():
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(6, 500, generator=gen) * 4
    temperature = np.array([1.0, 0.7, 0.0, 1.3, 1.0, 0.5], np.float32)
    want = np.array([20, -1, 0, 5, 20, 1], np.int32)
    ids = np.array([3, 4, 5, 6, 7, 499], np.int32)
    logprob, top_ids, top_lp = gather_logprobs(logits, temperature, ids, want)
    for r in range(6):
        if want[r] < 0:
            assert np.isnan(logprob[r]) and (top_ids[r] == -1).all()
            continue
        t = temperature[r] if temperature[r] > 0 else 1.0
        ref = torch.log_softmax(logits[r] / float(t), dim=-1)
        assert abs(float(ref[ids[r]]) - float(logprob[r])) < 1e-5
        values, idx = torch.topk(ref, int(want.max()))
        k = int(want[r])
        assert top_ids[r, :k].tolist() == idx[:k].tolist()
        np.testing.assert_allclose(top_lp[r, :k], values[:k].numpy(), atol=1e-5)


def test_bias_scatter_equals_a_dense_reference_and_logits_are_not_written():
    gen = torch.Generator().manual_seed(4)
    logits = torch.randn(3, 300, generator=gen)
    before = logits.clone()
    rng = np.random.default_rng(1)
    whole = (np.arange(300, dtype=np.int64), rng.uniform(-100, 100, 300).astype(np.float32))
    few = (np.array([7, 9], np.int64), np.array([5.0, -5.0], np.float32))
    bias = SparseRows.from_arrays([whole, None, few])
    assert len(bias) == 302
    out = process_logits(logits, Processing(bias=bias))
    dense = before.clone()
    dense[0] += torch.from_numpy(whole[1])
    dense[2, 7] += 5.0
    dense[2, 9] -= 5.0
    torch.testing.assert_close(out, dense)
    assert torch.equal(logits, before)
    # only logprobs wanted: nothing changes the logits, so they are not copied
    assert process_logits(logits, Processing(logprobs=np.zeros(3, np.int32))) is logits


def test_a_whole_vocabulary_bias_is_made_into_sparse_rows_once_per_row_set(monkeypatch):
    made = []
    real = SparseRows.from_arrays.__func__  # type: ignore[attr-defined]

    def counting(cls, per_row):
        made.append(sum(p is not None for p in per_row))
        return real(cls, per_row)

    monkeypatch.setattr(sampling.SparseRows, "from_arrays", classmethod(counting))
    vocab = 512
    engine = Engine(
        SyntheticBackend(8, vocab, 4096), ByteTokenizer(), lambda step: None, max_queue=64,
        max_step_tokens=4096, prefill_chunk=256,
    )  # fmt: skip
    whole = SamplingParams(logit_bias={i: 1.0 for i in range(vocab)})
    seqs = [
        Sequence(i, np.array([1, 2, 3], np.int32), 5 if i == 0 else 40, whole, ignore_eos=True)
        for i in range(8)
    ]
    for s in seqs:
        engine.submit(s)
    engine.step()  # the 8 prompts: each last chunk's own rows (a batch of one each)
    prefill = len(made)
    assert prefill == 8
    for _ in range(3):  # the 8 rows decode: the decode set's rows made once
        engine.step()
    assert made[prefill:] == [8]
    for _ in range(10):  # row 0 ends (5 tokens): the new row set's made once more
        engine.step()
    assert made[prefill:] == [8, 7]
