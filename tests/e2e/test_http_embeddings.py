"""/v1/embeddings and echo with prompt logprobs on /v1/completions (issue #39), with the
official clients against a daemon serving the default model, SmolLM2-135M-Instruct: the openai
SDK (its default base64 and float give the same vectors), batches, token-id inputs, LangChain's
``OpenAIEmbeddings``, ``dimensions`` refused naming it, the key's token budget charged once per
input; echo's prompt logprobs equal transformers' on the same weights, ``max_tokens`` 0 allowed
with echo only."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import openai
import pytest
import torch

from benchmarks._support.daemon import Daemon
from tests.support.smollm2 import SLOW_TIMEOUT_S, data_dir_of
from zerolayer.hooks.keys import add_key

MODEL = "SmolLM2-135M-Instruct"
HIDDEN = 576  # SmolLM2-135M's hidden size
CAT, CAT2, MONEY = (
    "The cat sat on the mat.",
    "A cat was sitting on the mat.",
    "Quarterly revenue rose by five percent.",
)


@pytest.fixture(scope="module")
def keys(tmp_path_factory) -> tuple[Path, str, str]:
    path = tmp_path_factory.mktemp("keys") / "keys.toml"
    free = add_key(path, "free")
    # Room for one batch below (about 25 prompt tokens), not for two.
    tight = add_key(path, "tight", tpm=40)
    return path, free, tight


@pytest.fixture(scope="module")
def daemon(smollm2_dir: Path, keys):
    env = {
        "ENGINE__BACKEND": "cpu",
        "MODEL__DATA_DIR": data_dir_of(smollm2_dir),
        "MODEL__DTYPE": "float32",  # the parity mode: vectors and logprobs vs transformers'
        "ENGINE__MAX_BATCH_SIZE": "4",
        "ENGINE__MAX_CONTEXT": "1024",
        "ENGINE__PREFILL_CHUNK": "8",  # inputs span several prefill chunks
        "CACHE__ENABLED": "false",
        "AUTH__ENABLED": "true",
        "AUTH__KEYS_FILE": str(keys[0]),
    }
    with Daemon(env) as d:
        yield d


def oai(d: Daemon, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=d.http_url + "/v1", api_key=key, max_retries=0)


def vectors(done) -> np.ndarray:
    return np.array([e.embedding for e in sorted(done.data, key=lambda e: e.index)])


@pytest.mark.timeout(SLOW_TIMEOUT_S)
def test_a_batch_of_texts_in_base64_and_float(daemon, keys):
    client = oai(daemon, keys[1])
    b64 = client.embeddings.create(model=MODEL, input=[CAT, CAT2, MONEY])  # the SDK: base64
    flt = client.embeddings.create(model=MODEL, input=[CAT, CAT2, MONEY], encoding_format="float")
    assert [e.index for e in flt.data] == [0, 1, 2] and flt.model == MODEL
    v = vectors(flt)
    assert v.shape == (3, HIDDEN)
    np.testing.assert_allclose(vectors(b64), v, atol=1e-6)
    np.testing.assert_allclose(np.linalg.norm(v, axis=1), 1.0, atol=1e-4)
    assert v[0] @ v[1] > v[0] @ v[2]  # the two cats are closer than the cat and the money
    assert flt.usage.prompt_tokens == flt.usage.total_tokens > 3
    # One input alone gives the vector it has in a batch.
    one = client.embeddings.create(model=MODEL, input=CAT, encoding_format="float")
    assert one.usage.prompt_tokens < flt.usage.prompt_tokens
    np.testing.assert_allclose(vectors(one)[0], v[0], atol=1e-4)


@pytest.mark.timeout(SLOW_TIMEOUT_S)
def test_token_id_inputs_equal_text_inputs_and_match_transformers(
    daemon, keys, smollm2_dir: Path, smollm2_reference_model
):
    from zerolayer.models.hf_tokenizer import HFTokenizer

    ids = HFTokenizer(smollm2_dir).encode_prompt(CAT).tolist()
    client = oai(daemon, keys[1])
    by_text = vectors(client.embeddings.create(model=MODEL, input=CAT, encoding_format="float"))
    by_ids = vectors(client.embeddings.create(model=MODEL, input=ids, encoding_format="float"))
    batch = client.embeddings.create(model=MODEL, input=[ids, ids[:3]], encoding_format="float")
    np.testing.assert_allclose(by_ids[0], by_text[0], atol=1e-5)
    np.testing.assert_allclose(vectors(batch)[0], by_text[0], atol=1e-4)
    assert batch.usage.prompt_tokens == len(ids) + 3
    # transformers on the same GGUF: the last hidden state (after the final norm), mean, L2.
    with torch.inference_mode():
        out = smollm2_reference_model(torch.tensor([ids]), output_hidden_states=True)
    mean = out.hidden_states[-1][0].float().mean(0)
    ref = (mean / mean.norm()).numpy()
    assert float(by_ids[0] @ ref) > 0.995


@pytest.mark.timeout(SLOW_TIMEOUT_S)
def test_langchain_openai_embeddings(daemon, keys):
    from langchain_openai import OpenAIEmbeddings

    emb = OpenAIEmbeddings(
        model=MODEL,
        base_url=daemon.http_url + "/v1",
        api_key=keys[1],
        check_embedding_ctx_length=False,  # else it sends tiktoken's ids, not the model's
        max_retries=0,
    )
    docs = emb.embed_documents([CAT, MONEY])
    query = emb.embed_query(CAT2)
    assert len(docs) == 2 and len(query) == HIDDEN
    assert np.dot(query, docs[0]) > np.dot(query, docs[1])


def test_user_mistakes_are_400s_naming_the_field(daemon, keys):
    client = oai(daemon, keys[1])
    cases = [
        ({"input": CAT, "dimensions": 64}, "dimensions"),
        ({"input": ""}, "input"),
        ({"input": []}, "input"),
        ({"input": [CAT, 7]}, "input[1]"),
        ({"input": [[1, 2], [-1]]}, "input[1]"),
        ({"input": CAT, "encoding_format": "int8"}, "encoding_format"),
        ({"input": [[1, 2], [10**6]]}, "input[1]"),  # outside the vocabulary
    ]
    for fields, param in cases:
        with pytest.raises(openai.BadRequestError) as info:
            client.embeddings.create(model=MODEL, **fields)
        assert info.value.body["param"] == param, (fields, info.value.body)
    with pytest.raises(openai.BadRequestError) as info:
        client.embeddings.create(model=MODEL, input=CAT, extra_body={"truncate_prompt_tokens": 3})
    assert info.value.body["param"] == "truncate_prompt_tokens"
    # max_tokens 0 is for echo only.
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt=CAT, max_tokens=0)
    assert info.value.body["param"] == "max_tokens"
    assert client.embeddings.create(model=MODEL, input=CAT, dimensions=HIDDEN).data


def test_the_key_budget_is_charged_for_each_input(daemon, keys):
    client = oai(daemon, keys[2])  # tpm 40
    done = client.embeddings.create(model=MODEL, input=[CAT, CAT2, MONEY])
    assert 20 < done.usage.prompt_tokens <= 40
    with pytest.raises(openai.RateLimitError):
        client.embeddings.create(model=MODEL, input=[CAT, CAT2, MONEY])
    with pytest.raises(openai.AuthenticationError):
        oai(daemon, "zl_wrong").embeddings.create(model=MODEL, input=CAT)


@pytest.mark.timeout(SLOW_TIMEOUT_S)
def test_echo_returns_the_prompt_with_its_logprobs_equal_to_transformers(
    daemon, keys, smollm2_dir: Path, smollm2_reference_model
):
    from zerolayer.models.hf_tokenizer import HFTokenizer

    client = oai(daemon, keys[1])
    done = client.completions.create(model=MODEL, prompt=CAT, echo=True, logprobs=1, max_tokens=0)
    choice = done.choices[0]
    assert choice.text == CAT and choice.finish_reason == "length"
    assert done.usage.completion_tokens == 0
    lp = choice.logprobs
    ids = HFTokenizer(smollm2_dir).encode_prompt(CAT).tolist()
    assert len(lp.tokens) == len(ids) == done.usage.prompt_tokens
    assert "".join(lp.tokens) == CAT
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert lp.text_offset[0] == 0 and lp.text_offset[1] == len(lp.tokens[0])
    rows = zip(lp.tokens[1:], lp.token_logprobs[1:], lp.top_logprobs[1:], strict=True)
    for token, value, top in rows:
        assert top[token] == value and len(top) in (1, 2)  # the best one and the prompt's own
    with torch.inference_mode():
        logits = smollm2_reference_model(torch.tensor([ids])).logits[0].float()
    ref = torch.log_softmax(logits, -1)[:-1].gather(1, torch.tensor(ids[1:])[:, None])[:, 0]
    np.testing.assert_allclose(lp.token_logprobs[1:], ref.numpy(), atol=0.05)
    # With a completion: the prompt, then the generated tokens, offsets going on.
    more = client.completions.create(
        model=MODEL, prompt=CAT, echo=True, logprobs=0, max_tokens=3, temperature=0
    )
    c = more.choices[0]
    assert c.text.startswith(CAT) and len(c.logprobs.tokens) == len(ids) + 3
    assert c.logprobs.token_logprobs[: len(ids)] == pytest.approx(lp.token_logprobs, abs=1e-4)
    assert c.logprobs.text_offset[len(ids)] == len(CAT)
    # Streamed: the first chunk is the prompt and its logprobs.
    chunks = list(
        client.completions.create(
            model=MODEL, prompt=CAT, echo=True, logprobs=0, max_tokens=3, temperature=0,
            stream=True,
        )
    )  # fmt: skip
    assert chunks[0].choices[0].text == CAT
    assert chunks[0].choices[0].logprobs.token_logprobs[0] is None
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == c.text
