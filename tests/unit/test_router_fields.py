"""What vllm-router and sglang-router add to every OpenAI request they forward: the exact bodies
vllm-router 0.1.17 sent (recorded from a listening socket, `benchmarks/router.py`'s router) are
accepted, and each added field at another value is refused naming it."""

from __future__ import annotations

import json

import pytest

from zerolayer.codes import Refusal
from zerolayer.http import openai as oa
from zerolayer.http.fields import ROUTER_DEFAULTS

MODEL = "m"
# The bodies vllm-router 0.1.17 forwarded for `{"model", "messages"|"prompt", "stream": true}`.
ROUTED_CHAT = (
    b'{"model":"m","messages":[{"role":"user","content":"hello"}],"stream":true,'
    b'"logprobs":false,"no_stop_trim":false,"ignore_eos":false,"continue_final_message":false,'
    b'"skip_special_tokens":true,"separate_reasoning":true,"stream_reasoning":true,'
    b'"return_hidden_states":false,"include_reasoning":true}'
)
ROUTED_COMPLETION = (
    b'{"model":"m","prompt":"hello","stream":true,"echo":false,"no_stop_trim":false,'
    b'"ignore_eos":false,"skip_special_tokens":true,"return_hidden_states":false}'
)


def test_the_bodies_a_router_forwards_are_accepted():
    chat = oa.parse_chat(ROUTED_CHAT, MODEL)
    assert chat.stream and chat.req.messages == [{"role": "user", "content": "hello"}]
    assert not chat.req.ignore_eos
    completion = oa.parse_completion(ROUTED_COMPLETION, MODEL)
    assert completion.stream and completion.req.prompt_text == "hello"


@pytest.mark.parametrize("key", sorted(ROUTER_DEFAULTS))
@pytest.mark.parametrize("parse", [oa.parse_chat, oa.parse_completion])
def test_a_router_field_at_another_value_is_refused_naming_it(parse, key):
    body = json.loads(ROUTED_CHAT if parse is oa.parse_chat else ROUTED_COMPLETION)
    for value in (not ROUTER_DEFAULTS[key], "yes", 0):
        body[key] = value
        with pytest.raises(Refusal) as err:
            parse(json.dumps(body).encode(), MODEL)
        assert err.value.field == key and key in err.value.message
