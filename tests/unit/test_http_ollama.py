"""Ollama's API read into ours (zerolayer.http.ollama), without a daemon: which bodies name the
served model, options and fields by their Ollama names, the load request, the history's tool
calls and results, calls in Ollama's shape (streamed and not), embed requests, model
management."""

from __future__ import annotations

import json

import numpy as np
import pytest

from zerolayer.codes import FinishReason, Refusal
from zerolayer.engine.step import Logprobs
from zerolayer.http.errors import HttpError
from zerolayer.http.logprobs import TokenLogprobs, TokenStrings
from zerolayer.http.ollama import (
    OllamaEmbedReply,
    OllamaModel,
    OllamaReply,
    parse_chat,
    parse_embed,
    parse_embeddings,
    parse_generate,
)
from zerolayer.http.reply import Ending
from zerolayer.tokenizer import ByteTokenizer

MODEL = OllamaModel("tiny", 2048, "0.1.0")


@pytest.mark.parametrize(
    ("body", "status", "param"),
    [
        (b"not json", 400, None),
        (b"[1]", 400, None),
        (b"{}", 400, "model"),
        (b'{"model": 3}', 400, "model"),
        (b'{"model": "other"}', 404, "model"),
        (b'{"model": "tiny:7b"}', 404, "model"),
    ],
)
def test_a_body_not_naming_the_served_model_is_refused(body, status, param) -> None:
    with pytest.raises(HttpError) as err:
        MODEL.show(body)
    assert (err.value.status, err.value.param) == (status, param)


@pytest.mark.parametrize(
    "body", [b'{"model": "tiny"}', b'{"model": "tiny:latest"}', b'{"name": "tiny"}']
)
def test_the_served_model_with_or_without_its_tag(body) -> None:
    shown = json.loads(MODEL.show(body))
    assert shown["model_info"] == {"general.name": "tiny", "general.context_length": 2048}
    assert shown["capabilities"] == ["completion", "tools", "embedding"]


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"format": "yaml"}, "format"),
        ({"options": {"mirostat": 1}}, "options.mirostat"),
        ({"options": {"typo": 1}}, "options.typo"),
        ({"options": []}, "options"),
        ({"think": True}, "think"),
        ({"stream": "no"}, "stream"),
        ({"images": ["aGk="]}, "images"),
        ({"options": {"num_predict": 0}}, "options.num_predict"),  # the OpenAI rule, renamed
        ({"options": {"repeat_penalty": -1}}, "options.repeat_penalty"),
    ],
)
def test_fields_refused_by_their_ollama_names(body, param) -> None:
    request = {"model": "tiny", "prompt": "Hi", "stream": False, **body}
    with pytest.raises(HttpError) as err:
        parse_generate(json.dumps(request).encode(), MODEL)
    assert err.value.status == 400 and err.value.param == param
    assert err.value.message.startswith(param)


def test_options_map_onto_our_fields_with_ollamas_defaults() -> None:
    request = {"model": "tiny", "prompt": "Hi", "raw": True, "options": {"num_predict": -1}}
    sampling = parse_generate(json.dumps(request).encode(), MODEL).req.sampling
    assert (sampling.temperature, sampling.top_p, sampling.top_k) == (0.8, 0.9, 40)
    request["options"] = {"temperature": 0, "seed": 3, "num_predict": 5, "repeat_penalty": 1.1}
    reply = parse_generate(json.dumps(request).encode(), MODEL)
    assert reply.req.sampling.temperature == 0 and reply.req.sampling.seed == 3
    assert reply.req.max_tokens == 5 and reply.req.sampling.repetition_penalty == 1.1


def test_seed_minus_one_is_random_and_load_time_options_are_ignored() -> None:
    request = {"model": "tiny", "prompt": "Hi", "raw": True}
    request["options"] = {"seed": -1, "f16_kv": True, "mirostat_eta": 0.1, "draft_num_predict": 4}
    reply = parse_generate(json.dumps(request).encode(), MODEL)
    assert isinstance(reply, OllamaReply) and reply.req.sampling.seed is None


@pytest.mark.parametrize(("num_ctx", "context"), [(512, 512), (0, None), (99999, 99999)])
def test_num_ctx_is_the_requests_own_context(num_ctx, context) -> None:
    """Its bound with the engine's context is the input processor's (test_inputs.py)."""
    request = {"model": "tiny", "prompt": "Hi", "options": {"num_ctx": num_ctx}}
    reply = parse_generate(json.dumps(request).encode(), MODEL)
    assert isinstance(reply, OllamaReply) and reply.req.context == context


@pytest.mark.parametrize(
    ("parse", "body", "key"),
    [
        (parse_chat, {"model": "tiny"}, "message"),
        (parse_chat, {"model": "tiny:latest", "messages": [], "keep_alive": 0}, "message"),
        (parse_generate, {"model": "tiny", "prompt": "", "stream": False}, "response"),
        (parse_generate, {"model": "tiny", "keep_alive": "5m"}, "response"),
    ],
)
def test_nothing_to_generate_is_the_load_request(parse, body, key) -> None:
    answer = parse(json.dumps(body).encode(), MODEL)
    assert isinstance(answer, bytes)
    loaded = json.loads(answer)
    assert (loaded["done"], loaded["done_reason"], loaded["model"]) == (True, "load", "tiny")
    assert loaded[key] in ("", {"role": "assistant", "content": ""})


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"keep_alive": [1]}, "keep_alive"),
        ({"keep_alive": True}, "keep_alive"),
        ({"tools": {"name": "x"}}, "tools"),
        ({"tools": [{"type": "function", "function": {"name": ""}}]}, "tools[0].function.name"),
        ({"unknown": 1}, "unknown"),
        (
            {"messages": [{"role": "user", "content": "Hi", "images": ["aGk="]}]},
            "messages[0].images",
        ),
        ({"messages": [{"role": "user", "content": "Hi", "extra": 1}]}, "messages[0].extra"),
        ({"messages": [{"role": "robot", "content": "Hi"}]}, "messages[0].role"),
    ],
)
def test_chat_fields_refused_by_their_ollama_names(body, param) -> None:
    request = {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], **body}
    with pytest.raises((HttpError, Refusal)) as err:
        parse_chat(json.dumps(request).encode(), MODEL)
    refused = err.value
    name = refused.param if isinstance(refused, HttpError) else refused.field
    assert name == param


def test_the_historys_calls_and_results_read_as_openais() -> None:
    """Ollama's calls carry no id (or their own); a result names its tool, or its call."""
    history = [
        {"role": "User", "content": "Weather in Oslo and Rome?"},
        {"role": "assistant", "tool_calls": [
            {"function": {"index": 0, "name": "weather", "arguments": {"city": "Oslo"}}},
            {"id": "c2", "function": {"name": "weather", "arguments": {"city": "Rome"}}},
            {"function": {"name": "time", "arguments": {}}}]},
        {"role": "tool", "content": "noon", "tool_name": "time"},
        {"role": "tool", "content": "11C"},
        {"role": "tool", "content": "20C", "tool_call_id": "c2", "tool_name": "weather"},
    ]  # fmt: skip
    weather = {"type": "function", "function": {"name": "weather", "parameters": {}}}
    body = {"model": "tiny", "messages": history, "tools": [weather], "stream": False}
    reply = parse_chat(json.dumps(body).encode(), MODEL)
    assert isinstance(reply, OllamaReply) and reply.tools is not None
    messages = reply.req.messages
    assert messages is not None and messages[0]["role"] == "user"
    calls = messages[1]["tool_calls"]
    assert [c["id"] for c in calls] == ["call_1_0", "c2", "call_1_2"]
    assert calls[0]["function"] == {"name": "weather", "arguments": {"city": "Oslo"}}
    results = [(m["tool_call_id"], m.get("name")) for m in messages[2:]]
    assert results == [("call_1_2", "time"), ("call_1_0", None), ("c2", "weather")]


def _calls_reply() -> OllamaReply:
    weather = {"type": "function", "function": {"name": "weather", "parameters": {}}}
    body = {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "tools": [weather]}
    reply = parse_chat(json.dumps(body).encode(), MODEL)
    assert isinstance(reply, OllamaReply)
    return reply


CALLS = '<tool_call>{"name": "weather", "arguments": {"city": "Oslo"}}</tool_call>'


def test_a_call_streamed_is_one_line_with_its_arguments_as_an_object() -> None:
    reply = _calls_reply()
    out = bytearray()
    for piece in ("Sure. ", CALLS[:20], CALLS[20:], '<tool_call>{"name": "weather", "argu'):
        reply.write(out, 0, piece, None)
    reply.finish(0, Ending(int(FinishReason.MAX_TOKENS), 5, 30))
    reply.end(out, 0)
    lines = [json.loads(line) for line in out.decode().splitlines()]
    assert [line["message"]["content"] for line in lines] == ["Sure. ", "", ""]
    call = {"id": lines[1]["message"]["tool_calls"][0]["id"],
            "function": {"index": 0, "name": "weather", "arguments": {"city": "Oslo"}}}  # fmt: skip
    assert lines[1]["message"]["tool_calls"] == [call]  # the cut second call is no call
    assert lines[2]["done"] and lines[2]["done_reason"] == "length"


def test_calls_not_streamed_and_durations_in_nanoseconds() -> None:
    reply = _calls_reply()
    reply.collect(0, "Sure. " + CALLS, None)
    reply.finish(0, Ending(int(FinishReason.EOS), 5, 30, timings=(0.5, 1.5, 4.0)))
    done = json.loads(reply.body())
    assert (done["total_duration"], done["prompt_eval_duration"], done["eval_duration"]) == (
        4_000_000_000,
        1_000_000_000,
        2_500_000_000,
    )
    (call,) = done["message"]["tool_calls"]
    assert call["function"] == {"index": 0, "name": "weather", "arguments": {"city": "Oslo"}}
    assert done["message"]["content"] == "Sure." and done["done_reason"] == "stop"


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"input": 3}, "input"),
        ({"input": ["a", ""]}, "input[1]"),
        ({"input": "a", "truncate": "yes"}, "truncate"),
        ({"input": "a", "dimensions": 8}, "dimensions"),
        ({"input": "a", "options": {"typo": 1}}, "options.typo"),
        ({"input": "a", "prompt": "b"}, "prompt"),
    ],
)
def test_embed_fields_refused_by_name(body, param) -> None:
    with pytest.raises((HttpError, Refusal)) as err:
        parse_embed(json.dumps({"model": "tiny", **body}).encode(), MODEL, 64)
    refused = err.value
    assert (refused.param if isinstance(refused, HttpError) else refused.field) == param


def test_embed_requests() -> None:
    assert json.loads(parse_embed(b'{"model": "tiny", "input": []}', MODEL, 64)) == {
        "model": "tiny",
        "embeddings": [],
    }
    reply = parse_embed(b'{"model": "tiny", "input": ["a", "b"], "dimensions": 64}', MODEL, 64)
    assert isinstance(reply, OllamaEmbedReply)
    assert reply.req.inputs == ["a", "b"] and reply.req.truncate and reply.req.max_tokens == 0
    legacy = parse_embeddings(b'{"model": "tiny", "prompt": "a"}', MODEL)
    assert isinstance(legacy, OllamaEmbedReply) and not legacy.req.truncate
    assert legacy.named(HttpError(400, "input: too long", param="input")).param == "prompt"
    assert json.loads(parse_embeddings(b'{"model": "tiny"}', MODEL)) == {"embedding": []}


def test_model_management_is_refused_but_for_pulling_the_served_model() -> None:
    assert json.loads(MODEL.manage(b'{"model": "tiny:latest"}', "/api/pull")) == {
        "status": "success"
    }
    for body, path in [(b'{"model": "x"}', "/api/pull"), (b'{"model": "tiny"}', "/api/delete")]:
        with pytest.raises(HttpError) as err:
            MODEL.manage(body, path)
        assert err.value.status == 403 and err.value.message.startswith(path)


STRINGS = TokenStrings(ByteTokenizer())


def _lp(token: int, top: list[int]) -> TokenLogprobs:
    values = np.linspace(-0.5, -2.0, len(top), dtype=np.float32)
    return TokenLogprobs(token, Logprobs(-0.5, np.array(top, np.int32), values))


def test_logprobs_map_onto_ours_and_come_back_per_line_and_whole() -> None:
    body = {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "stream": True,
            "logprobs": True, "top_logprobs": 2}  # fmt: skip
    reply = parse_chat(json.dumps(body).encode(), MODEL, STRINGS)
    assert isinstance(reply, OllamaReply) and not reply.plain
    assert (reply.req.sampling.logprobs, reply.req.sampling.top_logprobs) == (True, 2)
    out = bytearray()
    reply.write(out, 0, "h", _lp(ord("h"), [ord("h"), ord("a")]))
    reply.write(out, 0, "", _lp(0xC3, [0xC3]))  # the first byte of a character: no text yet
    line, held = (json.loads(x) for x in out.decode().splitlines())
    assert line["message"]["content"] == "h" and line["logprobs"] == [
        {"token": "h", "logprob": -0.5, "bytes": [104], "top_logprobs": [
            {"token": "h", "logprob": -0.5, "bytes": [104]},
            {"token": "a", "logprob": -2.0, "bytes": [97]}]},
    ]  # fmt: skip
    assert held["message"]["content"] == "" and held["logprobs"][0]["bytes"] == [0xC3]
    body.update(stream=False, top_logprobs=None)
    whole = parse_chat(json.dumps(body).encode(), MODEL, STRINGS)
    assert isinstance(whole, OllamaReply) and whole.req.sampling.top_logprobs == 0
    whole.collect(0, "h", _lp(ord("h"), []))
    whole.finish(0, Ending(int(FinishReason.EOS), 2, 1))
    done = json.loads(whole.body())
    assert done["logprobs"] == [{"token": "h", "logprob": -0.5, "bytes": [104], "top_logprobs": []}]
    # top_logprobs applies only with logprobs (as Ollama reads it); raw: the Completions form
    quiet = parse_chat(json.dumps({**body, "logprobs": False, "top_logprobs": 3}).encode(), MODEL)
    assert isinstance(quiet, OllamaReply) and not quiet.req.sampling.logprobs
    raw = {"model": "tiny", "prompt": "Hi", "raw": True, "logprobs": True, "top_logprobs": 4}
    generated = parse_generate(json.dumps(raw).encode(), MODEL, STRINGS)
    assert isinstance(generated, OllamaReply) and generated.req.sampling.top_logprobs == 4
    with pytest.raises(HttpError) as err:
        parse_chat(json.dumps({**body, "logprobs": True, "top_logprobs": 21}).encode(), MODEL)
    assert err.value.param == "top_logprobs"
