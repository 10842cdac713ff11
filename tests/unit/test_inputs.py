"""The input processor (zerolayer.request_path.inputs) without a server or a connection: what
depends on the model (vocabulary, context, registered prompts) and tokenization. Field ranges are
zerolayer.request_path.validation's (tests/unit/test_validation.py)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from tests.support.sampling import with_sampling
from zerolayer.codes import ErrorCode, Refusal
from zerolayer.engine.backend import ModelInfo
from zerolayer.request_path.inputs import InputProcessor
from zerolayer.request_path.prompts import PromptRegistry
from zerolayer.request_path.request import Request
from zerolayer.tokenizer import ByteTokenizer

TOK = ByteTokenizer()
INFO = ModelInfo("m", 259, 257, 64)


def prepare(registry: PromptRegistry | None = None, **kw):  # noqa: ANN201
    kw.setdefault("max_tokens", 4)
    if "prompt_ids" not in kw and "messages" not in kw:
        kw.setdefault("prompt_text", "hi")
    return InputProcessor(TOK, INFO, registry).prepare(Request(**with_sampling(kw)))


def refused(**kw) -> Refusal:
    with pytest.raises(Refusal) as err:
        prepare(**kw)
    return err.value


def test_text_prompt_is_tokenized_and_sampling_carried() -> None:
    prep = prepare(prompt_text="abc", temperature=0.5, top_k=3, seed=9, want_text=True)
    assert prep.prompt.tolist() == TOK.encode_prompt("abc").tolist()
    assert prep.prompt.dtype == np.int32
    assert (prep.sampling.temperature, prep.sampling.top_k, prep.sampling.seed) == (0.5, 3, 9)
    assert prep.sampling.seed is not None and prep.deterministic and prep.detokenizer is not None
    assert not prepare(temperature=0.7).deterministic


@pytest.mark.parametrize(
    ("kw", "code", "needle"),
    [
        ({"prompt_ids": np.array([1, 400], np.int32)}, ErrorCode.INVALID_REQUEST, "vocabulary"),
        ({"prompt_ids": np.array([1, -1], np.int32)}, ErrorCode.INVALID_REQUEST, "vocabulary"),
        ({"prompt_ids": np.array([2**31 - 1], np.int32)}, ErrorCode.INVALID_REQUEST, "vocabulary"),
        ({"stop_ids": np.array([-1], np.int32)}, ErrorCode.INVALID_REQUEST, "stop token"),
        ({"stop_ids": np.array([3, 259], np.int32)}, ErrorCode.INVALID_REQUEST, "stop token"),
        ({"stop_ids": np.array([-(2**31)], np.int32)}, ErrorCode.INVALID_REQUEST, "stop token"),
        ({"max_tokens": 63}, ErrorCode.PROMPT_TOO_LONG, "max_context 64"),
        ({"prompt_id": 5}, ErrorCode.UNKNOWN_PROMPT, "no precompiled prompt 5"),
    ],
)
def test_refusals_name_the_field(kw: dict, code: ErrorCode, needle: str) -> None:
    err = refused(**kw)
    assert err.code == code and needle in err.message


def test_registered_prompt_supplies_the_system_part_and_nothing_is_split_off() -> None:
    """prompt_id selects the text; the ids are the same as sending that text (reuse is the
    engine's prefix store's business)."""
    reg = PromptRegistry.build([{"id": 1, "name": "s", "text": "Be brief."}], TOK)
    by_id = prepare(reg, prompt_id=1, prompt_text="hi")
    by_text = prepare(reg, system="Be brief.", prompt_text="hi")
    assert by_id.prompt.tolist() == by_text.prompt.tolist()
    rendered = TOK.encode_prompt(TOK.render_system("Be brief.") + "hi")
    assert by_id.prompt.tolist() == rendered.tolist()
    ids = prepare(reg, prompt_id=1, prompt_ids=np.array([104, 105], np.int32))
    assert ids.prompt.tolist() == reg.by_id(1).ids.tolist() + [104, 105]
    err = refused_with(reg, prompt_id=1, system="Something else.")
    assert err.code == ErrorCode.INVALID_REQUEST and "differs" in err.message
    assert refused_with(reg, prompt_id=2, prompt_text="hi").code == ErrorCode.UNKNOWN_PROMPT


def refused_with(reg: PromptRegistry, **kw) -> Refusal:
    with pytest.raises(Refusal) as err:
        prepare(reg, **kw)
    return err.value


def test_no_max_tokens_is_what_fits_beside_the_prompt() -> None:
    # An HTTP request that gave no max_tokens: the input processor keeps what fits after the
    # prompt (BOS + "hi" = 3 tokens of 64).
    assert prepare(max_tokens=None).max_tokens == 61
    err = refused(prompt_text="x" * 70, max_tokens=None)
    assert err.code == ErrorCode.PROMPT_TOO_LONG
    assert refused(max_tokens=62).code == ErrorCode.PROMPT_TOO_LONG  # a given one is not lowered


def test_a_requests_own_context_bounds_it_below_the_engines() -> None:
    """``Request.context`` (Ollama's num_ctx): what fits is counted in it; a larger one is the
    engine's."""
    assert prepare(max_tokens=None, context=10).max_tokens == 7  # BOS + "hi" of 10
    assert prepare(max_tokens=None, context=1000).max_tokens == 61
    err = refused(max_tokens=8, context=10)
    assert err.code == ErrorCode.PROMPT_TOO_LONG and "the request context 10" in err.message


def test_truncate_cuts_an_embeddings_input_to_its_first_tokens() -> None:
    proc = InputProcessor(TOK, ModelInfo("m", 259, 257, 64, hidden_size=8))
    ids = TOK.encode_prompt("x" * 70)
    cut = proc.prepare(Request(max_tokens=0, embed=True, prompt_text="x" * 70, truncate=True))
    assert cut.prompt.tolist() == ids[:64].tolist()
    small = Request(max_tokens=0, embed=True, prompt_text="abc", truncate=True, context=2)
    assert proc.prepare(small).prompt.tolist() == TOK.encode_prompt("abc")[:2].tolist()
    with pytest.raises(Refusal) as err:  # not asked: refused, as /v1/embeddings does
        proc.prepare(Request(max_tokens=0, embed=True, prompt_text="x" * 70))
    assert err.value.code == ErrorCode.PROMPT_TOO_LONG
    with pytest.raises(Refusal):  # a request that generates is never cut
        proc.prepare(Request(max_tokens=1, prompt_text="x" * 70, truncate=True))


def test_ignore_eos_is_carried_and_prompt_tokens_counted() -> None:
    assert prepare(ignore_eos=True).ignore_eos and not prepare().ignore_eos
    proc = InputProcessor(TOK, INFO)
    chat = Request(max_tokens=1, messages=[{"role": "user", "content": "hey"}], system="S")
    assert proc.count_prompt_tokens(chat) == len(proc.prepare(chat).prompt)
    long = Request(max_tokens=1, prompt_text="y" * 100)  # counted, though it would not fit
    assert proc.count_prompt_tokens(long) == 101


def test_ids_at_both_ends_of_the_vocabulary_are_accepted() -> None:
    """The range check reads int32 ids as unsigned (a negative id is huge): 0 and vocab - 1
    pass, for prompt ids and stop ids alike."""
    edge = np.array([0, INFO.vocab_size - 1], np.int32)
    prep = prepare(prompt_ids=edge, stop_ids=edge)
    assert prep.prompt.tolist() == edge.tolist()
    assert prep.stop_ids == frozenset(edge.tolist())
    assert prepare(prompt_ids=edge).stop_ids == frozenset()


@pytest.mark.parametrize("token", [-1, INFO.vocab_size, 2**31, 10**30])
def test_logit_bias_ids_outside_the_vocabulary_are_refused_here(token: int) -> None:
    """The one vocabulary check of logit_bias keys, whatever door parsed them (a JSON key such as
    "-1" or "1000000000000000000000000000000" is a token id to every parser, refused here)."""
    assert prepare(logit_bias={0: 1.0, INFO.vocab_size - 1: -1.0}).sampling.logit_bias
    err = refused(logit_bias={0: 1.0, token: 5.0})
    assert err.field == "logit_bias" and f"key {token} is outside the vocabulary" in err.message


def _tool(description: str) -> dict:
    parameters = {"type": "object", "properties": {"city": {"type": "string"}}}
    return {"type": "function", "function": {"name": "f", "description": description,
                                              "parameters": parameters}}  # fmt: skip


def _call(arguments: dict) -> dict:
    call = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": arguments}}
    return {"role": "assistant", "content": "", "tool_calls": [call]}


class _RecordingTokenizer(ByteTokenizer):
    """A tokenizer double that records every render and encode the input processor asks for."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[str] = []

    def render_chat(self, messages, system, tools=None):  # noqa: ANN001, ANN201
        self.calls.append("render_chat")
        return super().render_chat(messages, system, tools)

    def encode_prompt(self, text: str) -> np.ndarray:
        self.calls.append("encode_prompt")
        return super().encode_prompt(text)


@pytest.mark.parametrize(
    ("kw", "field"),
    [
        ({"prompt_text": "a" * (64 * 16 + 1)}, "prompt"),
        ({"prompt_text": "é" * (64 * 8 + 1)}, "prompt"),  # 2 bytes a character
        ({"messages": [{"role": "user", "content": "a" * 600}] * 2}, "messages"),
        ({"prompt_text": "hi", "system": "s" * 1100}, "system"),
        # the tool definitions are rendered into the prompt: they count (as their JSON)
        ({"messages": [{"role": "user", "content": "hi"}], "tools": [_tool("d" * 1100)]}, "tools"),
        ({"messages": [_call({"city": "R" * 1100})]}, "messages"),  # the history's calls too
    ],
)
def test_text_bound_refuses_before_the_tokenizer_runs(kw: dict, field: str) -> None:
    tok = _RecordingTokenizer()
    with pytest.raises(Refusal) as err:
        InputProcessor(tok, INFO).prepare(Request(max_tokens=4, **kw))
    assert err.value.code == ErrorCode.PROMPT_TOO_LONG and err.value.field == field
    assert "1024 UTF-8 bytes" in err.value.message and "max_context 64" in err.value.message
    assert tok.calls == []
    with pytest.raises(Refusal):
        InputProcessor(tok, INFO).count_prompt_tokens(Request(max_tokens=4, **kw))
    assert tok.calls == []


def test_text_at_the_bound_reaches_the_tokenizer() -> None:
    tok = _RecordingTokenizer()
    with pytest.raises(Refusal) as err:  # 1024 bytes pass the bound; the context then refuses
        InputProcessor(tok, INFO).prepare(Request(max_tokens=4, prompt_text="a" * 1024))
    assert "tokens" in err.value.message and tok.calls == ["encode_prompt"]


WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}
CALLED = [
    {"role": "user", "content": "weather in Rome?"},
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
    {"role": "tool", "content": "sunny", "tool_call_id": "call_1", "name": "get_weather"},
]


def test_tools_and_calls_as_text_for_a_template_without_tools() -> None:
    tok = _RecordingTokenizer()
    req = Request(max_tokens=4, messages=CALLED, system="be brief", tools=[WEATHER])
    prompt = tok.decode(InputProcessor(tok, ModelInfo("m", 259, 257, 2048)).prepare(req).prompt)
    system, rest = prompt.split("<|user|>", 1)
    assert system.startswith("<|system|>\nbe brief\n\nYou may call")
    assert '"name": "get_weather"' in system and "<tool_call>" in system
    assert (
        '<|assistant|>\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}' in rest
    )
    assert "<|user|>\n<tool_response>\nsunny\n</tool_response>\n<|assistant|>\n" in rest


def test_a_template_with_tools_renders_them(tmp_path) -> None:
    from tokenizers import Tokenizer as RustTokenizer
    from tokenizers import models, pre_tokenizers

    from zerolayer.models.hf_tokenizer import HFTokenizer

    rust = RustTokenizer(models.WordLevel({"<unk>": 0, "<s>": 1, "</s>": 2}, unk_token="<unk>"))
    rust.pre_tokenizer = pre_tokenizers.Whitespace()
    rust.save(str(tmp_path / "tokenizer.json"))
    template = (
        "{% if tools %}TOOLS{% for t in tools %} {{ t.function.name }}{% endfor %}.{% endif %}"
        "{% for m in messages %}[{{ m.role }}{% if m.name %}:{{ m.name }}{% endif %}]"
        "{{ m.content }}{% for c in m.tool_calls or [] %}"
        "CALL {{ c.function.name }} {{ c.function.arguments | tojson }}{% endfor %}{% endfor %}"
    )
    config = {"bos_token": "<s>", "eos_token": "</s>", "chat_template": template}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    tok = HFTokenizer(tmp_path)
    assert tok.renders_tools
    seen: list[str] = []
    tok.encode_prompt = lambda text: seen.append(text) or np.ones(3, np.int32)  # type: ignore[method-assign]
    InputProcessor(tok, ModelInfo("m", 3, 2, 64)).prepare(
        Request(max_tokens=4, messages=CALLED, tools=[WEATHER])
    )
    assert seen == [
        'TOOLS get_weather.[user]weather in Rome?[assistant]CALL get_weather {"city": "Rome"}'
        "[tool:get_weather]sunny"
    ]


# --------------------------------------------------------------- system messages anywhere

# Gemma's rule: no system role, user and assistant alternate (its template raises otherwise).
_STRICT = (
    "{% for m in messages %}"
    "{% if m.role == 'system' %}{{ raise_exception('System role not supported') }}{% endif %}"
    "{% if (m.role == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant') }}{% endif %}"
    "<{{ m.role }}>{{ m.content }}</>{% endfor %}<assistant>"
)
_CHATML = "{% for m in messages %}<{{ m.role }}>{{ m.content }}</>{% endfor %}<assistant>"

LATE = [
    {"role": "user", "content": "q1"},
    {"role": "assistant", "content": "a1"},
    {"role": "system", "content": "be terse"},
    {"role": "user", "content": "q2"},
]


def _templated(tmp_path, template: str):  # noqa: ANN001, ANN202 - (tokenizer, rendered texts)
    from tokenizers import Tokenizer as RustTokenizer
    from tokenizers import models, pre_tokenizers

    from zerolayer.models.hf_tokenizer import HFTokenizer

    rust = RustTokenizer(models.WordLevel({"<unk>": 0, "<s>": 1, "</s>": 2}, unk_token="<unk>"))
    rust.pre_tokenizer = pre_tokenizers.Whitespace()
    rust.save(str(tmp_path / "tokenizer.json"))
    config = {"bos_token": "<s>", "eos_token": "</s>", "chat_template": template}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    tok = HFTokenizer(tmp_path)
    seen: list[str] = []
    tok.encode_prompt = lambda text: seen.append(text) or np.ones(3, np.int32)  # type: ignore[method-assign]
    return tok, seen


def _render(tok, **kw) -> None:  # noqa: ANN001
    InputProcessor(tok, ModelInfo("m", 3, 2, 4096)).prepare(Request(max_tokens=4, **kw))


def test_a_template_that_renders_any_role_gets_system_messages_in_place(tmp_path) -> None:
    tok, seen = _templated(tmp_path, _CHATML)
    _render(tok, messages=LATE, system="lead")
    assert seen == [
        "<system>lead</><user>q1</><assistant>a1</><system>be terse</><user>q2</><assistant>"
    ]


@pytest.mark.parametrize(
    ("messages", "system", "expected"),
    [
        # the next user message gets the system texts, the system prompt first
        (LATE, "lead", "<user>lead\n\nq1</><assistant>a1</><user>be terse\n\nq2</><assistant>"),
        # no user message after it: appended to the previous one
        (
            [*LATE[:3], {"role": "user", "content": "q2"}, {"role": "system", "content": "end"}],
            None,
            "<user>q1</><assistant>a1</><user>be terse\n\nq2\n\nend</><assistant>",
        ),
    ],
)
def test_a_template_refusing_system_gets_them_merged_into_user_turns(
    tmp_path,  # noqa: ANN001
    messages: list,
    system: str | None,
    expected: str,
) -> None:
    tok, seen = _templated(tmp_path, _STRICT)
    _render(tok, messages=messages, system=system)
    assert seen == [expected]


def test_a_conversation_the_template_refuses_is_a_400_naming_messages(tmp_path) -> None:
    tok, seen = _templated(tmp_path, _STRICT)
    for messages in (
        [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}],  # no system
        # merged, the turns still do not alternate
        [{"role": "assistant", "content": "a"}, {"role": "system", "content": "s"}],
    ):
        with pytest.raises(Refusal) as err:
            _render(tok, messages=messages)
        assert err.value.field == "messages" and err.value.code == ErrorCode.INVALID_REQUEST
        assert "roles must alternate" in err.value.message
    assert seen == []


def test_merge_system_rule() -> None:
    from zerolayer.models.templates import merge_system

    original = [dict(m) for m in LATE]
    assert merge_system(LATE, None) == [
        {"role": "user", "content": "q1"},
        {"role": "assistant", "content": "a1"},
        {"role": "user", "content": "be terse\n\nq2"},
    ]
    assert original == LATE  # copied, not changed in place
    only = [{"role": "assistant", "content": "a"}, {"role": "system", "content": "s"}]
    assert merge_system(only, "p") == [
        {"role": "assistant", "content": "a"},
        {"role": "user", "content": "p\n\ns"},
    ]
