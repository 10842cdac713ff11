"""Prompt outputs through the engine (issue #39): an embedding (the pooled final-norm states)
and prompt logprobs, written by the backend into the prefill chunks and gathered by the
sequence; ``max_tokens`` 0 ends after the prefill. On the synthetic backend (chunking, the
prefix store, the endings) and on the bundled model (the values, against references computed
from the decoder's own states and logits)."""

from __future__ import annotations

import numpy as np
import pytest

from tests.support.kv import reserve
from zerolayer.codes import FinishReason
from zerolayer.engine.backends.synthetic import HIDDEN, SyntheticBackend
from zerolayer.engine.engine import NO_TOKEN, Engine, Sequence
from zerolayer.engine.prefix_store import PrefixStore
from zerolayer.engine.step import Finished
from zerolayer.sampling_params import SamplingParams
from zerolayer.tokenizer import ByteTokenizer

TOK = ByteTokenizer()
GREEDY = SamplingParams(temperature=0.0)


def engine_of(backend, tokenizer=TOK, chunk=64, store=None) -> Engine:
    return Engine(
        backend, tokenizer, lambda o: None, max_queue=16, max_step_tokens=256,
        prefill_chunk=chunk, prefix_store=store,
    )  # fmt: skip


def run(engine: Engine, seqs: list[Sequence]) -> tuple[dict[object, list[int]], list[Finished]]:
    """Every sequence to its end: the tokens each produced, and the endings in order."""
    for s in seqs:
        engine.submit(s)
    tokens: dict[object, list[int]] = {s.owner: [] for s in seqs}
    ended: list[Finished] = []
    for _ in range(200):
        step = engine.step()
        for i, owner in enumerate(step.owners):
            if int(step.tokens[i]) != NO_TOKEN:
                tokens[owner].append(int(step.tokens[i]))
        ended += step.finished
        if engine.idle:
            break
    assert engine.idle and engine.slots_used == 0
    return tokens, ended


def synthetic() -> SyntheticBackend:
    return SyntheticBackend(num_slots=4, vocab_size=TOK.vocab_size, max_context=256)


PROMPT = TOK.encode_prompt("the quick brown fox jumps over the lazy dog, twice over")


def test_embedding_is_unit_length_deterministic_and_the_same_however_the_prompt_is_chunked():
    whole = Sequence("whole", PROMPT, 0, GREEDY, pool=True)
    chunked = Sequence("chunked", PROMPT, 0, GREEDY, pool=True)
    other = Sequence("other", TOK.encode_prompt("something else entirely"), 0, GREEDY, pool=True)
    run(engine_of(synthetic()), [whole, other])
    run(engine_of(synthetic(), chunk=5), [chunked])  # 11 chunks
    assert whole.pooled is not None and chunked.pooled is not None and other.pooled is not None
    assert whole.pooled.shape == (HIDDEN,) and whole.pooled.dtype == np.float32
    assert abs(float(np.linalg.norm(whole.pooled)) - 1.0) < 1e-5
    np.testing.assert_allclose(whole.pooled, chunked.pooled, atol=1e-5)
    assert float(whole.pooled @ other.pooled) < 0.99


def test_max_tokens_zero_ends_after_the_prefill_without_a_row_and_others_go_on():
    engine = engine_of(synthetic())
    embed = Sequence("embed", PROMPT, 0, GREEDY, pool=True)
    gen = Sequence("gen", PROMPT, 5, GREEDY)
    tokens, ended = run(engine, [embed, gen])
    assert tokens == {"embed": [], "gen": tokens["gen"]} and len(tokens["gen"]) == 5
    finish = {f.owner: (f.finish, f.n_tokens) for f in ended}
    assert finish == {"embed": (FinishReason.MAX_TOKENS, 0), "gen": (FinishReason.MAX_TOKENS, 5)}
    assert [f.owner for f in ended] == ["embed", "gen"]  # the embedding in its prefill's step


def test_prompt_logprobs_cover_each_id_after_the_first_and_do_not_depend_on_chunking():
    whole = Sequence("whole", PROMPT, 0, GREEDY, score=3)
    chunked = Sequence("chunked", PROMPT, 0, GREEDY, score=3)
    run(engine_of(synthetic()), [whole])
    run(engine_of(synthetic(), chunk=7), [chunked])
    lp, lp2 = whole.prompt_logprobs, chunked.prompt_logprobs
    assert lp is not None and lp2 is not None
    assert lp.token.shape == (len(PROMPT) - 1,) and lp.top_ids.shape == (len(PROMPT) - 1, 3)
    np.testing.assert_array_equal(lp.token, lp2.token)
    np.testing.assert_array_equal(lp.top_ids, lp2.top_ids)
    assert (lp.token <= lp.top[:, 0] + 1e-6).all() and (np.diff(lp.top, axis=1) <= 0).all()


def test_a_sequence_with_prompt_outputs_computes_its_whole_prompt_despite_the_prefix_store():
    backend = synthetic()
    store = PrefixStore(backend, 1 << 20)
    engine = engine_of(backend, store=store)
    long_prompt = np.tile(PROMPT, 2)  # > 16 ids: full blocks go to the store
    plain = Sequence("plain", long_prompt, 2, GREEDY)
    run(engine, [plain])
    again = Sequence("again", long_prompt, 2, GREEDY)
    embed = Sequence("embed", long_prompt, 0, GREEDY, pool=True)
    run(engine, [again, embed])
    assert again.reused > 0  # the store knows the prompt ...
    assert embed.reused == 0 and embed.pooled is not None  # ... and is not read for states


def test_a_generating_sequence_scores_its_prompt_and_samples_as_a_plain_one():
    scored = Sequence("scored", PROMPT, 4, GREEDY, score=0)
    plain = Sequence("plain", PROMPT, 4, GREEDY)
    tokens, _ = run(engine_of(synthetic()), [scored, plain])
    assert tokens["scored"] == tokens["plain"] and len(tokens["plain"]) == 4
    assert scored.prompt_logprobs is not None
    assert scored.prompt_logprobs.top_ids.shape == (len(PROMPT) - 1, 0)


def test_choices_of_a_prompt_only_request_end_with_it():
    first = Sequence("c0", PROMPT, 0, GREEDY, score=1)
    second = Sequence("c1", PROMPT, 0, GREEDY)
    second.parent = first
    first.choices.append(second)
    _, ended = run(engine_of(synthetic()), [first])
    assert sorted((f.owner, f.finish) for f in ended) == [
        ("c0", FinishReason.MAX_TOKENS),
        ("c1", FinishReason.MAX_TOKENS),
    ]
    assert first.prompt_logprobs is not None


# ---- the bundled model: the values ------------------------------------------------------------


@pytest.fixture(scope="module")
def cpu(tmp_path_factory):
    from zerolayer.config.settings import BUILTIN_MODEL, EngineConfig, ModelConfig
    from zerolayer.engine.backends.cpu import create_cpu_backend

    data_dir = str(tmp_path_factory.mktemp("builtin"))
    cfg = EngineConfig(max_batch_size=4, max_context=256, prefill_chunk=64, max_step_tokens=256)
    return create_cpu_backend(ModelConfig(path=BUILTIN_MODEL, data_dir=data_dir), cfg)


def test_cpu_embedding_and_prompt_logprobs_equal_references_from_the_decoder(cpu):
    """The embedding is the mean of the final norm's outputs (captured by a hook on the
    decoder's ``norm`` while it prefills the prompt in one forward), L2-normalised; the prompt
    logprobs are log_softmax of the model's logits at every position, gathered at the next id.
    The engine prefills in chunks of 6, so the chunks' sums are added up."""
    import torch

    backend, tokenizer = cpu
    prompt = tokenizer.encode_prompt("The cat sat on the mat because it was warm there.")
    assert len(prompt) > 6
    seq = Sequence("e", prompt, 0, GREEDY, pool=True, score=2)
    run(engine_of(backend, tokenizer, chunk=6), [seq])
    model = backend.model
    states: list[torch.Tensor] = []
    handle = model.norm.register_forward_hook(lambda _m, _i, out: states.append(out.detach()))
    try:
        with torch.inference_mode():
            ids = torch.from_numpy(prompt.astype(np.int64))
            reserve(backend, 0, 0, len(prompt))
            logits = model.prefill(ids, 0, 0, backend.cache, all_logits=True)
            backend.kv_pages.release(0)
    finally:
        handle.remove()
    (hidden,) = states  # [1, n, hidden]: one forward, every position
    mean = hidden[0].float().mean(0)
    ref = (mean / mean.norm()).numpy()
    assert seq.pooled is not None and seq.pooled.shape == (backend.info.hidden_size,)
    assert float(seq.pooled @ ref) > 0.9999
    np.testing.assert_allclose(seq.pooled, ref, atol=1e-3)
    lp = torch.log_softmax(logits.float(), -1)[:-1]  # position p scores id p + 1
    want = lp.gather(1, ids[1:, None])[:, 0].numpy()
    got = seq.prompt_logprobs
    assert got is not None
    np.testing.assert_allclose(got.token, want, atol=1e-3)
    top = torch.topk(lp, 2)
    assert got.top_ids.tolist() == top.indices.tolist()
    np.testing.assert_allclose(got.top, top.values.numpy(), atol=1e-3)
