"""vLLM's ``/tokenize`` and ``/detokenize`` on the HTTP port: the served model's tokenizer, in
vLLM's request and response shapes, answered without the engine (the door's ``LOCAL`` table).

``/tokenize`` takes ``prompt`` (``add_special_tokens`` true by default: the ids
``/v1/completions`` feeds the engine, the model's BOS rule applied; false: the text's ids alone)
or ``messages`` (with ``tools``: exactly the ids ``/v1/chat/completions`` prefills — chat
template, tools, system messages anywhere — what a cache-aware router matches prefixes on), and
answers ``{"count", "max_model_len", "tokens", "token_strs"}``. ``/detokenize`` takes ``tokens``
and answers ``{"prompt"}`` (special tokens left out, as in generated text). Both are behind the
API key and the body and text bounds, not charged to a rate limit (as ``count_tokens``); a
large input is tokenized off the event loop. Errors are OpenAI's shape.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from zerolayer.codes import invalid
from zerolayer.http.fields import check_model
from zerolayer.http.json_body import dumps
from zerolayer.http.logprobs import TokenStrings
from zerolayer.http.openai import chat_messages, chat_tools
from zerolayer.request_path.inputs import InputProcessor
from zerolayer.request_path.request import Request
from zerolayer.request_path.validation import (
    check_keys,
    get_bool,
    get_text,
    get_token_ids,
    load_object,
)

_PROMPT_KEYS = ("model", "prompt", "add_special_tokens", "return_token_strs")
_CHAT_KEYS = (
    "model", "messages", "tools", "add_generation_prompt", "add_special_tokens",
    "return_token_strs", "continue_final_message", "chat_template", "chat_template_kwargs",
    "mm_processor_kwargs",
)  # fmt: skip
# vLLM's chat fields that would change the ids and are not supported (at their defaults: fine)
_CHAT_DEFAULTS = {"continue_final_message": False, "add_generation_prompt": True}
_CHAT_REFUSED = ("chat_template", "chat_template_kwargs", "mm_processor_kwargs")


def tokenize(
    body: bytes, served: str, inputs: InputProcessor, strings: TokenStrings
) -> bytes | Callable[[], bytes]:
    """POST /tokenize: the answer, or (a large input) the work that makes it off the loop."""
    obj = load_object(body)
    check_model(obj, served)
    want_strs = get_bool(obj, "return_token_strs")
    req = Request(max_tokens=None, want_text=True)
    special = True
    if "messages" in obj:
        check_keys(obj, _CHAT_KEYS)
        for key, default in _CHAT_DEFAULTS.items():
            if key in obj and get_bool(obj, key, default) != default:
                raise invalid(f"{key}: only {str(default).lower()} is supported", key)
        for key in _CHAT_REFUSED:
            if key in obj:
                raise invalid(f"{key} is not supported: the model's own template is used", key)
        get_bool(obj, "add_special_tokens")  # the chat prefill's ids whatever it says
        req.messages, req.system = chat_messages(obj)
        chat_tools({"tools": obj["tools"]} if "tools" in obj else {}, req)
    else:
        check_keys(obj, _PROMPT_KEYS)
        if "prompt" not in obj:
            raise invalid("prompt or messages is required", "prompt")
        req.prompt_text = get_text(obj["prompt"], "prompt")
        special = get_bool(obj, "add_special_tokens", True)
    max_len = inputs.info.max_context

    def answer() -> bytes:
        if special:
            ids = inputs.prompt_ids(req).tolist()
        else:
            ids = inputs.tokenizer.encode(req.prompt_text or "")
        token_strs = [strings.get(i)[0] for i in ids] if want_strs else None
        return dumps(
            {"count": len(ids), "max_model_len": max_len, "tokens": ids, "token_strs": token_strs}
        )

    if inputs.offloaded(req):  # refuses a text over the bound (PROMPT_TOO_LONG)
        return answer
    return answer()


def detokenize(body: bytes, served: str, inputs: InputProcessor) -> bytes:
    """POST /detokenize: ``{"tokens": [...]}`` → ``{"prompt": text}``."""
    obj = load_object(body)
    check_keys(obj, ("model", "tokens"))
    check_model(obj, served)
    ids = get_token_ids(obj.get("tokens"), "tokens")
    vocab = inputs.info.vocab_size
    if bool(np.any(ids >= vocab)):
        raise invalid(f"token id outside the vocabulary [0, {vocab})", "tokens")
    return dumps({"prompt": inputs.tokenizer.decode(ids.tolist())})
