"""Registered prompts in a running daemon: identical to inline, refused when invalid."""

from __future__ import annotations

import json
import urllib.request
from pathlib import Path

import pytest

from zerolayer.config.settings import BUILTIN_MODEL
from zerolayer.request_path.prompts import (
    system_ids,
)
from zerolayer.tokenizer import ByteTokenizer

SYSTEM = "You are a terse assistant. Answer in one short sentence and never apologise."
TOK = ByteTokenizer()


@pytest.fixture(scope="module")
def builtin_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("builtin")


WIRED = (
    "prompts"
    in __import__("zerolayer.config.settings", fromlist=["Settings"]).Settings.model_fields
)


needs_wiring = pytest.mark.skipif(not WIRED, reason="Settings has no [[prompts]] key yet")


E2E_ENV = {
    "ENGINE__BACKEND": "cpu",
    "MODEL__PATH": BUILTIN_MODEL,
    "ENGINE__MAX_BATCH_SIZE": "4",
    "ENGINE__MAX_CONTEXT": "512",
    "ENGINE__PREFILL_CHUNK": "64",
    "ENGINE__MAX_STEP_TOKENS": "128",
    # Deterministic repeats would be answered from the response cache (DONE bit 0), which
    # replays a stored answer instead of running the model: off, to test the prefix path.
    "CACHE__ENABLED": "false",
}


def e2e_config(tmp_path: Path, body: str) -> str:
    path = tmp_path / "zerolayer.toml"
    path.write_text(body)
    return str(path)


@needs_wiring
def test_daemon_serves_registered_prompts_identically_to_inline(
    tmp_path: Path, builtin_dir: Path
) -> None:
    import asyncio

    from benchmarks._support.daemon import Daemon
    from zerolayer.client import Client, ServerError
    from zerolayer.frames.protocol import CACHE_PROMPT, ErrorCode

    (tmp_path / "prompts").mkdir()
    (tmp_path / "prompts" / "second.txt").write_text("Answer in French.\n")
    config = e2e_config(
        tmp_path,
        f'[[prompts]]\nid = 1\nname = "terse"\ntext = "{SYSTEM}"\n'
        '[[prompts]]\nid = 7\nname = "french"\nfile = "prompts/second.txt"\n',
    )
    env = dict(E2E_ENV, MODEL__DATA_DIR=str(builtin_dir))
    user = TOK.encode("<|user|>\nWhat is a haiku?\n<|assistant|>\n")
    full = system_ids(TOK, SYSTEM).tolist() + user
    messages = [{"role": "user", "content": "What is a haiku?"}]
    sampled = {"temperature": 1.0, "seed": 99}

    async def run(endpoint: str) -> dict:
        out = {}
        async with await Client.connect(endpoint) as c:

            async def binary(ids: list[int], prompt_id: int = 0):
                s = await c.generate(ids, 20, prompt_id=prompt_id, text=False, **sampled)
                return await s.collect()

            async def chat(**extra):
                req = {"max_tokens": 20, "messages": messages, **sampled, **extra}
                return await (await c.generate_json(req)).collect()

            out["by_id"] = await binary(user, prompt_id=1)
            out["inline"] = await binary(full)
            out["json_system"] = await chat(system=SYSTEM)
            out["json_prompt_id"] = await chat(prompt_id=1)
            out["json_other"] = await chat(system=SYSTEM + " ")
            try:
                await binary(user, prompt_id=99)
            except ServerError as exc:
                out["unknown"] = exc
        return out

    with Daemon(env, config=config) as d:
        got = asyncio.run(run(d.endpoint))
        with urllib.request.urlopen(d.metrics_url + "/prompts", timeout=10) as resp:
            listed = json.loads(resp.read())["prompts"]
        metrics = urllib.request.urlopen(d.metrics_url + "/metrics", timeout=10).read().decode()
    french = system_ids(TOK, "Answer in French.")  # the file's final line break is dropped
    assert [(p["id"], p["name"], p["tokens"]) for p in listed] == [
        (1, "terse", len(full) - len(user)),
        (7, "french", len(french)),
    ]
    assert all(p["kv_bytes"] > 0 for p in listed)
    by_id, inline = got["by_id"], got["inline"]
    assert by_id.ids == inline.ids and len(by_id.ids) == 20
    assert by_id.prompt_tokens == inline.prompt_tokens == len(full)
    # The inline request sends the same ids: the prefix store finds the pinned prompt for it
    # too (registered or not, one mechanism).
    assert by_id.cache & CACHE_PROMPT and inline.cache & CACHE_PROMPT
    # JSON by system text and by prompt_id: the same KV reused, same tokens.
    # The JSON chat renders to the same ids as the binary request: the same tokens come back.
    assert got["json_system"].ids == got["json_prompt_id"].ids == by_id.ids
    assert got["json_system"].cache & CACHE_PROMPT and got["json_prompt_id"].cache & CACHE_PROMPT
    # Another system text: only the blocks it shares with what came before (its first ones,
    # which were stored when the earlier requests were prefilled); the same tokens as inline.
    other = got["json_other"]
    assert other.cache & CACHE_PROMPT
    assert got["unknown"].code == ErrorCode.UNKNOWN_PROMPT
    # In tokens, as vLLM counts: every admitted prompt is queried; by_id, json_system and
    # json_prompt_id reuse all of the registered prompt but its last token, the inline request
    # (sent second) its blocks too: the same ids.
    pinned = len(full) - len(user) - 1
    queried = 4 * len(full) + other.prompt_tokens
    assert metric(metrics, "zerolayer_prefix_cache_queries_total") == queried
    hits = metric(metrics, "zerolayer_prefix_cache_hits_total")
    assert 3 * pinned < hits < queried - 5
    assert metric(metrics, 'zerolayer_prefix_cache_bytes{kind="pinned"}') == sum(
        p["kv_bytes"] for p in listed
    )


def metric(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[-1])
    raise AssertionError(f"{name} not exposed")


@needs_wiring
def test_daemon_refuses_to_start_with_an_invalid_prompt_and_names_it(tmp_path: Path) -> None:
    from benchmarks._support.daemon import Daemon

    config = e2e_config(
        tmp_path,
        '[[prompts]]\nid = 3\nname = "dated"\ntext = "You are a helpful assistant on {date}"\n',
    )
    with pytest.raises(RuntimeError) as err:
        Daemon({"ENGINE__BACKEND": "synthetic"}, config=config)
    assert 'prompt 3 "dated": dynamic variable {date} not allowed in compiled prompt' in str(
        err.value
    )
