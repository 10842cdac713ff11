"""The OpenAI Responses API (``POST /v1/responses``) and system messages anywhere in the
conversation, with the official clients (openai, anthropic, openai-agents, pydantic-ai) against
a daemon serving the default model, SmolLM2-135M-Instruct (its ChatML template renders a
system message in any place). Outputs are short (small ``max_output_tokens``, ``maxLength`` in
schemas) to keep the suite quick."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import anthropic
import openai
import pytest
from pydantic import BaseModel, Field

from benchmarks._support.daemon import Daemon
from tests.support.smollm2 import SLOW_TIMEOUT_S, data_dir_of

MODEL = "SmolLM2-135M-Instruct"

pytestmark = pytest.mark.timeout(SLOW_TIMEOUT_S)


@pytest.fixture(scope="module")
def daemon(smollm2_dir: Path):
    env = {
        "ENGINE__BACKEND": "cpu",
        "MODEL__DATA_DIR": data_dir_of(smollm2_dir),
        "ENGINE__MAX_BATCH_SIZE": "4",
        "ENGINE__MAX_CONTEXT": "1024",
        "CACHE__ENABLED": "false",
    }
    with Daemon(env) as d:
        yield d


def oai(d: Daemon, **kw) -> openai.OpenAI:
    return openai.OpenAI(base_url=d.http_url + "/v1", api_key="none", max_retries=0, **kw)


def ant(d: Daemon, **kw) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=d.http_url, api_key="none", max_retries=0, **kw)


LATE_SYSTEM = [
    {"role": "user", "content": "Name a colour."},
    {"role": "assistant", "content": "Blue."},
    {"role": "system", "content": "Answer in one word."},
    {"role": "user", "content": "Another one?"},
]


def test_a_system_message_after_the_first_turn_is_answered_on_both_apis(daemon) -> None:
    c = oai(daemon)
    late = c.chat.completions.create(model=MODEL, messages=LATE_SYSTEM, max_tokens=8, seed=1)
    assert late.choices[0].finish_reason in ("stop", "length")
    # the system text is in the prompt: more prompt tokens than without it
    without = [m for m in LATE_SYSTEM if m["role"] != "system"]
    plain = c.chat.completions.create(model=MODEL, messages=without, max_tokens=1)
    assert late.usage.prompt_tokens > plain.usage.prompt_tokens
    a = ant(daemon).messages.create(
        model=MODEL,
        max_tokens=8,
        system="Be kind.",
        messages=[
            {"role": "user", "content": "Name a colour."},
            {"role": "assistant", "content": "Blue."},
            {"role": "system", "content": "Answer in one word."},
            {"role": "user", "content": "Another one?"},
        ],
    )
    assert a.stop_reason in ("end_turn", "max_tokens") and a.usage.input_tokens > 0


# ------------------------------------------------------------------------- the Responses API

WEATHER_TOOL = {
    "type": "function",
    "name": "get_weather",
    "description": "The current weather in a city",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 20}},
        "required": ["city"],
        "additionalProperties": False,
    },
    "strict": True,
}
STREAM_ORDER = [
    "response.created",
    "response.in_progress",
    "response.output_item.added",
    "response.content_part.added",
    # response.output_text.delta × N
    "response.output_text.done",
    "response.content_part.done",
    "response.output_item.done",
]


def test_text_input_streamed_and_not(daemon) -> None:
    c = oai(daemon)
    r = c.responses.create(model=MODEL, input="Say hi.", max_output_tokens=12, temperature=0)
    assert r.status in ("completed", "incomplete") and r.output_text
    assert r.usage.output_tokens <= 12 and r.usage.input_tokens > 0
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    if r.status == "incomplete":
        assert r.incomplete_details.reason == "max_output_tokens"
    events = list(
        c.responses.create(
            model=MODEL, input="Say hi.", max_output_tokens=12, temperature=0, stream=True
        )
    )
    kinds = [e.type for e in events]
    assert [k for k in kinds if k != "response.output_text.delta"] == [
        *STREAM_ORDER,
        "response.completed" if r.status == "completed" else "response.incomplete",
    ]
    assert kinds.index("response.output_text.delta") == 4
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == r.output_text  # greedy: the same text streamed and not
    assert events[-1].response.output_text == r.output_text


def test_sdk_stream_helper_and_message_list_input(daemon) -> None:
    c = oai(daemon)
    with c.responses.stream(
        model=MODEL,
        instructions="You are terse.",
        input=[
            {"role": "user", "content": "Name a colour."},
            {"role": "assistant", "content": "Blue."},
            {"role": "developer", "content": "One word only."},
            {
                "type": "message",
                "role": "user",
                "content": [{"type": "input_text", "text": "More?"}],
            },
        ],
        max_output_tokens=64,
        temperature=0,
    ) as stream:
        final = stream.get_final_response()  # raises unless response.completed came
    assert final.status == "completed" and final.output_text


class City(BaseModel):
    name: str = Field(max_length=20)
    country: str = Field(max_length=20)


def test_text_format_json_schema_through_parse(daemon) -> None:
    r = oai(daemon).responses.parse(
        model=MODEL,
        input="Name a big city and its country.",
        text_format=City,
        max_output_tokens=64,
        temperature=0,
    )
    assert r.status == "completed"
    assert isinstance(r.output_parsed, City)


def test_function_tools_round_trip(daemon) -> None:
    c = oai(daemon)
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    # a budget well past the calls' size: at 64 tokens budget steering's window (docs/http.md,
    # "Constrained output cut by its budget") covers the call from its first token
    r = c.responses.create(
        model=MODEL, input=ask, tools=[WEATHER_TOOL], tool_choice="required", max_output_tokens=256
    )
    calls = [item for item in r.output if item.type == "function_call"]
    assert calls and all(call.name == "get_weather" for call in calls)
    assert "city" in json.loads(calls[0].arguments)
    # streamed: the same item kinds, arguments in pieces that join to the done event's
    events = list(
        c.responses.create(
            model=MODEL,
            input=ask,
            tools=[WEATHER_TOOL],
            tool_choice={"type": "function", "name": "get_weather"},
            max_output_tokens=256,
            stream=True,
        )
    )
    pieces = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    done = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert len(done) == 1 and done[0].arguments == pieces and json.loads(pieces)["city"]
    # the call and its output sent back as input items: the model answers
    call = calls[0]
    follow = c.responses.create(
        model=MODEL,
        input=[
            *ask,
            {"type": "function_call", "call_id": call.call_id, "name": call.name,
             "arguments": call.arguments},
            {"type": "function_call_output", "call_id": call.call_id, "output": "Sunny, 24 C"},
        ],
        tools=[WEATHER_TOOL],
        tool_choice="none",
        max_output_tokens=16,
    )  # fmt: skip
    assert follow.status in ("completed", "incomplete") and follow.output_text


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"previous_response_id": "resp_1"}, "previous_response_id"),
        ({"conversation": "conv_1"}, "conversation"),
        ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
        ({"input": [{"type": "item_reference", "id": "x"}]}, "input[0].type"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
            "input[0].content[0]",
        ),
        (
            {"text": {"format": {"type": "json_schema", "name": "x", "schema": 3}}},
            "text.format.schema",
        ),
    ],
)
def test_refusals_name_the_field(daemon, fields: dict, param: str) -> None:
    c = oai(daemon)
    body = {"model": MODEL, "input": "Hi", **fields}
    with pytest.raises(openai.BadRequestError) as err:
        c.responses.create(**body)
    assert err.value.body["param"] == param, err.value.body
    with pytest.raises(openai.NotFoundError):
        c.responses.retrieve("resp_1")


def test_openai_agents_default_model_calls_the_tool_and_ends(daemon) -> None:
    from agents import (
        Agent,
        ModelSettings,
        OpenAIResponsesModel,
        Runner,
        function_tool,
        set_tracing_disabled,
    )

    set_tracing_disabled(True)
    seen: list[str] = []

    @function_tool
    def get_weather(city: str) -> str:
        """The current weather in a city."""
        seen.append(city)
        return f"Sunny in {city}"

    def agent() -> Agent:  # a client per event loop (run_sync and asyncio.run make their own)
        client = openai.AsyncOpenAI(base_url=daemon.http_url + "/v1", api_key="none", max_retries=0)
        return Agent(
            name="weather",
            instructions="Answer with the weather.",
            model=OpenAIResponsesModel(MODEL, client),
            tools=[get_weather],
            model_settings=ModelSettings(tool_choice="required", max_tokens=64, temperature=0),
        )

    result = Runner.run_sync(agent(), "What is the weather in Paris?", max_turns=4)
    assert seen and isinstance(result.final_output, str)

    async def streamed() -> str:
        run = Runner.run_streamed(agent(), "What is the weather in Rome?", max_turns=4)
        async for _ in run.stream_events():
            pass
        return str(run.final_output)

    before = len(seen)
    assert isinstance(asyncio.run(streamed()), str) and len(seen) > before


def test_pydantic_ai_prompted_output_runs(daemon) -> None:
    # PromptedOutput asks for the JSON in a system message (and a retry sends one mid-list).
    from pydantic_ai import Agent, PromptedOutput
    from pydantic_ai.exceptions import UnexpectedModelBehavior
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai import OpenAIProvider

    provider = OpenAIProvider(base_url=daemon.http_url + "/v1", api_key="none")
    agent = Agent(
        OpenAIChatModel(MODEL, provider=provider),
        output_type=PromptedOutput(City),
        model_settings={"max_tokens": 64, "temperature": 0},
        retries=3,
    )
    try:
        result = agent.run_sync("Name a big city and its country.")
    except UnexpectedModelBehavior:  # the small model may never write valid JSON unforced;
        return  # a refused request (ModelHTTPError, the old 400) fails the test
    assert isinstance(result.output, City)
