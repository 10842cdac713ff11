"""Ollama's API on the HTTP port through the official ``ollama`` client, against one daemon
serving the default model, SmolLM2-135M-Instruct (a real tokenizer, so ``format`` and forced
output run through the grammar): the model listings (version, tags, ps, show), an unknown
model's 404, the key on ``/api/show`` (the listings are keyless), the load request, chat and
generate streamed (NDJSON) and not, ``options`` mapped or refused by name (``num_ctx`` the
request's context), logprobs, ``format``, tools (calls in Ollama's shape, streamed and not, and the
history's calls and results read as the OpenAI door reads them), ``/api/embed`` and
``/api/embeddings`` (the vectors of ``/v1/embeddings``, charged to the key, ``truncate``,
``dimensions`` refused) and model management refused in Ollama's error shape."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import ollama
import openai
import pytest

from benchmarks._support.daemon import Daemon
from tests.support.smollm2 import SLOW_TIMEOUT_S, data_dir_of
from zerolayer.hooks.keys import add_key
from zerolayer.http.ollama import OLLAMA_API_VERSION
from zerolayer.http.routes import version

MODEL = "SmolLM2-135M-Instruct"
HIDDEN = 576  # SmolLM2-135M's hidden size
pytestmark = pytest.mark.timeout(SLOW_TIMEOUT_S)  # a real model on a shared machine


def _call(url: str, body: dict | None = None, key: str | None = None) -> tuple[int, dict]:
    data = None if body is None else json.dumps(body).encode()
    headers = {"content-type": "application/json"}
    if key is not None:
        headers["authorization"] = f"Bearer {key}"
    req = urllib.request.Request(url, data=data, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=SLOW_TIMEOUT_S) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


@pytest.fixture(scope="module")
def keys(tmp_path_factory) -> tuple[Path, str, str]:
    path = tmp_path_factory.mktemp("keys") / "keys.toml"
    free = add_key(path, "free")
    tight = add_key(path, "tight", tpm=10)  # CAT's tokens once a minute, not twice
    return path, free, tight


@pytest.fixture(scope="module")
def daemon(smollm2_dir: Path, keys):
    env = {
        "ENGINE__BACKEND": "cpu",
        "MODEL__DATA_DIR": data_dir_of(smollm2_dir),
        "ENGINE__MAX_BATCH_SIZE": "4",
        "ENGINE__MAX_CONTEXT": "1024",
        "CACHE__ENABLED": "false",
        "AUTH__ENABLED": "true",
        "AUTH__KEYS_FILE": str(keys[0]),
    }
    with Daemon(env) as d:
        yield d


def _client(daemon: Daemon, key: str) -> ollama.Client:
    return ollama.Client(host=daemon.http_url, headers={"Authorization": f"Bearer {key}"})


@pytest.fixture(scope="module")
def client(daemon, keys):
    return _client(daemon, keys[1])


def test_version_and_tags_need_no_key(daemon):
    assert _call(daemon.http_url + "/api/version") == (
        200,
        {"version": OLLAMA_API_VERSION, "zerolayer": version()},
    )
    status, tags = _call(daemon.http_url + "/api/tags")
    assert status == 200 and [m["name"] for m in tags["models"]] == [MODEL + ":latest"]


def test_list_ps_and_show_through_the_client(client):
    (listed,) = client.list().models
    assert listed.model == MODEL + ":latest"
    (running,) = client.ps().models
    assert running.model == MODEL + ":latest" and running.size_vram == 0
    for name in (MODEL, MODEL + ":latest"):
        shown = client.show(name)
        assert shown.modelinfo is not None and shown.modelinfo["general.name"] == MODEL
        assert shown.modelinfo["general.context_length"] == 1024
        assert shown.capabilities == ["completion", "tools", "embedding"]


def test_an_unknown_model_is_404_naming_it(client):
    with pytest.raises(ollama.ResponseError) as err:
        client.show("llama3:8b")
    assert err.value.status_code == 404 and err.value.error == "model 'llama3:8b' not found"


def test_show_needs_the_key_and_answers_in_ollamas_shape(daemon):
    status, body = _call(daemon.http_url + "/api/show", {"model": MODEL})
    assert status == 401 and isinstance(body["error"], str)


def test_the_load_request_answers_at_once(client):
    """No messages / no prompt: Ollama's load request, streamed or not, keep_alive accepted."""
    chat = client.chat(MODEL)
    assert chat.done and chat.done_reason == "load" and chat.message.content == ""
    assert chat.eval_count is None  # nothing was generated
    (line,) = list(client.generate(MODEL, stream=True, keep_alive=0))
    assert line.done and line.done_reason == "load" and line.response == ""
    with pytest.raises(ollama.ResponseError) as err:
        client.generate("llama3")
    assert err.value.status_code == 404


HI = [{"role": "user", "content": "Hi"}]
GREEDY = {"temperature": 0, "seed": 1, "num_predict": 4}


def test_chat_streamed_equals_not_streamed_and_num_predict_ends_in_length(client):
    whole = client.chat(MODEL, HI, stream=False, options=GREEDY, keep_alive="5m")
    assert whole.done and whole.done_reason == "length" and whole.eval_count == 4
    assert whole.total_duration > whole.eval_duration > 0 and whole.prompt_eval_duration > 0
    assert whole.message.role == "assistant" and whole.message.content
    parts = list(client.chat(MODEL, HI, stream=True, options=GREEDY))
    assert [p.done for p in parts] == [False] * (len(parts) - 1) + [True]
    assert "".join(p.message.content or "" for p in parts) == whole.message.content
    assert parts[-1].done_reason == "length" and parts[-1].eval_count == 4
    assert parts[-1].total_duration > 0 and parts[0].total_duration is None


def test_generate_chat_templated_and_raw(client):
    templated = client.generate(MODEL, "Hi", options=GREEDY)
    raw = client.generate(MODEL, "Hi", raw=True, options=GREEDY)
    assert templated.done_reason == raw.done_reason == "length"
    assert templated.prompt_eval_count > raw.prompt_eval_count  # the template's tokens
    parts = list(client.generate(MODEL, "Hi", raw=True, stream=True, options=GREEDY))
    assert "".join(p.response for p in parts) == raw.response


def test_logprobs_streamed_and_not(client):
    """Each token's logprob and its top alternatives, in Ollama's shape: greedy, the token is
    the most likely one; streamed, the lines' lists join to the whole answer's."""
    ask = {"logprobs": True, "top_logprobs": 2, "options": GREEDY}
    whole = client.chat(MODEL, HI, **ask)
    assert len(whole.logprobs) == whole.eval_count == 4
    assert "".join(lp.token for lp in whole.logprobs) == whole.message.content
    for lp in whole.logprobs:
        assert len(lp.top_logprobs) == 2 and lp.top_logprobs[0].token == lp.token
        assert lp.top_logprobs[0].logprob == lp.logprob >= lp.top_logprobs[1].logprob
    lines = list(client.chat(MODEL, HI, stream=True, **ask))
    streamed = [lp for line in lines for lp in line.logprobs or ()]
    assert [(lp.token, lp.logprob) for lp in streamed] == [
        (lp.token, lp.logprob) for lp in whole.logprobs
    ]
    raw = client.generate(MODEL, "Hi", raw=True, logprobs=True, options=GREEDY)
    assert len(raw.logprobs) == 4 and "".join(lp.token for lp in raw.logprobs) == raw.response


@pytest.mark.parametrize(
    ("options", "field"),
    [
        ({"mirostat": 2}, "options.mirostat"),
        ({"bogus": 1}, "options.bogus"),
        ({"num_predict": 0}, "options.num_predict"),  # the OpenAI rule, named as Ollama's
        ({"num_ctx": "big"}, "options.num_ctx"),
    ],
)
def test_options_we_cannot_honour_are_400_naming_them(client, options, field):
    with pytest.raises(ollama.ResponseError) as err:
        client.chat(MODEL, HI, stream=False, options=options)
    assert err.value.status_code == 400 and err.value.error.startswith(field)


def test_ignored_and_no_op_options_are_accepted_and_num_ctx_bounds_the_request(client):
    options = {**GREEDY, "num_ctx": 4096, "mirostat": 0, "typical_p": 1, "num_thread": 2}
    assert client.chat(MODEL, HI, stream=False, options=options).eval_count == 4
    # num_ctx above the engine's context is served within it; below the prompt it refuses
    with pytest.raises(ollama.ResponseError) as err:
        client.chat(MODEL, HI, stream=False, options={**GREEDY, "num_ctx": 8})
    assert err.value.status_code == 400 and "request context 8" in err.value.error


def test_format_runs_through_the_grammar(client):
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    answer = client.chat(MODEL, HI, format=schema, options={"temperature": 0, "num_predict": 16})
    assert isinstance(json.loads(answer.message.content)["ok"], bool)
    with pytest.raises(ollama.ResponseError) as err:
        client.chat(MODEL, HI, format={"type": "object", "properties": 3})
    assert err.value.status_code == 400 and err.value.error.startswith("format")


WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}
ASK = [{"role": "user", "content": "Weather in Oslo?"}]
# The model's answer pinned by the grammar to one call in the generic JSON form, which the
# tool path parses as a call (a 135M model does not call tools reliably by itself).
PINNED = {
    "type": "object",
    "properties": {
        "name": {"const": "get_weather"},
        "arguments": {
            "type": "object",
            "properties": {"city": {"const": "Oslo"}},
            "required": ["city"],
        },
    },
    "required": ["name", "arguments"],
}


def test_tool_calls_in_ollamas_shape_streamed_and_not(client):
    ask = {"tools": [WEATHER], "format": PINNED, "options": {"temperature": 0, "num_predict": 40}}
    whole = client.chat(MODEL, ASK, **ask)
    assert whole.done_reason == "stop" and whole.message.content == ""
    (call,) = whole.message.tool_calls
    assert (call.function.name, call.function.arguments) == ("get_weather", {"city": "Oslo"})
    lines = list(client.chat(MODEL, ASK, stream=True, **ask))
    streamed = [c for line in lines for c in line.message.tool_calls or ()]
    assert [(c.function.name, c.function.arguments) for c in streamed] == [
        ("get_weather", {"city": "Oslo"})
    ]
    assert lines[-1].done and lines[-1].done_reason == "stop"
    assert "".join(line.message.content for line in lines) == ""


def _tokens(daemon: Daemon, key: str, text: str) -> int:
    status, counted = _call(
        daemon.http_url + "/tokenize", {"prompt": text, "add_special_tokens": False}, key
    )
    assert status == 200
    return counted["count"]


def test_a_list_of_calls_cut_by_num_predict_keeps_the_calls_that_closed(daemon, client, keys):
    """The model's own JSON form (Ollama has no forced choice), pinned by ``format`` and cut
    inside its second call: the first is returned, streamed or not (issue 39)."""
    first = {"name": "get_weather", "arguments": {"city": "Oslo"}}
    second = {"name": "get_weather", "arguments": {"city": "Rio de Janeiro, Brazil, South America"}}
    whole = json.dumps([first, second])
    head = _tokens(daemon, keys[1], json.dumps([first])[:-1] + ", ")
    cut = (head + _tokens(daemon, keys[1], whole)) // 2  # inside the second call
    ask = {"tools": [WEATHER], "format": {"const": [first, second]},
           "options": {"temperature": 0, "num_predict": cut}}  # fmt: skip
    answer = client.chat(MODEL, ASK, **ask)
    assert answer.done_reason == "length" and answer.message.content == ""
    (call,) = answer.message.tool_calls
    assert (call.function.name, call.function.arguments) == ("get_weather", {"city": "Oslo"})
    lines = list(client.chat(MODEL, ASK, stream=True, **ask))
    streamed = [c for line in lines for c in line.message.tool_calls or ()]
    assert [(c.function.name, c.function.arguments) for c in streamed] == [
        ("get_weather", {"city": "Oslo"})
    ]
    assert lines[-1].done_reason == "length"


def test_tool_results_are_read_as_the_openai_door_reads_them(daemon, client, keys):
    """The history's call and its result (``tool_name``, no id): the prompt is the one the
    OpenAI door makes of the same conversation (``/tokenize`` counts it)."""
    history = [
        *ASK,
        {"role": "assistant", "content": "", "tool_calls": [
            {"function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}]},
        {"role": "tool", "content": "11 degrees", "tool_name": "get_weather"},
    ]  # fmt: skip
    answer = client.chat(MODEL, history, tools=[WEATHER], options={**GREEDY, "num_predict": 1})
    assert answer.eval_count == 1
    openai_history = [
        *ASK,
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
        {"role": "tool", "content": "11 degrees", "tool_call_id": "call_1"},
    ]  # fmt: skip
    status, counted = _call(
        daemon.http_url + "/tokenize",
        {"messages": openai_history, "tools": [WEATHER]},
        keys[1],
    )
    assert status == 200 and counted["count"] == answer.prompt_eval_count


CAT, CAT2 = "The cat sat on the mat.", "A cat was sitting on the mat."


def test_embed_both_shapes_are_the_vectors_of_v1_embeddings(daemon, client, keys):
    both = client.embed(MODEL, [CAT, CAT2])
    vectors = np.array(both.embeddings)
    assert vectors.shape == (2, HIDDEN) and both.prompt_eval_count > 2
    assert both.total_duration > 0 and both.eval_duration is None
    np.testing.assert_allclose(np.linalg.norm(vectors, axis=1), 1.0, atol=1e-4)
    one = client.embed(MODEL, CAT, keep_alive="5m")
    assert one.prompt_eval_count < both.prompt_eval_count
    np.testing.assert_allclose(one.embeddings[0], vectors[0], atol=1e-4)
    np.testing.assert_allclose(client.embeddings(MODEL, CAT).embedding, vectors[0], atol=1e-4)
    oai = openai.OpenAI(base_url=daemon.http_url + "/v1", api_key=keys[1], max_retries=0)
    done = oai.embeddings.create(model=MODEL, input=CAT, encoding_format="float")
    np.testing.assert_allclose(done.data[0].embedding, vectors[0], atol=1e-4)
    assert client.embed(MODEL, []).embeddings == []  # as Ollama: nothing to embed
    assert client.embeddings(MODEL, "").embedding == []


def test_embed_truncates_unless_told_not_to_and_refuses_dimensions(client):
    cut = client.embed(MODEL, CAT * 4, options={"num_ctx": 6})
    assert cut.prompt_eval_count == 6 and len(cut.embeddings[0]) == HIDDEN
    with pytest.raises(ollama.ResponseError) as err:
        client.embed(MODEL, CAT * 4, truncate=False, options={"num_ctx": 6})
    assert err.value.status_code == 400 and err.value.error.startswith("input")
    with pytest.raises(ollama.ResponseError) as err:
        client.embeddings(MODEL, CAT * 4, options={"num_ctx": 6})  # the older form: no cut
    assert err.value.status_code == 400 and err.value.error.startswith("prompt")
    with pytest.raises(ollama.ResponseError) as err:
        client.embed(MODEL, CAT, dimensions=64)
    assert err.value.status_code == 400 and err.value.error.startswith("dimensions")


def test_embed_is_charged_to_the_key(daemon, keys):
    tight = _client(daemon, keys[2])  # 10 tokens a minute
    assert tight.embed(MODEL, CAT).prompt_eval_count == 7
    for embed in (lambda: tight.embed(MODEL, CAT), lambda: tight.embeddings(MODEL, CAT)):
        with pytest.raises(ollama.ResponseError) as err:
            embed()
        assert err.value.status_code == 429
    with pytest.raises(ollama.ResponseError) as err:
        _client(daemon, "zl_wrong").embed(MODEL, CAT)
    assert err.value.status_code == 401


def test_model_management_is_refused_saying_why(client):
    assert client.pull(MODEL).status == "success"  # the served model is there
    for manage in (
        lambda: client.pull("llama3"),
        lambda: client.delete(MODEL),
        lambda: client.copy(MODEL, "mine"),
        lambda: client.create("mine", from_=MODEL),
        lambda: client.push(MODEL),
    ):
        with pytest.raises(ollama.ResponseError) as err:
            manage()
        assert err.value.status_code == 403 and "serves one model" in err.value.error
