"""The daemon serving its default model, SmolLM2-135M-Instruct, on the real weights: chats sent
together (batched by the engine, decoded on the file's blocks) decode greedily to transformers'
ids on the same GGUF file, a registered system prompt gives the same tokens as the same text
inline, and without a C++ compiler the daemon says why and serves the dense weights."""

from __future__ import annotations

import asyncio
from pathlib import Path

import openai
import pytest

from benchmarks._support.daemon import Daemon
from tests.support.smollm2 import CHATS, MAX_NEW, SLOW_TIMEOUT_S, data_dir_of
from zerolayer.client import Client
from zerolayer.frames.protocol import CACHE_PROMPT
from zerolayer.models.hf_tokenizer import HFTokenizer

SYSTEM = "You are a concise geography tutor. Answer in one short sentence."


@pytest.mark.timeout(SLOW_TIMEOUT_S)
def test_daemon_serves_smollm2_greedy_like_transformers(
    smollm2_dir: Path, smollm2_reference, tmp_path: Path
) -> None:
    config = tmp_path / "zerolayer.toml"
    config.write_text(f'[[prompts]]\nid = 1\nname = "tutor"\ntext = "{SYSTEM}"\n')
    env = {
        "ENGINE__BACKEND": "cpu",  # model.path is left at its default: the bundled SmolLM2
        "MODEL__DATA_DIR": data_dir_of(smollm2_dir),
        "MODEL__DTYPE": "float32",  # the parity mode (the default takes 8-bit activations)
        "ENGINE__MAX_BATCH_SIZE": "4",
        "ENGINE__MAX_CONTEXT": "512",
        "CACHE__ENABLED": "false",  # repeats must run the model, not replay a stored answer
        "LOGGING__LEVEL": "info",  # the model loader's line about the block kernel
    }
    tok = HFTokenizer(smollm2_dir)
    question = [{"role": "user", "content": "What is the capital of France?"}]
    inline_ids = tok.encode(tok.render_chat(question, SYSTEM))

    async def run(endpoint: str) -> dict:
        async with await Client.connect(endpoint) as c:

            async def chat(messages: list[dict], **extra):
                req = {"max_tokens": MAX_NEW, "temperature": 0.0, "messages": messages, **extra}
                return await (await c.generate_json(req)).collect()

            chats = [chat([{"role": "user", "content": text}]) for text in CHATS]
            together = await asyncio.gather(*chats)
            by_id = await chat(question, prompt_id=1)
            by_text = await chat(question, system=SYSTEM)
            inline = await (await c.generate(inline_ids, MAX_NEW, text=False)).collect()
            return {"chats": together, "by_id": by_id, "by_text": by_text, "inline": inline}

    with Daemon(env, config=str(config)) as d:
        assert "model=SmolLM2-135M-Instruct" in d.log
        got = asyncio.run(run(d.endpoint))
        # Logged when the model is loaded (after the listening line): the block kernel is used.
        assert "compute on 211 of the GGUF's quantized matrices" in d.log
        # ignore_eos (the OpenAI API's extension, as in vLLM) on a model that does end: the
        # answer goes on past EOS to max_tokens, with the same beginning.
        api = openai.OpenAI(base_url=d.http_url + "/v1", api_key="none", max_retries=0)
        ask = {
            "model": "SmolLM2-135M-Instruct",
            "messages": question,
            "max_tokens": 40,
            "temperature": 0,
        }
        ends = api.chat.completions.create(**ask)
        goes_on = api.chat.completions.create(**ask, extra_body={"ignore_eos": True})
    assert ends.choices[0].finish_reason == "stop" and ends.usage.completion_tokens < 40
    assert goes_on.choices[0].finish_reason == "length"
    assert goes_on.usage.completion_tokens == 40
    assert goes_on.choices[0].message.content.startswith(ends.choices[0].message.content)

    for text, result in zip(CHATS, got["chats"], strict=True):
        prompt = tok.encode(tok.render_chat([{"role": "user", "content": text}], None))
        assert result.prompt_tokens == len(prompt)
        assert result.ids == smollm2_reference(prompt, MAX_NEW), text
    assert "Paris" in got["chats"][0].text

    by_id, by_text, inline = got["by_id"], got["by_text"], got["inline"]
    # The same ids sent inline find the registered prompt's pinned KV in the prefix store too.
    assert by_id.cache & CACHE_PROMPT and by_text.cache & CACHE_PROMPT
    assert inline.cache & CACHE_PROMPT
    assert by_id.ids == by_text.ids == inline.ids and by_id.ids
    assert by_id.prompt_tokens == inline.prompt_tokens == len(inline_ids)
    assert by_id.ids == smollm2_reference(inline_ids, MAX_NEW)
    assert "Paris" in by_id.text


@pytest.mark.timeout(SLOW_TIMEOUT_S)
def test_daemon_without_a_compiler_serves_dense_weights(
    smollm2_dir: Path, smollm2_reference, tmp_path: Path
):
    # A data dir with the file's description but no built kernel (a built one loads without a
    # compiler), and an earlier version's conversion, which daemons served from: removed at start.
    (tmp_path / "gguf").mkdir()
    (tmp_path / "gguf" / smollm2_dir.name).symlink_to(smollm2_dir)
    served = tmp_path / "gguf" / f"{smollm2_dir.name.rsplit('-', 1)[0]}-v4"
    served.mkdir()
    env = {
        "ENGINE__BACKEND": "cpu",
        "MODEL__DATA_DIR": str(tmp_path),
        "MODEL__DTYPE": "float32",  # the parity mode, compared with transformers
        "ENGINE__MAX_BATCH_SIZE": "2",
        "ENGINE__MAX_CONTEXT": "512",
        "CACHE__ENABLED": "false",
    }
    tok = HFTokenizer(smollm2_dir)
    prompt = tok.encode(tok.render_chat([{"role": "user", "content": CHATS[0]}], None))

    async def run(endpoint: str):
        async with await Client.connect(endpoint) as c:
            return await (await c.generate(prompt, MAX_NEW, text=True)).collect()

    with Daemon(env, raw_env={"CXX": "/nonexistent/c++"}) as d:
        got = asyncio.run(run(d.endpoint))
        log = d.log
    assert (
        "GGUF block kernel unavailable, serving dense weights only: no C++ compiler "
        "('/nonexistent/c++' is not on PATH)"
    ) in log
    assert "quantized matrices" not in log
    assert not served.exists()
    assert (tmp_path / "gguf" / smollm2_dir.name).is_symlink()
    assert got.ids == smollm2_reference(prompt, MAX_NEW) and "Paris" in got.text
