"""vLLM's /tokenize and /detokenize against a daemon serving the default model,
SmolLM2-135M-Instruct, with API keys on: the ids of ``messages`` are the ones the chat endpoint
prefills (its ``usage.prompt_tokens``), a prompt's are the completions endpoint's, a round trip
gives the text back, and each refusal is OpenAI's 400 naming the field (or 401 without a key)."""

from __future__ import annotations

from pathlib import Path

import httpx
import openai
import pytest

from benchmarks._support.daemon import Daemon
from tests.support.smollm2 import SLOW_TIMEOUT_S, data_dir_of
from zerolayer.hooks.keys import add_key

MODEL = "SmolLM2-135M-Instruct"
pytestmark = pytest.mark.timeout(SLOW_TIMEOUT_S)
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}
MESSAGES = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "What is the weather in Paris?"},
    {"role": "assistant", "content": "Let me look."},
    {"role": "system", "content": "Use the tool."},
    {"role": "user", "content": "Go on."},
]


@pytest.fixture(scope="module")
def daemon(smollm2_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    keys = tmp_path_factory.mktemp("keys") / "keys.toml"
    key = add_key(keys, "tenant")
    env = {
        "ENGINE__BACKEND": "cpu",
        "MODEL__DATA_DIR": data_dir_of(smollm2_dir),
        "ENGINE__MAX_CONTEXT": "1024",
        "CACHE__ENABLED": "false",
        "AUTH__ENABLED": "true",
        "AUTH__KEYS_FILE": str(keys),
    }
    with Daemon(env) as d:
        yield d, key


def post(daemon, path: str, body: dict, key: str | None = "") -> httpx.Response:  # noqa: ANN001
    d, good = daemon
    headers = {} if key is None else {"authorization": f"Bearer {key or good}"}
    return httpx.post(d.http_url + path, json=body, headers=headers, timeout=60)


def test_messages_are_the_ids_chat_prefills(daemon) -> None:
    d, key = daemon
    c = openai.OpenAI(base_url=d.http_url + "/v1", api_key=key, max_retries=0)
    for tools in ([], [WEATHER]):
        extra = {"tools": tools} if tools else {}
        r = post(daemon, "/tokenize", {"model": MODEL, "messages": MESSAGES, **extra})
        assert r.status_code == 200, r.text
        got = r.json()
        assert got["max_model_len"] == 1024 and got["token_strs"] is None
        chat = c.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=1, **extra)
        assert got["count"] == len(got["tokens"]) == chat.usage.prompt_tokens
    with_tools = post(daemon, "/tokenize", {"messages": MESSAGES, "tools": [WEATHER]}).json()
    plain = post(daemon, "/tokenize", {"messages": MESSAGES}).json()
    assert with_tools["count"] > plain["count"]  # the tool definitions are in the prompt


def test_prompt_ids_round_trip_and_token_strings(daemon) -> None:
    d, key = daemon
    text = "The cat sat on the mat."
    r = post(daemon, "/tokenize", {"prompt": text, "return_token_strs": True}).json()
    assert "".join(r["token_strs"]) == text and r["count"] == len(r["tokens"])
    bare = post(daemon, "/tokenize", {"prompt": text, "add_special_tokens": False}).json()
    assert bare["tokens"] == r["tokens"]  # SmolLM2 adds no BOS to a prompt
    c = openai.OpenAI(base_url=d.http_url + "/v1", api_key=key, max_retries=0)
    done = c.completions.create(model=MODEL, prompt=text, max_tokens=1)
    assert done.usage.prompt_tokens == r["count"]
    back = post(daemon, "/detokenize", {"model": MODEL, "tokens": r["tokens"]})
    assert back.status_code == 200 and back.json() == {"prompt": text}


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/detokenize", {"tokens": [49152]}, "tokens"),
        ("/detokenize", {"tokens": "x"}, "tokens"),
        ("/tokenize", {}, "prompt"),
        (
            "/tokenize",
            {"messages": MESSAGES, "add_generation_prompt": False},
            "add_generation_prompt",
        ),
        (
            "/tokenize",
            {"messages": MESSAGES, "continue_final_message": True},
            "continue_final_message",
        ),
        ("/tokenize", {"messages": MESSAGES, "chat_template": "{{ x }}"}, "chat_template"),
        ("/tokenize", {"prompt": "x", "messages": MESSAGES}, "prompt"),
    ],
)  # fmt: skip
def test_refusals_name_the_field(daemon, path: str, body: dict, param: str) -> None:
    r = post(daemon, path, body)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_a_key_is_required(daemon) -> None:
    for path in ("/tokenize", "/detokenize"):
        r = post(daemon, path, {"prompt": "x", "tokens": [1]}, key=None)
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    r = post(daemon, "/tokenize", {"model": "other", "prompt": "x"})
    assert r.status_code == 404 and r.json()["error"]["param"] == "model"
