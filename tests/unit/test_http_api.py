"""The OpenAI and Anthropic translations: JSON → Request (defaults, refusals naming the field),
the replies' bytes (checked against the official SDKs' own types), and the error table."""

from __future__ import annotations

import json

import anthropic.types as at
import openai.types as ot
import openai.types.chat as oc
import pytest

from gateway.codes import Refusal
from gateway.http import anthropic as an
from gateway.http import openai as oa
from gateway.http.errors import (
    ANTHROPIC,
    OPENAI,
    STATUS,
    HttpError,
    error_body,
    http_error,
    status_for,
)
from gateway.http.reply import Ending
from gateway.protocol import ErrorCode, FinishReason
from tests.support.rawhttp import sse_events

MODEL = "tiny"
USER = [{"role": "user", "content": "hi"}]


def chat(**fields) -> oa.ChatReply:
    return oa.parse_chat(json.dumps({"model": MODEL, "messages": USER, **fields}).encode(), MODEL)


def messages(**fields) -> an.MessagesReply:
    body = {"model": MODEL, "max_tokens": 8, "messages": USER, **fields}
    return an.parse_messages(json.dumps(body).encode(), MODEL)


def refused(fn, *args) -> HttpError:
    """The HTTP answer the door sends for a refused body (a Refusal goes through the table)."""
    with pytest.raises((HttpError, Refusal)) as info:
        fn(*args)
    err = info.value
    return http_error(err) if isinstance(err, Refusal) else err


# ----------------------------------------------------------------------------------- OpenAI


def test_chat_defaults_follow_openai():
    r = chat()
    req = r.req
    assert (req.temperature, req.top_p, req.top_k, req.seed) == (1.0, 1.0, 0, None)
    assert req.max_tokens is None  # what fits beside the prompt, found by the path
    assert req.want_text and req.messages == USER and req.system is None
    assert not r.stream and not r.include_usage


def test_chat_fields():
    r = chat(
        messages=[
            {"role": "system", "content": "be brief"},
            {"role": "developer", "content": [{"type": "text", "text": "really"}]},
            {
                "role": "user",
                "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
            },
            {"role": "assistant", "content": "ok"},
            {"role": "user", "content": "go", "name": None},
        ],
        max_completion_tokens=7,
        temperature=0.2,
        top_p=0.5,
        seed=-1,
        stop=["\n", "END"],
        stream=True,
        stream_options={"include_usage": True},
        n=1,
        user="someone",
        top_k=-1,
        ignore_eos=True,
        prompt_id=3,
        logprobs=False,
        tools=None,
    )
    req = r.req
    assert req.system == "be brief\nreally"
    assert req.messages == [
        {"role": "user", "content": "a\nb"},
        {"role": "assistant", "content": "ok"},
        {"role": "user", "content": "go"},
    ]
    assert req.max_tokens == 7
    assert (req.temperature, req.top_p, req.top_k) == (0.2, 0.5, 0)
    assert req.seed == 2**64 - 1
    assert req.stop_sequences == ("\n", "END")
    assert req.ignore_eos and req.prompt_id == 3
    assert r.stream and r.include_usage
    assert chat(stop="x").req.stop_sequences == ("x",)
    assert chat(max_tokens=4).req.max_tokens == 4


@pytest.mark.parametrize(
    "fields, param",
    [
        ({"n": 2}, "n"),
        ({"logprobs": True}, "logprobs"),
        ({"top_logprobs": 2}, "top_logprobs"),
        ({"tools": [{"type": "function"}]}, "tools"),
        ({"tool_choice": "auto"}, "tool_choice"),
        ({"response_format": {"type": "json_object"}}, "response_format"),
        ({"frequency_penalty": 0.5}, "frequency_penalty"),
        ({"logit_bias": {"1": 5}}, "logit_bias"),
        ({"functions": []}, "functions"),
        ({"audio": {}}, "audio"),
        ({"temperature": "hot"}, "temperature"),
        ({"temperature": 2.5}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": True}, "max_tokens"),
        ({"max_tokens": 3, "max_completion_tokens": 4}, "max_tokens"),
        ({"seed": 1.5}, "seed"),
        ({"stop": [""]}, "stop"),
        ({"stop": 3}, "stop"),
        ({"stream": "yes"}, "stream"),
        ({"stream_options": {"include_usage": True}}, "stream_options"),
        ({"stream": True, "stream_options": {"continuous": True}}, "stream_options.continuous"),
        ({"messages": []}, "messages"),
        ({"messages": "hi"}, "messages"),
        ({"messages": [{"role": "tool", "content": "x"}]}, "messages[0].role"),
        ({"messages": [{"role": "user"}]}, "messages[0].content"),
        ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
        ({"messages": [{"role": "user", "content": "x", "name": "bob"}]}, "messages[0].name"),
        (
            {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
            "messages[0].content[0]",
        ),
        ({"messages": [USER[0], {"role": "system", "content": "late"}]}, "messages[1]"),
        ({"messages": [{"role": "system", "content": "only"}]}, "messages"),
        ({"messages": [{"role": "user", "content": "\ud800"}]}, "messages[0].content"),
    ],
)
def test_chat_refusals_name_the_field(fields, param):
    err = refused(lambda: chat(**fields))
    assert err.status == 400
    assert err.param == param, err.message


def test_unknown_model_is_404_and_bad_bodies_are_400():
    err = refused(lambda: chat(model="gpt-4"))
    assert (err.status, err.param, err.code) == (404, "model", "model_not_found")
    for body in (b"{", b"[]", b"\xff\xfe", b"[" * 100_000, b'"x"'):
        assert refused(oa.parse_chat, body, MODEL).status == 400


def test_completion_prompts():
    def comp(**fields):
        return oa.parse_completion(json.dumps({"model": MODEL, **fields}).encode(), MODEL)

    assert comp(prompt="abc").req.prompt_text == "abc"
    assert comp(prompt=["abc"]).req.prompt_text == "abc"
    assert comp(prompt=[1, 2, 3]).req.prompt_ids.tolist() == [1, 2, 3]
    assert comp(prompt=[[4, 5]]).req.prompt_ids.tolist() == [4, 5]
    r = comp(prompt="x")
    assert r.req.max_tokens == 16  # OpenAI's default
    for fields, param in (
        ({"prompt": ["a", "b"]}, "prompt"),
        ({"prompt": [1, -2]}, "prompt"),
        ({"prompt": [1, "a"]}, "prompt"),
        ({}, "prompt"),
        ({"prompt": ""}, "prompt"),
        ({"prompt": "x", "echo": True}, "echo"),
        ({"prompt": "x", "best_of": 2}, "best_of"),
        ({"prompt": "x", "logprobs": 1}, "logprobs"),
        ({"prompt": "x", "suffix": "y"}, "suffix"),
        ({"prompt": "x", "messages": USER}, "messages"),
    ):
        err = refused(lambda f=fields: comp(**f))
        assert (err.status, err.param) == (400, param), (fields, err.message)


def test_chat_stream_matches_the_sdk_types():
    r = chat(stream=True, stream_options={"include_usage": True})
    out = bytearray()
    r.start(out, 5)
    for text in ("he", 'l"l\\o\n', "é🙂", "\x00"):
        r.token(out, text)
    r.end(out, Ending(FinishReason.MAX_TOKENS, 5, 4))
    events = sse_events(bytes(out))
    assert events[-1] == (None, "[DONE]")
    chunks = [oc.ChatCompletionChunk.model_validate_json(d) for _, d in events[:-1]]
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == 'hel"l\\o\né🙂\x00'
    assert chunks[-2].choices[0].finish_reason == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.total_tokens == 9
    assert len({c.id for c in chunks}) == 1
    # Without include_usage: no usage chunk.
    r = chat(stream=True)
    out = bytearray()
    r.end(out, Ending(FinishReason.EOS, 5, 0))
    events = sse_events(bytes(out))
    assert len(events) == 2 and json.loads(events[0][1])["choices"][0]["finish_reason"] == "stop"


def test_chat_and_completion_bodies_match_the_sdk_types():
    body = chat().body("hello", Ending(FinishReason.STOP, 3, 2))
    done = oc.ChatCompletion.model_validate_json(body)
    assert done.choices[0].message.content == "hello"
    assert done.choices[0].finish_reason == "stop"
    assert (done.usage.prompt_tokens, done.usage.completion_tokens) == (3, 2)
    comp = oa.parse_completion(b'{"prompt": "x", "stream": true}', MODEL)
    out = bytearray()
    comp.start(out, 1)
    comp.token(out, "ab")
    comp.end(out, Ending(FinishReason.MAX_TOKENS, 1, 2))
    events = sse_events(bytes(out))
    assert events[-1][1] == "[DONE]"
    # The SDK reads stream chunks without validation (finish_reason is null until the end).
    chunks = [json.loads(d) for _, d in events[:-1]]
    assert [c["object"] for c in chunks] == ["text_completion"] * 2
    assert [c["choices"][0]["text"] for c in chunks] == ["ab", ""]
    assert ot.Completion.model_validate(chunks[-1]).choices[0].finish_reason == "length"
    full = ot.Completion.model_validate_json(comp.body("ab", Ending(FinishReason.EOS, 1, 2)))
    assert full.choices[0].text == "ab" and full.usage.total_tokens == 3


def test_models_list_reads_in_both_sdks():
    body = oa.models_body(MODEL, 1_700_000_000)
    page = json.loads(body)
    assert ot.Model.model_validate(page["data"][0]).id == MODEL
    assert at.ModelInfo.model_validate(page["data"][0]).id == MODEL


# -------------------------------------------------------------------------------- Anthropic


def test_messages_defaults_and_fields():
    r = messages()
    req = r.req
    assert (req.max_tokens, req.temperature, req.top_p, req.top_k) == (8, 1.0, 1.0, 0)
    assert req.max_tokens == 8 and req.messages == USER and not r.stream
    r = messages(
        system=[{"type": "text", "text": "S1"}, {"type": "text", "text": "S2"}],
        messages=[
            {"role": "user", "content": [{"type": "text", "text": "q"}]},
            {"role": "assistant", "content": "a"},
            {"role": "user", "content": "q2"},
        ],
        stop_sequences=["\n\nHuman:"],
        temperature=0,
        top_p=0.9,
        top_k=40,
        stream=True,
        metadata={"user_id": "u"},
    )
    req = r.req
    assert req.system == "S1\nS2" and len(req.messages) == 3
    assert req.stop_sequences == ("\n\nHuman:",)
    assert (req.temperature, req.top_p, req.top_k) == (0.0, 0.9, 40)
    assert r.stream


@pytest.mark.parametrize(
    "fields, param",
    [
        ({"max_tokens": None}, "max_tokens"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"temperature": 2.5}, "temperature"),
        ({"top_k": -2}, "top_k"),
        ({"stop_sequences": "x"}, "stop_sequences"),
        ({"tools": [{"name": "t"}]}, "tools"),
        ({"thinking": {"type": "enabled", "budget_tokens": 1024}}, "thinking"),
        ({"system": 5}, "system"),
        ({"messages": [{"role": "system", "content": "x"}]}, "messages[0].role"),
        (
            {"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]},
            "messages[0].content[0]",
        ),
        ({"messages": [USER[0], {"role": "assistant", "content": "Sure,"}]}, "messages[1]"),
        ({"container": "x"}, "container"),
    ],
)
def test_messages_refusals_name_the_field(fields, param):
    err = refused(lambda: messages(**fields))
    assert (err.status, err.param) == (400, param), err.message


def test_messages_ranges_are_every_doors():
    # One table for every door (gateway.validation): OpenAI's temperature range and vLLM's
    # top_k -1 hold on /v1/messages too.
    req = messages(temperature=2.0, top_k=-1).req
    assert (req.temperature, req.top_k) == (2.0, 0)


def test_messages_stream_matches_the_sdk_types():
    r = messages(stream=True, stop_sequences=["STOP"])
    out = bytearray()
    r.start(out, 11)
    r.token(out, "a\n")
    r.token(out, '"b"')
    r.end(out, Ending(FinishReason.STOP, 11, 2))
    events = sse_events(bytes(out))
    names = [name for name, _ in events]
    assert names == [
        "message_start",
        "content_block_start",
        "ping",
        "content_block_delta",
        "content_block_delta",
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]
    parsed = [json.loads(d) for _, d in events]
    assert all(p["type"] == n for p, n in zip(parsed, names, strict=True))
    start = at.RawMessageStartEvent.model_validate(parsed[0])
    assert start.message.usage.input_tokens == 11
    deltas = [at.RawContentBlockDeltaEvent.model_validate(p) for p in parsed[3:5]]
    assert "".join(d.delta.text for d in deltas) == 'a\n"b"'
    end = at.RawMessageDeltaEvent.model_validate(parsed[6])
    assert end.delta.stop_reason == "stop_sequence" and end.delta.stop_sequence == "STOP"
    assert end.usage.output_tokens == 2


def test_messages_body_matches_the_sdk_type():
    r = messages()
    for finish, reason in (
        (FinishReason.EOS, "end_turn"),
        (FinishReason.MAX_TOKENS, "max_tokens"),
        (FinishReason.STOP, "stop_sequence"),
    ):
        msg = at.Message.model_validate_json(r.body("hey", Ending(finish, 4, 1)))
        assert msg.stop_reason == reason
        assert msg.content[0].text == "hey" and msg.usage.input_tokens == 4
        assert msg.stop_sequence is None  # no stop_sequences asked for, none reported
    # Several stop strings: the one that matched is reported when the path knows it.
    r = messages(stop_sequences=["a", "b"])
    msg = at.Message.model_validate_json(r.body("", Ending(FinishReason.STOP, 4, 1, False, "b")))
    assert msg.stop_sequence == "b"


def test_count_tokens_request():
    req = an.parse_count_tokens(
        json.dumps({"model": MODEL, "system": "s", "messages": USER}).encode(), MODEL
    )
    assert req.system == "s" and req.messages == USER
    err = refused(an.parse_count_tokens, b'{"messages": [], "max_tokens": 3}', MODEL)
    assert err.param == "max_tokens"
    assert json.loads(an.count_tokens_body(12)) == {"input_tokens": 12}


# ----------------------------------------------------------------------------------- errors


def test_every_error_code_has_a_status_and_both_shapes():
    assert set(STATUS) == set(ErrorCode)
    for code in ErrorCode:
        err = HttpError.from_code(code, "why", retry_after_ms=5)
        oa_body = json.loads(error_body(OPENAI, err))
        assert oa_body["error"]["message"] == "why"
        assert oa_body["error"]["code"] == code.name.lower()
        assert set(oa_body["error"]) == {"message", "type", "param", "code"}
        an_body = json.loads(error_body(ANTHROPIC, err))
        assert an_body["type"] == "error" and an_body["error"]["message"] == "why"
    assert HttpError.from_code(ErrorCode.RATE_LIMITED, "x").status == 429
    assert HttpError.from_code(ErrorCode.UNAUTHENTICATED, "x").status == 401
    assert HttpError.from_code(ErrorCode.OVERLOADED, "x").status == 503
    assert HttpError.from_code(ErrorCode.INTERNAL, "x").status == 500
    assert status_for(ANTHROPIC, 503) == 529 and status_for(OPENAI, 503) == 503
    overloaded = json.loads(error_body(ANTHROPIC, HttpError(503, "busy")))
    assert overloaded["error"]["type"] == "overloaded_error"
