"""zerolayer.http.tools: definitions and their errors, the formats parsed, streaming events, and the
forced-call schema accepting exactly valid calls."""

from __future__ import annotations

import json

import jsonschema
import pytest

from zerolayer.http.tools import (
    ArgumentsDelta,
    CallEnd,
    CallStart,
    CallStream,
    Content,
    OutputCalls,
    ToolError,
    choice_from_anthropic,
    choice_from_openai,
    forced_schema,
    parse,
    tools_from_anthropic,
    tools_from_openai,
)
from zerolayer.models.templates import plain_history, system_prompt, template_tools

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
            "required": ["city"],
        },
    },
}
TOOLS = tools_from_openai([WEATHER, {"type": "function", "function": {"name": "now"}}])


@pytest.mark.parametrize(
    ("value", "field"),
    [
        ("x", "tools"),
        ([{"type": "web"}], "tools[0].type"),
        ([{"type": "function", "function": {"name": ""}}], "tools[0].function.name"),
        (
            [{"type": "function", "function": {"name": "a", "parameters": []}}],
            "tools[0].function.parameters",
        ),
        (
            [{"type": "function", "function": {"name": "a", "parameters": {"type": "objekt"}}}],
            "tools[0].function.parameters.type",
        ),
        ([WEATHER, WEATHER], "tools[1].name"),
        (
            [{"type": "function", "function": {"name": "a", "parameters": {"type": "string"}}}],
            "tools[0].function.parameters.type",
        ),
        (
            [
                {
                    "type": "function",
                    "function": {
                        "name": "a",
                        "parameters": {"properties": {"x": {"items": {"type": "strng"}}}},
                    },
                }
            ],
            "tools[0].function.parameters.properties.x.items.type",
        ),
        (
            [{"type": "function", "function": {"name": "a", "parameters": {"anyOf": []}}}],
            "tools[0].function.parameters.anyOf",
        ),
    ],
)
def test_bad_openai_tools_name_the_field(value: object, field: str) -> None:
    with pytest.raises(ToolError) as err:
        tools_from_openai(value)
    assert err.value.field == field


def test_anthropic_tools_and_choices() -> None:
    tools = tools_from_anthropic([{"name": "f", "input_schema": {"type": "object"}}])
    assert tools[0].parameters == {"type": "object"}
    with pytest.raises(ToolError) as err:
        tools_from_anthropic([{"name": "f"}])
    assert err.value.field == "tools[0].input_schema"
    assert choice_from_anthropic({"type": "any"}, tools).mode == "required"
    assert choice_from_anthropic({"type": "tool", "name": "f"}, tools).name == "f"
    with pytest.raises(ToolError) as err:
        choice_from_anthropic({"type": "tool", "name": "g"}, tools)
    assert err.value.field == "tool_choice.name"


def test_openai_tool_choice() -> None:
    assert choice_from_openai(None, TOOLS).mode == "auto"
    assert choice_from_openai(None, []).mode == "none"
    named = choice_from_openai({"type": "function", "function": {"name": "now"}}, TOOLS)
    assert (named.mode, named.name) == ("required", "now")
    with pytest.raises(ToolError) as err:
        choice_from_openai({"type": "function", "function": {"name": "nope"}}, TOOLS)
    assert err.value.field == "tool_choice.function.name"


def test_parse_hermes_llama3_and_generic() -> None:
    call = '{"name": "get_weather", "arguments": {"city": "Oslo"}}'
    text = f"Let me check.<tool_call>\n{call}\n</tool_call>"
    content, calls = parse(text, TOOLS)
    assert content == "Let me check."
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", {"city": "Oslo"})]
    _, calls = parse('<|python_tag|>{"name": "now", "parameters": {}}', TOOLS)
    assert [c.name for c in calls] == ["now"]
    _, calls = parse(
        '[{"name": "now", "arguments": {}}, '
        '{"name": "get_weather", "arguments": "{\\"city\\": \\"A\\"}"}]'
    )
    assert [c.name for c in calls] == ["now", "get_weather"]
    assert json.loads(calls[1].arguments) == {"city": "A"}
    assert parse("plain answer {not json", TOOLS) == ("plain answer {not json", [])
    assert parse('{"name": "unknown", "arguments": {}}', TOOLS)[1] == []  # not a defined tool


def _stream(text: str, step: int) -> list:
    s = CallStream()
    events = []
    for i in range(0, len(text), step):
        events += s.feed(text[i : i + step])
    return events + s.close()


@pytest.mark.parametrize("step", [1, 3, 7, 1000])
def test_stream_events_join_to_the_calls(step: int) -> None:
    text = (
        'Sure. <tool_call>{"name": "get_weather", "arguments": {"city": "Paris \\"FR\\"", '
        '"unit": "c"}}</tool_call><tool_call>{"name": "now", "arguments": {}}</tool_call> done'
    )
    events = _stream(text, step)
    content = "".join(e.text for e in events if isinstance(e, Content))
    assert content == "Sure.  done"
    starts = [e for e in events if isinstance(e, CallStart)]
    assert [(e.index, e.name) for e in starts] == [(0, "get_weather"), (1, "now")]
    for index, want in ((0, {"city": 'Paris "FR"', "unit": "c"}), (1, {})):
        args = "".join(e.text for e in events if isinstance(e, ArgumentsDelta) and e.index == index)
        assert json.loads(args) == want
    assert [e.index for e in events if isinstance(e, CallEnd)] == [0, 1]
    if step == 1:  # arguments really stream: more than one piece
        assert sum(isinstance(e, ArgumentsDelta) and e.index == 0 for e in events) > 3


def test_stream_without_calls_is_content() -> None:
    events = _stream("a <tool and <b>", 2)
    assert "".join(e.text for e in events) == "a <tool and <b>"


def test_forced_schema_accepts_only_valid_calls() -> None:
    required = forced_schema(TOOLS, choice_from_openai("required", TOOLS))
    jsonschema.validate([{"name": "get_weather", "arguments": {"city": "X"}}], required)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([{"name": "get_weather", "arguments": {}}], required)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([], required)
    named = forced_schema(
        TOOLS, choice_from_openai({"type": "function", "function": {"name": "now"}}, TOOLS)
    )
    jsonschema.validate({"name": "now", "arguments": {}}, named)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"name": "get_weather", "arguments": {"city": "X"}}, named)
    assert forced_schema(TOOLS, choice_from_openai("auto", TOOLS)) is None
    # what the grammar forces parses back into the same calls
    assert parse(json.dumps({"name": "now", "arguments": {}}), TOOLS)[1][0].name == "now"


def test_system_prompt_lists_every_tool() -> None:
    text = system_prompt(TOOLS)
    assert "get_weather" in text and '"now"' in text and "<tool_call>" in text


def _events(calls: OutputCalls, text: str, step: int) -> list:
    events = []
    for i in range(0, len(text), step):
        events += calls.feed(text[i : i + step])
    return events + calls.close()


def _calls_of(events: list) -> list[tuple[str, object]]:
    """(name, arguments) of each call the events describe, by index."""
    names = {e.index: e.name for e in events if isinstance(e, CallStart)}
    return [
        (
            names[i],
            json.loads(
                "".join(e.text for e in events if isinstance(e, ArgumentsDelta) and e.index == i)
            ),
        )
        for i in sorted(names)
    ]


UNDEFINED_FIRST = (
    'Checking. <tool_call>{"name": "get_wether", "arguments": {"city": "Rome"}}</tool_call>'
    '<tool_call>{"name": "now", "arguments": {}}</tool_call>'
)


@pytest.mark.parametrize("step", [1, 5, 1000])
def test_a_call_naming_no_defined_tool_is_content_streamed_or_not(step: int) -> None:
    # auto: the model may write any name; a block naming no defined tool is no call: its text
    # (tags included) is content, the other blocks are calls, indexed from 0 — the same answer
    # whether it is streamed or not.
    content, calls = OutputCalls(TOOLS, forced=False).result(UNDEFINED_FIRST)
    assert content == 'Checking. <tool_call>{"name": "get_wether", "arguments": {"city": "Rome"}}' \
        "</tool_call>"  # fmt: skip
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("now", {})]
    stream = OutputCalls(TOOLS, forced=False)
    events = _events(stream, UNDEFINED_FIRST, step)
    assert "".join(e.text for e in events if isinstance(e, Content)) == content
    assert _calls_of(events) == [("now", {})] and stream.calls == 1
    assert [e.index for e in events if isinstance(e, CallStart | CallEnd)] == [0, 0]
    alone = OutputCalls(TOOLS, forced=False)
    only = '<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>'
    assert "".join(e.text for e in _events(alone, only, step)) == only and alone.calls == 0
    assert OutputCalls(TOOLS, forced=False).result(only) == (only, [])


@pytest.mark.parametrize("step", [1, 4, 1000])
def test_forced_json_form_streams_its_calls(step: int) -> None:
    text = (
        '[{"name": "get_weather", "arguments": {"city": "Lyon, \\"FR\\" {x}"}}, '
        '{"name": "now", "arguments": {}}]'
    )
    calls = OutputCalls(TOOLS, forced=True)
    events = _events(calls, text, step)
    assert not [e for e in events if isinstance(e, Content)]
    assert _calls_of(events) == [("get_weather", {"city": 'Lyon, "FR" {x}'}), ("now", {})]
    assert [e.index for e in events if isinstance(e, CallEnd)] == [0, 1]
    assert calls.calls == 2
    one = OutputCalls(TOOLS, forced=True)
    assert _calls_of(_events(one, '{"name": "now", "arguments": {"a": [1, {"b": 2}]}}', step)) == [
        ("now", {"a": [1, {"b": 2}]})
    ]


@pytest.mark.parametrize("step", [1, 5, 1000])
def test_auto_output_streams_hermes_and_holds_json(step: int) -> None:
    hermes = 'Let me look. <tool_call>{"name": "now", "arguments": {}}</tool_call>'
    events = _events(OutputCalls(TOOLS, forced=False), hermes, step)
    assert "".join(e.text for e in events if isinstance(e, Content)).strip() == "Let me look."
    assert _calls_of(events) == [("now", {})]
    llama = ' <|python_tag|>{"name": "get_weather", "parameters": {"city": "Oslo"}}'
    calls = OutputCalls(TOOLS, forced=False, id_prefix="toolu_")
    events = _events(calls, llama, step)
    assert _calls_of(events) == [("get_weather", {"city": "Oslo"})]
    assert [e.id[:6] for e in events if isinstance(e, CallStart)] == ["toolu_"]
    assert calls.calls == 1
    # JSON that is no call is content, whole, at the end.
    events = _events(OutputCalls(TOOLS, forced=False), '{"answer": 42}', step)
    assert [e.text for e in events] == ['{"answer": 42}']
    # Plain text streams as it comes (nothing held back but a possible tag's beginning).
    plain = OutputCalls(TOOLS, forced=False)
    assert plain.feed("Hello") == [Content("Hello")]
    assert plain.feed(" <tool") == [Content(" ")]
    assert plain.close() == [Content("<tool")]


def test_one_call_without_parallel() -> None:
    text = '<tool_call>{"name": "now", "arguments": {}}</tool_call>' * 2
    calls = OutputCalls(TOOLS, forced=False, parallel=False)
    assert len(_calls_of(_events(calls, text, 3))) == 1 and calls.calls == 1
    content, whole = OutputCalls(TOOLS, forced=False, parallel=False).result(text)
    assert len(whole) == 1 and content == ""


def test_history_without_template_tools() -> None:
    history = [
        {"role": "user", "content": "weather?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "now", "arguments": {}}},
                {
                    "id": "c2",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": {"city": "Rome"}},
                },
            ],
        },
        {"role": "tool", "content": "12:00", "tool_call_id": "c1"},
        {"role": "tool", "content": "sunny", "tool_call_id": "c2"},
    ]
    plain = plain_history(history)
    assert [m["role"] for m in plain] == ["user", "assistant", "user"]
    assert [c.name for c in parse(plain[1]["content"], TOOLS)[1]] == ["now", "get_weather"]
    assert plain[2]["content"].count("<tool_response>") == 2 and "sunny" in plain[2]["content"]
    assert template_tools(TOOLS)[0]["function"]["name"] == "get_weather"


# ---- issue #39: tool-call lists are bounded ---------------------------------------------------


def _call(name: str, args: str) -> str:
    return json.dumps({"name": name}).rstrip("}") + ', "arguments": ' + args + "}"


@pytest.mark.parametrize("forced", [True, False])
@pytest.mark.parametrize("step", [1, 3, 1000])
def test_a_call_repeating_an_earlier_one_ends_the_list_streamed_or_not(forced, step) -> None:
    from zerolayer.http.tools import MAX_CALLS

    paris, rome = _call("get_weather", '{"city": "Paris"}'), _call("get_weather", '{"city": "Pa"}')
    # a call whose arguments start like an earlier one's, then differ, is sent; an equal one
    # ends the list, and what follows it is dropped
    items = [paris, rome, _call("now", "{}"), paris, _call("now", "{}")]
    if forced:
        text = "[" + ", ".join(items) + "]"
    else:
        text = "".join(f"<tool_call>{i}</tool_call>" for i in items)
    want = [("get_weather", {"city": "Paris"}), ("get_weather", {"city": "Pa"}), ("now", {})]
    content, calls = OutputCalls(TOOLS, forced=forced).result(text)
    assert [(c.name, json.loads(c.arguments)) for c in calls] == want
    stream = OutputCalls(TOOLS, forced=forced)
    events = _events(stream, text, step)
    assert _calls_of(events) == want and stream.calls == 3
    assert [e.index for e in events if isinstance(e, CallStart)] == [0, 1, 2]
    # at most MAX_CALLS, each different
    many = [_call("get_weather", json.dumps({"city": f"c{i}"})) for i in range(MAX_CALLS + 3)]
    text = (
        "[" + ", ".join(many) + "]"
        if forced
        else "".join(f"<tool_call>{i}</tool_call>" for i in many)
    )
    assert len(OutputCalls(TOOLS, forced=forced).result(text)[1]) == MAX_CALLS
    stream = OutputCalls(TOOLS, forced=forced)
    assert len(_calls_of(_events(stream, text, step))) == MAX_CALLS == stream.calls


def test_a_forced_list_allows_at_most_max_calls() -> None:
    from zerolayer.http.tools import MAX_CALLS

    schema = forced_schema(TOOLS, choice_from_openai("required", TOOLS))
    assert schema is not None and schema["maxItems"] == MAX_CALLS
    now = {"name": "now", "arguments": {}}
    jsonschema.validate([now] * MAX_CALLS, schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([now] * (MAX_CALLS + 1), schema)


def test_a_forced_list_cut_short_keeps_the_calls_that_closed() -> None:
    text = '[{"name": "now", "arguments": {}}, {"name": "get_weather", "arguments": {"city": "Pa'
    content, calls = OutputCalls(TOOLS, forced=True).result(text)
    assert content == "" and [(c.name, json.loads(c.arguments)) for c in calls] == [("now", {})]
    cut_first = '[{"name": "get_weather", "arguments": {"city": "Pa'
    assert OutputCalls(TOOLS, forced=True).result(cut_first) == (cut_first, [])


@pytest.mark.parametrize("tag", ["", "<|python_tag|>", "  "])
def test_an_answer_in_the_json_form_cut_short_keeps_the_calls_that_closed(tag: str) -> None:
    """tool_choice auto: the model's own JSON form, held to its end (issue 39: completed calls
    are returned whatever ended the request), streamed or not; a call naming no defined tool
    leaves the whole answer content, as it does uncut."""
    text = tag + '[{"name": "now", "arguments": {}}, {"name": "get_weather", "arguments": {"ci'
    content, calls = OutputCalls(TOOLS, forced=False).result(text)
    assert content == "" and [(c.name, json.loads(c.arguments)) for c in calls] == [("now", {})]
    streamed = OutputCalls(TOOLS, forced=False)
    events = streamed.feed(text) + streamed.close()
    assert [(type(e), getattr(e, "name", None)) for e in events] == [
        (CallStart, "now"), (ArgumentsDelta, None), (CallEnd, None)
    ]  # fmt: skip
    foreign = '[{"name": "nope", "arguments": {}}, {"name": "now", "argu'
    assert OutputCalls(TOOLS, forced=False).result(foreign) == (foreign, [])
    prose = '{"answer": "the weather is'
    assert OutputCalls(TOOLS, forced=False).result(prose) == (prose, [])
