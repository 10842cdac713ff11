"""Agent-ready HTTP APIs (issue #27) with the real clients against a daemon serving the default
model, SmolLM2-135M-Instruct: the openai SDK's ``chat.completions.parse`` with a pydantic model,
streamed tool calls, logprobs in the SDK's types (and equal to transformers' on the same
weights), n choices, the anthropic SDK's tool-use round trip, a LangChain tool loop and
``with_structured_output``; and each bad agent field a 400 naming it on both APIs, the
connection still serving afterwards.

A model this small has no tool training: the forced choices (``required``, a named tool, Anthropic
``any``) are what make its calls valid, through the grammar. Outputs are short (small
``max_tokens``, ``maxLength`` in the schemas) to keep the suite quick."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import anthropic
import httpx
import httpx2
import openai
import pytest
import torch
from pydantic import BaseModel, Field

from benchmarks._support.daemon import Daemon
from tests.support.smollm2 import SLOW_TIMEOUT_S, data_dir_of
from zerolayer import client as zc

MODEL = "SmolLM2-135M-Instruct"
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 20}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}
ASK_WEATHER = [{"role": "user", "content": "What is the weather in Paris?"}]
WEATHER_INPUT = WEATHER["function"]["parameters"]


class City(BaseModel):
    name: str = Field(max_length=20)
    country: str = Field(max_length=20)


@pytest.fixture(scope="module")
def daemon(smollm2_dir: Path):
    env = {
        "ENGINE__BACKEND": "cpu",
        "MODEL__DATA_DIR": data_dir_of(smollm2_dir),
        "ENGINE__MAX_BATCH_SIZE": "4",
        "ENGINE__MAX_CONTEXT": "1024",
        "MODEL__DTYPE": "float32",  # the parity mode: logprobs compared with transformers'
        "ENGINE__KV_DTYPE": "float32",
        "CACHE__ENABLED": "false",
    }
    with Daemon(env) as d:
        yield d


def oai(d: Daemon, **kw) -> openai.OpenAI:
    return openai.OpenAI(base_url=d.http_url + "/v1", api_key="none", max_retries=0, **kw)


def ant(d: Daemon, **kw) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=d.http_url, api_key="none", max_retries=0, **kw)


BAD_CHAT = [  # (fields, the param the 400 names)
    (
        {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
            "type": "object", "properties": {"a": {"type": "objekt"}}}}}},
        "response_format.json_schema.schema",
    ),
    (
        {"tools": [{"type": "function", "function": {"name": "f", "parameters": {
            "type": "object", "properties": {"a": {"type": 3}}}}}]},
        "tools[0].function.parameters.properties.a.type",
    ),
    ({"n": 1000}, "n"),
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"logit_bias": {"49152": 5}}, "logit_bias"),  # the vocabulary is 49152 ids
    (
        {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
        "tool_choice.function.name",
    ),
    ({"structured_outputs": {"regex": "(unclosed"}}, "structured_outputs.regex"),
]  # fmt: skip
BAD_MESSAGES = [  # (fields, the field the message names)
    (
        {"tools": [{"name": "f", "input_schema": {"type": "object", "properties": {
            "a": {"type": "objekt"}}}}]},
        "tools[0].input_schema.properties.a.type",
    ),
    ({"tools": [{"name": "f", "input_schema": "no"}]}, "tools[0].input_schema"),
    (
        {"tools": [{"name": "f", "input_schema": {"type": "object"}}],
         "tool_choice": {"type": "tool", "name": "nope"}},
        "tool_choice.name",
    ),
    ({"n": 2}, "n"),  # not a Messages field
]  # fmt: skip


@pytest.mark.timeout(SLOW_TIMEOUT_S)
def test_bad_agent_fields_are_400s_naming_the_field_and_the_connection_serves_on(daemon):
    streams: list[object] = []  # the network stream each response came on

    def client(lib):  # noqa: ANN001, ANN202 - httpx (openai) or httpx2 (anthropic)
        hooks = {"response": [lambda r: streams.append(r.extensions["network_stream"])]}
        return lib.Client(event_hooks=hooks, limits=lib.Limits(max_connections=1))

    c = oai(daemon, http_client=client(httpx))
    for fields, param in BAD_CHAT:
        with pytest.raises(openai.BadRequestError) as info:
            c.chat.completions.create(
                model=MODEL, messages=ASK_WEATHER, max_tokens=2, extra_body=fields
            )
        body = info.value.body
        assert param in body["message"], (fields, body)
        # OpenAI's param names it whoever refused: the door's parser, or the request path
        # after it (the model's vocabulary, engine.max_n, the grammar compile)
        assert body["param"] == param and info.value.param == param, (fields, body)
    ok = c.chat.completions.create(model=MODEL, messages=ASK_WEATHER, max_tokens=2)
    assert ok.choices[0].message.content is not None
    assert len(streams) == len(BAD_CHAT) + 1 and len(set(map(id, streams))) == 1
    streams.clear()
    a = ant(daemon, http_client=client(httpx2))
    for fields, where in BAD_MESSAGES:
        extra = {k: v for k, v in fields.items() if k not in ("tools", "tool_choice")}
        known = {k: v for k, v in fields.items() if k in ("tools", "tool_choice")}
        with pytest.raises(anthropic.BadRequestError) as ainfo:
            a.messages.create(
                model=MODEL, max_tokens=2, messages=ASK_WEATHER, extra_body=extra, **known
            )
        assert where in ainfo.value.body["error"]["message"], (fields, ainfo.value.body)
    assert a.messages.create(model=MODEL, max_tokens=2, messages=ASK_WEATHER).content
    assert len(streams) == len(BAD_MESSAGES) + 1 and len(set(map(id, streams))) == 1


@pytest.mark.timeout(SLOW_TIMEOUT_S)
def test_tools_too_large_for_the_context_are_refused_by_the_text_bound(daemon):
    # A tiny message with 20 kB of tool definitions: over max_context 1024 x 16 bytes, refused
    # by the text bound before any templating or tokenizing (its message says bytes, not
    # tokens), naming the tools and the context length, on both APIs.
    big = {**WEATHER, "function": {**WEATHER["function"], "description": "d" * 20_000}}
    with pytest.raises(openai.BadRequestError) as info:
        oai(daemon).chat.completions.create(
            model=MODEL, messages=ASK_WEATHER, max_tokens=2, tools=[big]
        )
    err = info.value
    assert err.param == "tools" and err.code == "prompt_too_long", err.body
    assert "UTF-8 bytes" in err.message and "max_context 1024" in err.message, err.body
    tool = {"name": "get_weather", "description": "d" * 20_000, "input_schema": WEATHER_INPUT}
    with pytest.raises(anthropic.BadRequestError) as ainfo:
        ant(daemon).messages.create(model=MODEL, max_tokens=2, messages=ASK_WEATHER, tools=[tool])
    message = ainfo.value.body["error"]["message"]
    assert message.startswith("tools:") and "max_context 1024" in message, ainfo.value.body


@pytest.mark.timeout(SLOW_TIMEOUT_S)
def test_bad_agent_fields_on_the_frame_door_name_the_field_and_the_connection_serves_on(daemon):
    # The frame door's ERROR carries the Refusal's message, which names the field (a frame
    # stream is one choice: n > 1 is its own refusal, naming n).
    async def main() -> None:
        async with await zc.Client.connect(daemon.endpoint) as client:
            await client.hello()
            for kwargs, name in (
                ({"logit_bias": {49152: 5.0}}, "logit_bias"),  # the vocabulary is 49152 ids
                ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
            ):
                with pytest.raises(zc.InvalidRequestError, match=name):
                    await (await client.generate("x", max_tokens=2, **kwargs)).collect()
            n = await client.generate_json({"max_tokens": 2, "prompt": "x", "n": 2})
            with pytest.raises(zc.InvalidRequestError, match="n > 1"):
                await n.collect()
            ok = await (await client.generate("Hello", max_tokens=2)).collect()
            assert ok.completion_tokens >= 1

    asyncio.run(main())


@pytest.mark.timeout(SLOW_TIMEOUT_S)
def test_parse_with_a_pydantic_model_returns_a_validated_object(daemon):
    c = oai(daemon)
    done = c.chat.completions.parse(
        model=MODEL,
        messages=[{"role": "user", "content": "Name a big city and its country."}],
        response_format=City,
        max_tokens=64,
        temperature=0,
    )
    city = done.choices[0].message.parsed
    assert isinstance(city, City) and city.name and city.country


@pytest.mark.timeout(SLOW_TIMEOUT_S)
def test_a_call_naming_no_defined_tool_is_content_streamed_or_not(daemon):
    # tool_choice auto, the answer pinned by a one-choice constraint: a Hermes block naming an
    # undefined tool, then one naming get_weather. The first is content, the second a call
    # with index 0 — the same answer streamed and not (docs/http.md).
    foreign = '<tool_call>{"name": "get_wether", "arguments": {}}</tool_call>'
    answer = (
        foreign + '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>'
    )
    ask = {"model": MODEL, "messages": ASK_WEATHER, "tools": [WEATHER], "max_tokens": 96,
           "extra_body": {"structured_outputs": {"choice": [answer]}}}  # fmt: skip
    c = oai(daemon)
    whole = c.chat.completions.create(**ask).choices[0]
    assert whole.message.content == foreign and whole.finish_reason == "tool_calls"
    calls = whole.message.tool_calls or []
    assert [(t.function.name, json.loads(t.function.arguments)) for t in calls] == [
        ("get_weather", {"city": "Oslo"})
    ]
    content, names, args, indices = "", [], "", set()
    for chunk in c.chat.completions.create(**ask, stream=True):
        for choice in chunk.choices:
            content += choice.delta.content or ""
            for t in choice.delta.tool_calls or []:
                indices.add(t.index)
                names += [t.function.name] if t.function and t.function.name else []
                args += (t.function.arguments or "") if t.function else ""
    assert content == foreign and names == ["get_weather"] and indices == {0}
    assert json.loads(args) == {"city": "Oslo"}


@pytest.mark.timeout(SLOW_TIMEOUT_S)
def test_calls_in_the_json_form_cut_by_max_tokens_keep_the_calls_that_closed(daemon):
    """tool_choice auto, the answer pinned to a list of two calls in the generic JSON form and
    cut by max_tokens inside the second: the first is a call, streamed or not, and the finish
    stays ``length`` (issue 39: completed calls are returned whatever ended the request)."""
    first = {"name": "get_weather", "arguments": {"city": "Oslo"}}
    second = {"name": "get_weather", "arguments": {"city": "Rio de Janeiro"}}
    answer = json.dumps([first, second])
    count = httpx.post(daemon.http_url + "/tokenize", json={"prompt": answer,
                       "add_special_tokens": False}).json()["count"]  # fmt: skip
    head = httpx.post(daemon.http_url + "/tokenize", json={"prompt": json.dumps([first]),
                      "add_special_tokens": False}).json()["count"]  # fmt: skip
    ask = {"model": MODEL, "messages": ASK_WEATHER, "tools": [WEATHER],
           "max_tokens": (head + count) // 2,  # inside the second call
           "extra_body": {"structured_outputs": {"choice": [answer]}}}  # fmt: skip
    c = oai(daemon)
    whole = c.chat.completions.create(**ask).choices[0]
    assert whole.finish_reason == "length" and not whole.message.content
    calls = whole.message.tool_calls or []
    assert [(t.function.name, json.loads(t.function.arguments)) for t in calls] == [
        ("get_weather", {"city": "Oslo"})
    ]
    names, args, finish = [], "", None
    for chunk in c.chat.completions.create(**ask, stream=True):
        for choice in chunk.choices:
            assert not choice.delta.content
            for t in choice.delta.tool_calls or []:
                names += [t.function.name] if t.function and t.function.name else []
                args += (t.function.arguments or "") if t.function else ""
            finish = choice.finish_reason or finish
    assert names == ["get_weather"] and json.loads(args) == {"city": "Oslo"}
    assert finish == "length"


@pytest.mark.timeout(SLOW_TIMEOUT_S)
def test_streamed_tool_calls_forced_by_the_grammar(daemon):
    c = oai(daemon)
    chunks = list(
        c.chat.completions.create(
            model=MODEL,
            messages=ASK_WEATHER,
            tools=[WEATHER],
            tool_choice="required",
            max_tokens=64,
            temperature=0,
            stream=True,
        )
    )
    calls = [t for ch in chunks for choice in ch.choices for t in choice.delta.tool_calls or ()]
    assert calls and calls[0].function.name == "get_weather" and calls[0].id.startswith("call_")
    assert len(calls) > 2  # the arguments came in pieces
    args = json.loads("".join(t.function.arguments or "" for t in calls if t.index == 0))
    assert isinstance(args["city"], str)
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "tool_calls"


@pytest.mark.timeout(SLOW_TIMEOUT_S)
def test_logprobs_in_the_sdk_types_equal_transformers(
    daemon, smollm2_dir: Path, smollm2_reference_model
):
    from zerolayer.models.hf_tokenizer import HFTokenizer

    question = [{"role": "user", "content": "What is the capital of France?"}]
    done = oai(daemon).chat.completions.create(
        model=MODEL, messages=question, max_tokens=6, temperature=0, logprobs=True, top_logprobs=5
    )
    content = done.choices[0].logprobs.content
    assert len(content) == done.usage.completion_tokens == 6
    for t in content:
        values = [alt.logprob for alt in t.top_logprobs]
        assert len(values) == 5 and values == sorted(values, reverse=True) and values[0] <= 0
        assert t.top_logprobs[0].token == t.token and t.logprob == values[0]  # greedy
    text = b"".join(bytes(t.bytes) for t in content).decode("utf-8", "replace")
    assert text.startswith(done.choices[0].message.content)
    # transformers on the same GGUF, greedy: log_softmax of its logits at each position (a
    # greedy row's logprobs are the model's own distribution, T = 1:
    # gateway/zerolayer/engine/sampling.py).
    tok = HFTokenizer(smollm2_dir)
    ids = tok.encode_prompt(tok.render_chat(question, None)).tolist()
    model = smollm2_reference_model
    with torch.inference_mode():
        for t in content:
            lp = torch.log_softmax(model(torch.tensor([ids])).logits[0, -1].float(), -1)
            top = torch.topk(lp, 5)
            best = int(top.indices[0])
            assert tok.token_bytes(best) == bytes(t.bytes)
            # The same weights in float32 (Q4_1 blocks dequantized in the kernel, transformers'
            # dequantized tensors): only the order of sums differs
            assert abs(t.logprob - float(top.values[0])) < 2e-3
            ours = [alt.logprob for alt in t.top_logprobs]
            assert max(abs(a - float(b)) for a, b in zip(ours, top.values, strict=True)) < 2e-3
            ids.append(best)


@pytest.mark.timeout(SLOW_TIMEOUT_S)
def test_n_choices(daemon):
    done = oai(daemon).chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Say a word."}],
        max_tokens=4,
        n=3,
        seed=7,
    )
    assert [c.index for c in done.choices] == [0, 1, 2]
    assert all(c.finish_reason in ("stop", "length") for c in done.choices)
    assert done.usage.completion_tokens <= 12
    chunks = list(
        oai(daemon).chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "Say a word."}],
            max_tokens=4,
            n=3,
            seed=7,
            stream=True,
        )
    )
    finished = {ch.choices[0].index for ch in chunks if ch.choices and ch.choices[0].finish_reason}
    assert finished == {0, 1, 2}


ANT_WEATHER = {
    "name": "get_weather",
    "description": "The current weather in a city",
    "input_schema": WEATHER["function"]["parameters"],
}


@pytest.mark.timeout(SLOW_TIMEOUT_S)
def test_anthropic_tool_use_round_trip(daemon):
    a = ant(daemon)
    first = a.messages.create(
        model=MODEL,
        max_tokens=64,
        messages=ASK_WEATHER,
        tools=[ANT_WEATHER],
        tool_choice={"type": "any"},
        extra_body={"temperature": 0},
    )
    assert first.stop_reason == "tool_use"
    (use,) = [b for b in first.content if b.type == "tool_use"]
    assert use.name == "get_weather" and isinstance(use.input["city"], str)
    history = [
        *ASK_WEATHER,
        {"role": "assistant", "content": [b.model_dump() for b in first.content]},
        {
            "role": "user",
            "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "Sunny, 21 C"}],
        },
    ]
    with a.messages.stream(
        model=MODEL,
        max_tokens=24,
        messages=history,
        tools=[ANT_WEATHER],
        tool_choice={"type": "none"},
        extra_body={"temperature": 0},
    ) as stream:
        answer = stream.get_final_message()
    assert answer.stop_reason in ("end_turn", "max_tokens")
    assert answer.content[0].type == "text" and answer.content[0].text
    # Streamed tool use: a tool_use block whose input arrives as input_json_delta pieces.
    with a.messages.stream(
        model=MODEL,
        max_tokens=64,
        messages=ASK_WEATHER,
        tools=[ANT_WEATHER],
        tool_choice={"type": "tool", "name": "get_weather"},
        extra_body={"temperature": 0},
    ) as stream:
        kinds = [e.type for e in stream]
        streamed = stream.get_final_message()
    assert "input_json" in kinds and streamed.stop_reason == "tool_use"
    assert streamed.content[-1].type == "tool_use" and "city" in streamed.content[-1].input


@pytest.mark.timeout(SLOW_TIMEOUT_S)
def test_langchain_tool_loop_and_structured_output(daemon):
    from langchain_core.messages import HumanMessage, ToolMessage
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI

    @tool
    def get_weather(city: str) -> str:
        """The current weather in a city."""
        return f"Sunny and 21 C in {city}"

    llm = ChatOpenAI(
        model=MODEL,
        base_url=daemon.http_url + "/v1",
        api_key="none",
        temperature=0,
        max_tokens=48,
        max_retries=0,
    )
    messages = [HumanMessage("What is the weather in Paris?")]
    called = llm.bind_tools([get_weather], tool_choice="required").invoke(messages)
    (call,) = called.tool_calls[:1]
    assert call["name"] == "get_weather" and isinstance(call["args"]["city"], str)
    result = get_weather.invoke(call["args"])
    messages += [called, ToolMessage(result, tool_call_id=call["id"])]
    answer = llm.bind_tools([get_weather], tool_choice="none").invoke(messages)
    assert isinstance(answer.content, str) and answer.content and not answer.tool_calls
    city = llm.with_structured_output(City).invoke("Name a big city and its country.")
    assert isinstance(city, City) and city.name


@pytest.mark.timeout(SLOW_TIMEOUT_S)
def test_hostile_grammars_are_400s_naming_the_field_while_a_canary_streams(daemon):
    """Issue #40: each hostile schema, sent by four clients at once, is a 400 naming the field
    (never a 500, never a stall), while a canary streams beside them; then the same schemas again
    (refused from the cache); a grammar that fails only after some tokens is a 400 or a complete
    answer, streamed or not, never a 500."""
    from concurrent.futures import ThreadPoolExecutor

    from benchmarks.hostile_grammars import LATE, REFUSED, request_fields

    def hostile(item: tuple[str, object, str]) -> tuple[int, str | None]:
        kind, spec, _ = item
        try:
            oai(daemon, timeout=60).chat.completions.create(
                model=MODEL,
                messages=ASK_WEATHER,
                max_tokens=8,
                extra_body=request_fields(kind, spec),
            )
        except openai.APIStatusError as exc:
            return exc.status_code, exc.param  # type: ignore[attr-defined]
        return 200, None

    def canary() -> tuple[int, str | None]:
        stream = oai(daemon).chat.completions.create(
            model=MODEL, messages=ASK_WEATHER, max_tokens=16, stream=True, temperature=0
        )
        chunks = [c for c in stream if c.choices]
        return len([c for c in chunks if c.choices[0].delta.content]), chunks[-1].choices[
            0
        ].finish_reason

    items = list(REFUSED.values()) * 2  # twice: the second round is refused from the cache
    with ThreadPoolExecutor(5) as pool:
        guard = pool.submit(canary)
        answers = list(pool.map(hostile, items))
        tokens, finish = guard.result(SLOW_TIMEOUT_S)
    assert answers == [(400, field) for _, _, field in items]
    assert tokens > 0 and finish in ("length", "stop")
    kind, spec, field = LATE["nested regex (issue)"]
    for stream in (False, True):
        try:
            got = oai(daemon).chat.completions.create(
                model=MODEL, messages=ASK_WEATHER, max_tokens=64, stream=stream,
                extra_body=request_fields(kind, spec),
            )  # fmt: skip
            if stream:
                list(got)  # type: ignore[arg-type]
        except openai.BadRequestError as exc:
            assert exc.param == field
        except openai.APIError as exc:  # an SSE error event after streamed tokens
            assert field in str(exc) and "internal" not in str(exc).lower()
    assert canary()[0] > 0  # the daemon serves on


class Reading(BaseModel):
    city: str = Field(max_length=12)
    celsius: int


@pytest.mark.timeout(SLOW_TIMEOUT_S)
def test_pydantic_ai_structured_output_parses_with_bounded_numbers_and_calls(daemon):
    """Issue #39 S1a on the default model: pydantic-ai's default structured output (a forced
    tool call) returns a validated object, its integer inside int64; the same request over the
    openai client with parallel calls returns at most MAX_CALLS calls, no two equal."""
    from pydantic_ai import Agent
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai import OpenAIProvider

    from zerolayer.http.tools import MAX_CALLS

    provider = OpenAIProvider(base_url=daemon.http_url + "/v1", api_key="none")
    agent = Agent(OpenAIChatModel(MODEL, provider=provider), output_type=Reading)
    got = agent.run_sync(
        "The weather in Oslo: 3 degrees.", model_settings={"max_tokens": 96, "temperature": 0}
    )
    assert isinstance(got.output, Reading) and abs(got.output.celsius) < 2**63
    tool = {"type": "function", "function": {"name": "reading", "parameters":
            Reading.model_json_schema()}}  # fmt: skip
    for stream in (False, True):
        answer = oai(daemon).chat.completions.create(
            model=MODEL, messages=ASK_WEATHER, tools=[tool], tool_choice="required",
            max_tokens=200, temperature=1.2, seed=7, stream=stream,
        )  # fmt: skip
        if stream:
            calls: dict[int, list[str]] = {}
            for chunk in answer:  # type: ignore[union-attr]
                for tc in (chunk.choices[0].delta.tool_calls or []) if chunk.choices else []:
                    calls.setdefault(tc.index, []).append(tc.function.arguments or "")
            texts = ["".join(parts) for parts in calls.values()]
        else:
            texts = [c.function.arguments for c in answer.choices[0].message.tool_calls or []]
        assert 1 <= len(texts) <= MAX_CALLS and len(set(texts)) == len(texts), texts
        for text in texts:
            assert abs(json.loads(text)["celsius"]) < 2**63


class Profile(BaseModel):
    bio: str
    age: int
    hobbies: list[str]


PROFILE_FORMAT = {
    "type": "json_schema",
    "json_schema": {"name": "profile", "schema": Profile.model_json_schema()},
}
ASK_PROFILE = [
    {"role": "user", "content": "Write a very long biography of a person with many hobbies."}
]


@pytest.mark.timeout(SLOW_TIMEOUT_S)
def test_schema_output_cut_by_max_tokens_still_validates_streamed_or_not(daemon):
    """Issue #39: a json_schema reply whose max_tokens runs out inside the JSON is steered to
    its shortest valid end: finish "length", and the content validates; streamed = not."""
    c = oai(daemon)
    for max_tokens in (20, 32, 48):
        fields = {"model": MODEL, "messages": ASK_PROFILE, "max_tokens": max_tokens,
                  "response_format": PROFILE_FORMAT, "temperature": 0}  # fmt: skip
        answer = c.chat.completions.create(**fields)
        choice = answer.choices[0]
        # 20 tokens cut any answer (the shortest is 17); a larger budget may end on its own
        assert choice.finish_reason in ("length", "stop"), choice.message.content
        assert choice.finish_reason == "length" or max_tokens > 20
        assert answer.usage is not None and answer.usage.completion_tokens <= max_tokens
        Profile.model_validate_json(choice.message.content or "")
        chunks = list(c.chat.completions.create(**fields, stream=True))
        streamed = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
        assert streamed == choice.message.content
        finishes = [ch.choices[0].finish_reason for ch in chunks if ch.choices]
        assert finishes[-1] == choice.finish_reason


@pytest.mark.timeout(SLOW_TIMEOUT_S)
def test_anthropic_forced_tool_cut_by_max_tokens_has_parseable_input(daemon):
    """Issue #39 on the Anthropic API: a forced tool whose max_tokens runs out inside its input
    gets a complete input (stop_reason "max_tokens"), streamed or not."""
    report = {
        "name": "report",
        "description": "A long weather report",
        "input_schema": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "text": {"type": "string"},
                           "days": {"type": "array", "items": {"type": "integer"}}},
            "required": ["city", "text", "days"],
        },
    }  # fmt: skip
    c = ant(daemon)
    # 26 tokens: the shortest call is 22 ({"name": "report", "arguments": {"city": "", ...}})
    fields = {"model": MODEL, "max_tokens": 26, "tools": [report],
              "tool_choice": {"type": "tool", "name": "report"},
              "messages": [{"role": "user", "content": "Write a long weather report for Oslo."}],
              "extra_body": {"temperature": 0}}  # fmt: skip
    message = c.messages.create(**fields)
    assert message.stop_reason == "max_tokens"
    uses = [b for b in message.content if b.type == "tool_use"]
    assert len(uses) == 1 and set(uses[0].input) == {"city", "text", "days"}
    with c.messages.stream(**fields) as stream:
        final = stream.get_final_message()
    assert final.stop_reason == "max_tokens"
    assert [b.input for b in final.content if b.type == "tool_use"] == [uses[0].input]


@pytest.mark.timeout(SLOW_TIMEOUT_S)
def test_pydantic_ai_native_output_at_a_small_budget_validates(daemon):
    """pydantic-ai's NativeOutput (response_format json_schema) at a budget the model's answer
    overruns: the reply is steered closed and validates."""
    from pydantic_ai import Agent, NativeOutput
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai import OpenAIProvider

    provider = OpenAIProvider(base_url=daemon.http_url + "/v1", api_key="none")
    agent = Agent(OpenAIChatModel(MODEL, provider=provider), output_type=NativeOutput(Profile))
    got = agent.run_sync(
        "Write a very long biography of a person with many hobbies.",
        model_settings={"max_tokens": 24, "temperature": 0},
    )
    assert isinstance(got.output, Profile)
