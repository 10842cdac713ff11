"""The OpenAI and Anthropic translations: JSON → Request (defaults, refusals naming the field),
the replies' bytes (checked against the official SDKs' own types), and the error table."""

from __future__ import annotations

import json
import math

import anthropic.types as at
import numpy as np
import openai.types as ot
import openai.types.chat as oc
import pytest

from tests.support.rawhttp import sse_events
from zerolayer.codes import Refusal
from zerolayer.engine.step import Logprobs
from zerolayer.frames.protocol import ErrorCode, FinishReason
from zerolayer.http import anthropic as an
from zerolayer.http import openai as oa
from zerolayer.http.errors import (
    ANTHROPIC,
    OPENAI,
    STATUS,
    HttpError,
    error_body,
    http_error,
    status_for,
)
from zerolayer.http.logprobs import TokenLogprobs, TokenStrings, chat_entry, chat_entry_json
from zerolayer.http.reply import Ending
from zerolayer.tokenizer import ByteTokenizer

MODEL = "tiny"
USER = [{"role": "user", "content": "hi"}]


STRINGS = TokenStrings(ByteTokenizer())  # logprobs' token texts: one byte per token


def chat(**fields) -> oa.ChatReply:
    body = json.dumps({"model": MODEL, "messages": USER, **fields}).encode()
    return oa.parse_chat(body, MODEL, STRINGS)


def comp(**fields) -> oa.CompletionReply:
    body = json.dumps({"model": MODEL, **fields}).encode()
    return oa.parse_completion(body, MODEL, STRINGS)


def lp(token: int, top: list[int]) -> TokenLogprobs:
    """A token's logprobs as the engine gives them (its alternatives at -1, -2, ...)."""
    values = np.array([-1.0 - i for i in range(len(top))], np.float32)
    return TokenLogprobs(token, Logprobs(-0.5, np.array(top, np.int32), values))


def streamed(r, deltas, endings, prompt_tokens: int = 5) -> list[tuple[str | None, str]]:  # noqa: ANN001
    """The SSE events of a streamed reply: ``deltas`` (choice, text, logprobs) in order, then
    each choice's ending."""
    out = bytearray()
    r.start(out, prompt_tokens)
    for choice, text, item in deltas:
        r.write(out, choice, text, item)
    for choice, ending in enumerate(endings):
        r.finish(choice, ending)
        r.end(out, choice)
    r.tail(out)
    return sse_events(bytes(out))


def whole(r, deltas, endings) -> bytes:  # noqa: ANN001
    """The body of a non-streamed reply."""
    for choice, text, item in deltas:
        r.collect(choice, text, item)
    for choice, ending in enumerate(endings):
        r.finish(choice, ending)
    return r.body()


AN_TOOL = {
    "name": "get_weather",
    "description": "Weather in a city",
    "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}},
}


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
    s = req.sampling
    assert (s.temperature, s.top_p, s.top_k, s.seed) == (1.0, 1.0, 0, None)
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
        n=3,
        user="someone",
        top_k=-1,
        ignore_eos=True,
        prompt_id=3,
        logprobs=True,
        top_logprobs=5,
        tools=None,
        presence_penalty=0.5,
        frequency_penalty=-0.5,
        repetition_penalty=1.2,
        logit_bias={"7": -100, "9": 2.5},
        min_tokens=2,
        response_format={"type": "json_schema", "json_schema": {"name": "x", "strict": True,
                         "schema": {"type": "object"}}},
    )  # fmt: skip
    req = r.req
    assert req.system == "be brief\nreally"
    assert req.messages == [
        {"role": "user", "content": "a\nb"},
        {"role": "assistant", "content": "ok"},
        {"role": "user", "content": "go"},
    ]
    assert req.max_tokens == 7
    s = req.sampling
    assert (s.temperature, s.top_p, s.top_k) == (0.2, 0.5, 0)
    assert s.seed == 2**64 - 1
    assert req.stop_sequences == ("\n", "END")
    assert req.ignore_eos and req.prompt_id == 3
    assert r.stream and r.include_usage
    assert (req.n, s.logprobs, s.top_logprobs, s.min_tokens) == (3, True, 5, 2)
    assert (s.presence_penalty, s.frequency_penalty, s.repetition_penalty) == (0.5, -0.5, 1.2)
    assert s.logit_bias == {7: -100.0, 9: 2.5}
    assert req.constraint is not None and req.constraint.kind == "json_schema"
    assert chat(stop="x").req.stop_sequences == ("x",)
    assert chat(response_format={"type": "text"}).req.constraint is None
    assert chat(response_format={"type": "json_object"}).req.constraint.kind == "json_object"
    so = chat(structured_outputs={"choice": ["yes", "no"]}).req.constraint
    assert (so.kind, so.field) == ("choice", "structured_outputs.choice")
    assert chat(structured_outputs={"json": '{"type": "object"}'}).req.constraint.kind == (
        "json_schema"
    )
    assert chat(max_tokens=4).req.max_tokens == 4


NOW = {"type": "function", "function": {"name": "now"}}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}


@pytest.mark.parametrize(
    "fields, param",
    [
        ({"n": 0}, "n"),
        ({"logprobs": "yes"}, "logprobs"),
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ({"top_logprobs": 2}, "top_logprobs"),  # without logprobs
        ({"tools": [{"type": "function"}]}, "tools[0].function"),
        (
            {"tools": [{"type": "function", "function": {"name": "f", "parameters": []}}]},
            "tools[0].function.parameters",
        ),
        ({"tool_choice": "auto"}, "tool_choice"),  # no tools
        (
            {"tools": [NOW], "tool_choice": {"type": "function", "function": {"name": "x"}}},
            "tool_choice.function.name",
        ),
        ({"tools": [NOW], "parallel_tool_calls": 1}, "parallel_tool_calls"),
        ({"response_format": {"type": "xml"}}, "response_format.type"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"schema": [1]}}},
            "response_format.json_schema.schema",
        ),
        ({"structured_outputs": {"regex": "("}}, "structured_outputs.regex"),
        ({"structured_outputs": {"choice": []}}, "structured_outputs.choice"),
        ({"structured_outputs": {"grammar": "x"}}, "structured_outputs.grammar"),
        ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
        ({"structured_outputs": {"json": "{"}}, "structured_outputs.json"),
        (
            {"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}},
            "structured_outputs.regex",
        ),
        (
            {"tools": [NOW], "tool_choice": "required", "response_format": {"type": "json_object"}},
            "response_format",
        ),
        ({"guided_json": {}}, "guided_json"),
        ({"frequency_penalty": 2.5}, "frequency_penalty"),
        ({"presence_penalty": "x"}, "presence_penalty"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
        ({"logit_bias": {"a": 5}}, "logit_bias"),
        ({"logit_bias": {"1": 500}}, "logit_bias"),
        ({"logit_bias": {"+1": 5}}, "logit_bias"),  # keys: canonical decimal integers only
        ({"logit_bias": {" 5": 5}}, "logit_bias"),
        ({"logit_bias": {"1_0": 5}}, "logit_bias"),
        ({"logit_bias": {"05": 5}}, "logit_bias"),
        ({"logit_bias": [1]}, "logit_bias"),
        ({"min_tokens": -1}, "min_tokens"),
        ({"min_p": 1.5}, "min_p"),
        ({"min_p": "low"}, "min_p"),
        ({"n": 2**32 - 1}, "n"),  # refused before a reply makes its choices (OpenAI's 128)
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
        ({"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role"),
        ({"messages": [{"role": "tool", "content": "x"}]}, "messages[0].tool_call_id"),
        ({"messages": [{"role": "user"}]}, "messages[0].content"),
        ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
        ({"messages": [{"role": "user", "content": "x", "name": 3}]}, "messages[0].name"),
        (
            {"messages": [{"role": "user", "content": "x", "tool_calls": []}]},
            "messages[0].tool_calls",
        ),
        (
            {
                "messages": [
                    USER[0],
                    {
                        "role": "assistant",
                        "tool_calls": [{"id": "c", "function": {"name": "f", "arguments": "{"}}],
                    },
                ]
            },
            "messages[1].tool_calls[0].function.arguments",
        ),
        (
            {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
            "messages[0].content[0]",
        ),
        ({"messages": [{"role": "system", "content": "only"}]}, "messages"),
        ({"messages": [{"role": "user", "content": "\ud800"}]}, "messages[0].content"),
    ],
)
def test_chat_refusals_name_the_field(fields, param):
    err = refused(lambda: chat(**fields))
    assert err.status == 400
    assert err.param == param, err.message


def test_a_later_system_message_stays_in_place():
    late = [
        {"role": "developer", "content": "lead"},
        USER[0],
        {"role": "assistant", "content": "a"},
        {"role": "system", "content": "now be terse"},
        {"role": "developer", "content": [{"type": "text", "text": "really"}]},
        {"role": "user", "content": "q2"},
    ]
    req = chat(messages=late).req
    assert req.system == "lead"
    assert req.messages == [
        USER[0],
        {"role": "assistant", "content": "a"},
        {"role": "system", "content": "now be terse"},
        {"role": "system", "content": "really"},
        {"role": "user", "content": "q2"},
    ]


def test_unknown_model_is_404_and_bad_bodies_are_400():
    err = refused(lambda: chat(model="gpt-4"))
    assert (err.status, err.param, err.code) == (404, "model", "model_not_found")
    for body in (b"{", b"[]", b"\xff\xfe", b"[" * 100_000, b'"x"'):
        assert refused(oa.parse_chat, body, MODEL).status == 400


def test_completion_prompts():
    assert comp(prompt="abc").req.prompt_text == "abc"
    assert comp(prompt=["abc"]).req.prompt_text == "abc"
    assert comp(prompt=[1, 2, 3]).req.prompt_ids.tolist() == [1, 2, 3]
    assert comp(prompt=[[4, 5]]).req.prompt_ids.tolist() == [4, 5]
    r = comp(prompt="x")
    assert r.req.max_tokens == 16  # OpenAI's default
    r = comp(prompt="x", logprobs=3, n=2, structured_outputs={"regex": "[ab]+"})
    assert (r.req.sampling.logprobs, r.req.sampling.top_logprobs, r.req.n) == (True, 3, 2)
    assert r.req.constraint.kind == "regex"
    assert comp(prompt="x", logprobs=0).req.sampling.logprobs
    r = comp(prompt="x", echo=True, logprobs=2, max_tokens=0)  # the prompt's logprobs only
    assert (r.req.echo, r.req.prompt_logprobs, r.req.max_tokens) == (True, 2, 0)
    assert comp(prompt="x", echo=True).req.prompt_logprobs == -1  # echo without logprobs
    for fields, param in (
        ({"prompt": ["a", "b"]}, "prompt"),
        ({"prompt": [1, -2]}, "prompt"),
        ({"prompt": [1, "a"]}, "prompt"),
        ({}, "prompt"),
        ({"prompt": ""}, "prompt"),
        ({"prompt": "x", "echo": "yes"}, "echo"),
        ({"prompt": "x", "echo": True, "prompt_id": 3}, "echo"),
        ({"prompt": "x", "max_tokens": 0}, "max_tokens"),  # 0 only with echo
        ({"prompt": "x", "best_of": 2}, "best_of"),
        ({"prompt": "x", "logprobs": 21}, "logprobs"),
        ({"prompt": "x", "tools": [NOW]}, "tools"),
        ({"prompt": "x", "suffix": "y"}, "suffix"),
        ({"prompt": "x", "messages": USER}, "messages"),
    ):
        err = refused(lambda f=fields: comp(**f))
        assert (err.status, err.param) == (400, param), (fields, err.message)


def test_chat_stream_matches_the_sdk_types():
    r = chat(stream=True, stream_options={"include_usage": True})
    texts = ("he", 'l"l\\o\n', "é🙂", "\x00")
    events = streamed(r, [(0, t, None) for t in texts], [Ending(FinishReason.MAX_TOKENS, 5, 4)])
    assert events[-1] == (None, "[DONE]")
    chunks = [oc.ChatCompletionChunk.model_validate_json(d) for _, d in events[:-1]]
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == 'hel"l\\o\né🙂\x00'
    assert chunks[-2].choices[0].finish_reason == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.total_tokens == 9
    assert len({c.id for c in chunks}) == 1
    # Without include_usage: no usage chunk.
    events = streamed(chat(stream=True), [], [Ending(FinishReason.EOS, 5, 0)])
    assert len(events) == 3 and json.loads(events[1][1])["choices"][0]["finish_reason"] == "stop"


def test_n_choices_streamed_and_whole():
    endings = [Ending(FinishReason.EOS, 5, 2), Ending(FinishReason.MAX_TOKENS, 5, 3)]
    deltas = [(1, "b", None), (0, "a", None), (1, "c", None), (0, "!", None)]
    events = streamed(
        chat(stream=True, n=2, stream_options={"include_usage": True}), deltas, endings
    )
    chunks = [oc.ChatCompletionChunk.model_validate_json(d) for _, d in events[:-1]]
    by_choice: dict[int, str] = {0: "", 1: ""}
    finish = {}
    for c in chunks[:-1]:
        (choice,) = c.choices
        by_choice[choice.index] += choice.delta.content or ""
        if choice.finish_reason:
            finish[choice.index] = choice.finish_reason
    assert by_choice == {0: "a!", 1: "bc"} and finish == {0: "stop", 1: "length"}
    assert chunks[-1].usage.completion_tokens == 5 and events[-1][1] == "[DONE]"
    done = oc.ChatCompletion.model_validate_json(whole(chat(n=2), deltas, endings))
    assert [(c.index, c.message.content, c.finish_reason) for c in done.choices] == [
        (0, "a!", "stop"),
        (1, "bc", "length"),
    ]
    assert (done.usage.prompt_tokens, done.usage.completion_tokens) == (5, 5)
    text = whole(comp(prompt="x", n=2), deltas, endings)
    assert [c.text for c in ot.Completion.model_validate_json(text).choices] == ["a!", "bc"]


def test_chat_logprobs_in_the_sdk_types():
    # "é" is two byte tokens: the first has no text of its own, the second brings it.
    deltas = [
        (0, "a", lp(97, [97, 98])),
        (0, "", lp(0xC3, [0xC3, 97])),
        (0, "é", lp(0xA9, [0xA9, 1])),
    ]
    ending = [Ending(FinishReason.EOS, 5, 3)]
    done = oc.ChatCompletion.model_validate_json(
        whole(chat(logprobs=True, top_logprobs=2), deltas, ending)
    )
    content = done.choices[0].logprobs.content
    assert [t.token for t in content] == ["a", "\ufffd", "\ufffd"]
    assert [t.bytes for t in content] == [[97], [0xC3], [0xA9]]
    assert bytes(b for t in content for b in t.bytes).decode() == "aé"
    assert content[0].logprob == -0.5
    assert [(t.token, t.logprob) for t in content[0].top_logprobs] == [("a", -1.0), ("b", -2.0)]
    r = chat(logprobs=True, top_logprobs=2, stream=True)
    chunks = [
        oc.ChatCompletionChunk.model_validate_json(d) for _, d in streamed(r, deltas, ending)[:-1]
    ]
    streamed_lps = [
        t for c in chunks for ch in c.choices if ch.logprobs for t in ch.logprobs.content
    ]
    assert streamed_lps == content
    assert "".join(ch.delta.content or "" for c in chunks for ch in c.choices) == "aé"
    assert (
        oc.ChatCompletion.model_validate_json(whole(chat(), [(0, "a", None)], ending))
        .choices[0]
        .logprobs
        is None
    )


def test_a_streamed_entrys_json_text_is_the_entry_for_every_kind_of_token():
    """The streamed chunk's logprobs are written as JSON text from per-id fragments: the same
    object as the encoder's, for quotes, backslashes, control bytes, pieces of a character and
    non-finite logprobs, with the 20 alternatives in the engine's order."""
    awkward = [ord('"'), ord("\\"), 0x0A, 0x01, 0xC3, 0xA9, 0x7F, ord("a")]
    top_ids = np.array([*awkward, *range(200, 212)], np.int32)
    top = np.array([-0.25 - i / 7 for i in range(19)] + [float("-inf")], np.float32)
    for token, value in ((ord('"'), -0.25), (0xC3, float("-inf")), (0x0A, float("nan"))):
        item = TokenLogprobs(token, Logprobs(value, top_ids, top))
        text = chat_entry_json(STRINGS, item)
        got, want = json.loads(text), chat_entry(STRINGS, item)
        if math.isnan(value):  # nan is not equal to itself: both are nan
            assert math.isnan(got.pop("logprob")) and math.isnan(want.pop("logprob"))
        assert got == want
        assert [t["bytes"] for t in got["top_logprobs"]] == [[i] for i in top_ids.tolist()]
        assert len(got["top_logprobs"]) == 20 and got["top_logprobs"][-1]["logprob"] == -math.inf


def test_completion_logprobs_lists():
    deltas = [(0, "ab", lp(97, [97])), (0, "", lp(98, [98]))]
    body = whole(comp(prompt="x", logprobs=1), deltas, [Ending(FinishReason.EOS, 1, 2)])
    got = ot.Completion.model_validate_json(body).choices[0].logprobs
    assert got.tokens == ["a", "b"] and got.token_logprobs == [-0.5, -0.5]
    assert got.top_logprobs == [{"a": -1.0}, {"b": -1.0}] and got.text_offset == [0, 1]
    events = streamed(
        comp(prompt="x", logprobs=1, stream=True), deltas, [Ending(FinishReason.EOS, 1, 2)]
    )
    parts = [json.loads(d)["choices"][0]["logprobs"] for _, d in events[:-1]]
    assert [p["tokens"] for p in parts if p] == [["a"], ["b"]]
    assert [p["text_offset"] for p in parts if p] == [[0], [1]]


FORCED = '[{"name": "get_weather", "arguments": {"city": "Paris"}}]'


@pytest.mark.parametrize("step", [1, 6, 100])
def test_tool_calls_streamed_in_the_sdk_types(step: int) -> None:
    r = chat(tools=[WEATHER, NOW], tool_choice="required", stream=True)
    assert r.req.constraint.field == "tools" and r.req.tools[0]["function"]["name"] == "get_weather"
    deltas = [(0, FORCED[i : i + step], None) for i in range(0, len(FORCED), step)]
    events = streamed(r, deltas, [Ending(FinishReason.EOS, 5, 9)])
    chunks = [oc.ChatCompletionChunk.model_validate_json(d) for _, d in events[:-1]]
    calls = [t for c in chunks for ch in c.choices for t in ch.delta.tool_calls or ()]
    assert calls[0].id.startswith("call_") and calls[0].function.name == "get_weather"
    assert json.loads("".join(t.function.arguments for t in calls)) == {"city": "Paris"}
    assert {t.index for t in calls} == {0}
    assert not any(ch.delta.content for c in chunks for ch in c.choices)
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_tool_calls_in_the_body() -> None:
    ending = [Ending(FinishReason.EOS, 5, 9)]
    done = oc.ChatCompletion.model_validate_json(
        whole(chat(tools=[WEATHER], tool_choice="required"), [(0, FORCED, None)], ending)
    )
    choice = done.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {
        "city": "Paris"
    }
    # auto: the model's own Hermes form, with text around it; a plain answer stays content
    hermes = (
        'Checking.<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>'
    )
    done = oc.ChatCompletion.model_validate_json(
        whole(chat(tools=[WEATHER]), [(0, hermes, None)], ending)
    )
    assert done.choices[0].message.content == "Checking."
    assert done.choices[0].message.tool_calls[0].function.name == "get_weather"
    done = oc.ChatCompletion.model_validate_json(
        whole(chat(tools=[WEATHER]), [(0, "Hi", None)], ending)
    )
    assert done.choices[0].message.tool_calls is None and done.choices[0].finish_reason == "stop"
    # none: the tools are not shown to the model and nothing is parsed
    r = chat(tools=[WEATHER], tool_choice="none")
    assert r.req.tools is None and r.req.constraint is None
    done = oc.ChatCompletion.model_validate_json(whole(r, [(0, hermes, None)], ending))
    assert done.choices[0].message.content == hermes
    # a named function: one call, no list
    named = chat(
        tools=[WEATHER, NOW], tool_choice={"type": "function", "function": {"name": "now"}}
    )
    assert json.loads(named.req.constraint.text)["properties"]["name"] == {"const": "now"}
    one = chat(tools=[WEATHER, NOW], tool_choice="required", parallel_tool_calls=False)
    assert json.loads(one.req.constraint.text).get("type") != "array"


def test_tool_history_for_the_template():
    r = chat(
        messages=[
            {"role": "user", "content": "weather?", "name": "ann"},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": "call_1",
                        "type": "function",
                        "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'},
                    }
                ],
            },
            {
                "role": "tool",
                "tool_call_id": "call_1",
                "content": [{"type": "text", "text": "sun"}],
            },
        ],
        tools=[WEATHER],
    )
    assert r.req.messages == [
        {"role": "user", "content": "weather?", "name": "ann"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": {"city": "Rome"}},
                }
            ],
        },
        {"role": "tool", "content": "sun", "tool_call_id": "call_1"},
    ]


def test_chat_and_completion_bodies_match_the_sdk_types():
    body = whole(chat(), [(0, "hello", None)], [Ending(FinishReason.STOP, 3, 2)])
    done = oc.ChatCompletion.model_validate_json(body)
    assert done.choices[0].message.content == "hello"
    assert done.choices[0].finish_reason == "stop"
    assert (done.usage.prompt_tokens, done.usage.completion_tokens) == (3, 2)
    events = streamed(
        comp(prompt="x", stream=True), [(0, "ab", None)], [Ending(FinishReason.MAX_TOKENS, 1, 2)]
    )
    assert events[-1][1] == "[DONE]"
    # The SDK reads stream chunks without validation (finish_reason is null until the end).
    chunks = [json.loads(d) for _, d in events[:-1]]
    assert [c["object"] for c in chunks] == ["text_completion"] * 2
    assert [c["choices"][0]["text"] for c in chunks] == ["ab", ""]
    assert ot.Completion.model_validate(chunks[-1]).choices[0].finish_reason == "length"
    body = whole(comp(prompt="x"), [(0, "ab", None)], [Ending(FinishReason.EOS, 1, 2)])
    full = ot.Completion.model_validate_json(body)
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
    s = req.sampling
    assert (req.max_tokens, s.temperature, s.top_p, s.top_k) == (8, 1.0, 1.0, 0)
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
    s = req.sampling
    assert (s.temperature, s.top_p, s.top_k) == (0.0, 0.9, 40)
    assert r.stream


@pytest.mark.parametrize(
    "fields, param",
    [
        ({"max_tokens": None}, "max_tokens"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"temperature": 2.5}, "temperature"),
        ({"top_k": -2}, "top_k"),
        ({"stop_sequences": "x"}, "stop_sequences"),
        ({"tools": [{"name": "t"}]}, "tools[0].input_schema"),
        (
            {"tools": [{"name": "t", "input_schema": {"type": "array"}}]},
            "tools[0].input_schema.type",
        ),
        ({"tool_choice": {"type": "any"}}, "tool_choice"),  # no tools
        ({"tools": [AN_TOOL], "tool_choice": {"type": "tool", "name": "x"}}, "tool_choice.name"),
        ({"tools": [AN_TOOL], "tool_choice": {"type": "some"}}, "tool_choice.type"),
        (
            {
                "messages": [
                    {"role": "user", "content": [{"type": "tool_use", "id": "a", "name": "b"}]}
                ]
            },
            "messages[0].content[0]",
        ),
        (
            {"messages": [{"role": "user", "content": [{"type": "tool_result"}]}]},
            "messages[0].content[0].tool_use_id",
        ),
        ({"thinking": {"type": "enabled", "budget_tokens": 1024}}, "thinking"),
        ({"system": 5}, "system"),
        ({"messages": [{"role": "system", "content": "x"}]}, "messages"),
        ({"messages": [{"role": "tool", "content": "x"}]}, "messages[0].role"),
        (
            {"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]},
            "messages[0].content[0]",
        ),
        ({"messages": [USER[0], {"role": "assistant", "content": "Sure,"}]}, "messages[1]"),
        ({"container": "x"}, "container"),
    ],
)
def test_messages_refusals_name_the_field(fields, param):  # noqa: ANN001
    err = refused(lambda: messages(**fields))
    assert (err.status, err.param) == (400, param), err.message


def test_anthropic_system_messages_anywhere():
    r = messages(
        system="top",
        messages=[
            {"role": "system", "content": [{"type": "text", "text": "lead"}]},
            USER[0],
            {"role": "assistant", "content": "a"},
            {"role": "system", "content": "late"},
            {"role": "user", "content": "q2"},
        ],
    )
    assert r.req.system == "top\nlead"
    assert r.req.messages == [
        USER[0],
        {"role": "assistant", "content": "a"},
        {"role": "system", "content": "late"},
        {"role": "user", "content": "q2"},
    ]


def test_messages_ranges_are_every_doors():
    # One table for every door (zerolayer.request_path.validation): OpenAI's temperature range and
    # vLLM's top_k -1 hold on /v1/messages too.
    req = messages(temperature=2.0, top_k=-1).req
    s = req.sampling
    assert (s.temperature, s.top_k) == (2.0, 0)


def test_min_p_is_an_extra_field_of_both_apis():
    assert chat(min_p=0.05).req.sampling.min_p == 0.05
    assert comp(prompt="x", min_p=0.2).req.sampling.min_p == 0.2
    assert messages(min_p=0.1).req.sampling.min_p == 0.1
    assert chat().req.sampling.min_p == messages().req.sampling.min_p == 0.0  # off by default
    err = refused(lambda: messages(min_p=-0.5))
    assert err.param == "min_p" and "[0, 1]" in err.message


def test_messages_stream_matches_the_sdk_types():
    r = messages(stream=True, stop_sequences=["STOP"])
    events = streamed(
        r, [(0, "a\n", None), (0, '"b"', None)], [Ending(FinishReason.STOP, 11, 2)], 11
    )
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
    for finish, reason in (
        (FinishReason.EOS, "end_turn"),
        (FinishReason.MAX_TOKENS, "max_tokens"),
        (FinishReason.STOP, "stop_sequence"),
    ):
        msg = at.Message.model_validate_json(
            whole(messages(), [(0, "hey", None)], [Ending(finish, 4, 1)])
        )
        assert msg.stop_reason == reason
        assert msg.content[0].text == "hey" and msg.usage.input_tokens == 4
        assert msg.stop_sequence is None  # no stop_sequences asked for, none reported
    # Several stop strings: the one that matched is reported when the path knows it.
    r = messages(stop_sequences=["a", "b"])
    msg = at.Message.model_validate_json(
        whole(r, [], [Ending(FinishReason.STOP, 4, 1, False, "b")])
    )
    assert msg.stop_sequence == "b"


@pytest.mark.parametrize("step", [1, 7, 100])
def test_anthropic_tool_use_streamed(step: int) -> None:
    r = messages(tools=[AN_TOOL], tool_choice={"type": "any"}, stream=True)
    assert r.req.constraint is not None and r.req.tools[0]["function"]["name"] == "get_weather"
    text = FORCED
    deltas = [(0, text[i : i + step], None) for i in range(0, len(text), step)]
    events = streamed(r, deltas, [Ending(FinishReason.EOS, 5, 9)])
    parsed = [json.loads(d) for _, d in events]
    kinds = [p["type"] for p in parsed]
    assert kinds[:2] == ["message_start", "ping"] and kinds[-2:] == [
        "message_delta",
        "message_stop",
    ]
    start = at.RawContentBlockStartEvent.model_validate(parsed[2])
    assert start.content_block.type == "tool_use" and start.content_block.name == "get_weather"
    assert start.content_block.id.startswith("toolu_") and start.index == 0
    pieces = [
        at.RawContentBlockDeltaEvent.model_validate(p)
        for p in parsed
        if p["type"] == "content_block_delta"
    ]
    assert {p.delta.type for p in pieces} == {"input_json_delta"}
    assert json.loads("".join(p.delta.partial_json for p in pieces)) == {"city": "Paris"}
    assert kinds.count("content_block_stop") == 1
    assert at.RawMessageDeltaEvent.model_validate(parsed[-2]).delta.stop_reason == "tool_use"


def test_anthropic_tool_use_body_and_text_then_call_streamed() -> None:
    call = '{"name": "get_weather", "arguments": {"city": "Oslo"}}'
    hermes = f"Let me check. <tool_call>{call}</tool_call>"
    ending = [Ending(FinishReason.EOS, 5, 9)]
    msg = at.Message.model_validate_json(
        whole(messages(tools=[AN_TOOL]), [(0, hermes, None)], ending)
    )
    assert msg.stop_reason == "tool_use"
    assert [b.type for b in msg.content] == ["text", "tool_use"]
    assert msg.content[0].text == "Let me check." and msg.content[1].input == {"city": "Oslo"}
    events = streamed(messages(tools=[AN_TOOL], stream=True), [(0, hermes, None)], ending)
    parsed = [json.loads(d) for _, d in events]
    starts = [p["content_block"]["type"] for p in parsed if p["type"] == "content_block_start"]
    assert starts == ["text", "tool_use"]
    assert [p["index"] for p in parsed if p["type"] == "content_block_stop"] == [0, 1]
    named = messages(tools=[AN_TOOL], tool_choice={"type": "tool", "name": "get_weather"})
    assert json.loads(named.req.constraint.text)["properties"]["name"] == {"const": "get_weather"}
    assert messages(tools=[AN_TOOL], tool_choice={"type": "none"}).req.tools is None


def test_anthropic_tool_history():
    r = messages(
        messages=[
            {"role": "user", "content": "weather in Rome?"},
            {
                "role": "assistant",
                "content": [
                    {"type": "text", "text": "Checking."},
                    {
                        "type": "tool_use",
                        "id": "toolu_1",
                        "name": "get_weather",
                        "input": {"city": "Rome"},
                    },
                ],
            },
            {
                "role": "user",
                "content": [
                    {"type": "tool_result", "tool_use_id": "toolu_1", "content": "sunny"},
                    {"type": "text", "text": "and tomorrow?"},
                ],
            },
        ],
        tools=[AN_TOOL],
    )
    assert r.req.messages == [
        {"role": "user", "content": "weather in Rome?"},
        {
            "role": "assistant",
            "content": "Checking.",
            "tool_calls": [
                {
                    "id": "toolu_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": {"city": "Rome"}},
                }
            ],
        },
        {"role": "tool", "content": "sunny", "tool_call_id": "toolu_1", "name": "get_weather"},
        {"role": "user", "content": "and tomorrow?"},
    ]


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
