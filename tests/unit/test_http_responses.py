"""The Responses API's parser and reply (zerolayer.http.responses) without a server: the
request fields into a Request, the refusals naming their field, and the streamed events and
the whole object read by the openai SDK's own types — streamed and not from the same items."""

from __future__ import annotations

import json

import pytest
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter

from zerolayer.codes import ErrorCode, FinishReason, Refusal
from zerolayer.http.errors import HttpError
from zerolayer.http.reply import Ending
from zerolayer.http.responses import parse_responses

MODEL = "m"
EVENTS = TypeAdapter(ResponseStreamEvent)
TOOL = {
    "type": "function",
    "name": "f",
    "parameters": {"type": "object", "properties": {"a": {"type": "string"}}},
}


def parse(**fields):  # noqa: ANN201
    return parse_responses(json.dumps({"model": MODEL, "input": "hi", **fields}).encode(), MODEL)


def events(out: bytes) -> list:
    found = []
    for block in out.decode().split("\n\n"):
        if block:
            kind, data = block.split("\n", 1)
            event = EVENTS.validate_python(json.loads(data.removeprefix("data: ")))
            assert kind == f"event: {event.type}"
            found.append(event)
    return found


def test_fields_into_the_request() -> None:
    r = parse(
        instructions="be brief",
        input=[
            {"role": "developer", "content": "lead"},
            {"role": "user", "content": [{"type": "input_text", "text": "q"}]},
            {"type": "function_call", "call_id": "c1", "name": "f", "arguments": '{"a": "x"}'},
            {"type": "function_call_output", "call_id": "c1", "output": "done"},
            {"type": "reasoning", "id": "r", "summary": []},
            {"role": "system", "content": "late"},
        ],
        max_output_tokens=9,
        tools=[TOOL],
        include=["message.output_text.logprobs"],
    )
    req = r.req
    assert req.system == "be brief\nlead" and req.max_tokens == 9 and req.sampling.logprobs
    assert req.messages == [
        {"role": "user", "content": "q"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "f", "arguments": {"a": "x"}}}
            ],
        },
        {"role": "tool", "content": "done", "tool_call_id": "c1", "name": "f"},
        {"role": "system", "content": "late"},
    ]


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"previous_response_id": "resp_1"}, "previous_response_id"),
        ({"background": True}, "background"),
        ({"reasoning": {"effort": "high"}}, "reasoning.effort"),
        ({"input": []}, "input"),
        ({"input": [{"role": "tool", "content": "x"}]}, "input[0].role"),
        ({"tools": [TOOL], "tool_choice": {"type": "allowed_tools"}}, "tool_choice.type"),
        ({"tools": [TOOL], "tool_choice": {"type": "function", "name": "g"}}, "tool_choice.name"),
        ({"text": {"format": {"type": "xml"}}}, "text.format.type"),
        ({"max_tool_calls": 0}, "max_tool_calls"),
        ({"frobnicate": 1}, "frobnicate"),
    ],
)
def test_refusals_name_the_field(fields: dict, param: str) -> None:
    with pytest.raises(Refusal) as err:
        parse(**fields)
    assert err.value.field == param, err.value.message


def _run(r, deltas: list[str], finish: FinishReason) -> tuple[list, Response]:  # noqa: ANN001
    out = bytearray()
    r.start(out, 5)
    for d in deltas:
        r.write(out, 0, d, None)
    r.finish(0, Ending(int(finish), 5, len(deltas)))
    r.end(out, 0)
    r.tail(out)
    streamed = events(bytes(out))
    whole = Response.model_validate_json(r.body())
    return streamed, whole


def test_text_streamed_and_whole_read_by_the_sdk_types() -> None:
    streamed, whole = _run(parse(stream=True), ["Hel", "lo"], FinishReason.MAX_TOKENS)
    kinds = [e.type for e in streamed]
    assert kinds == [
        "response.created", "response.in_progress", "response.output_item.added",
        "response.content_part.added", "response.output_text.delta",
        "response.output_text.delta", "response.output_text.done", "response.content_part.done",
        "response.output_item.done", "response.incomplete",
    ]  # fmt: skip
    assert [e.sequence_number for e in streamed] == list(range(len(streamed)))
    assert streamed[-1].response.output_text == "Hello"
    assert whole.status == "incomplete" and whole.incomplete_details.reason == "max_output_tokens"
    assert whole.usage.output_tokens == 2 and whole.output_text == "Hello"


def test_a_forced_call_streamed_and_whole() -> None:
    text = ['[{"name": "f", ', '"arguments": {"a": "x"}}]']
    streamed, whole = _run(
        parse(stream=True, tools=[TOOL], tool_choice="required"), text, FinishReason.EOS
    )
    (done,) = [e for e in streamed if e.type == "response.function_call_arguments.done"]
    pieces = [e.delta for e in streamed if e.type == "response.function_call_arguments.delta"]
    assert json.loads(done.arguments) == {"a": "x"} == json.loads("".join(pieces))
    assert streamed[-1].type == "response.completed"
    (call,) = whole.output
    assert call.type == "function_call" and call.name == "f" and json.loads(call.arguments)
    # an added item and its done event share the ids the SDK checks
    added = [e.item for e in streamed if e.type == "response.output_item.added"]
    assert [a.call_id for a in added] == [call.call_id]


def test_an_error_after_the_first_event_is_a_numbered_error_event() -> None:
    r = parse(stream=True)
    out = bytearray()
    r.start(out, 5)
    r.write(out, 0, "x", None)
    err = HttpError.from_code(ErrorCode.SLOW_CONSUMER, "client is not reading")
    out += r.error_event(err)
    *_, last = events(bytes(out))
    assert last.type == "error" and last.sequence_number == 5  # after the delta (4)
    assert last.code == "slow_consumer" and last.message == "client is not reading"
