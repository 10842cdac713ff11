"""The OpenAI API: Chat Completions and (legacy) Completions JSON in, ``Request`` + ``Reply`` out.

``parse_chat`` and ``parse_completion`` turn a request body into the door-neutral Request with
OpenAI's sampling defaults (temperature 1.0, top_p 1.0), refusing with a 400 that names the
field anything that would change the result and is not supported (``n`` > 1, ``logprobs``,
``tools``, ``response_format``, penalties, ...). vLLM-style extensions: ``top_k``,
``ignore_eos``, ``prompt_id`` (a registered system prompt). The replies write
``chat.completion`` / ``text_completion`` objects, or their ``chunk`` SSE sequences ending in
``data: [DONE]``. ``models_body`` is the ``GET /v1/models`` list.
"""

from __future__ import annotations

from abc import abstractmethod
from datetime import datetime, timezone

from gateway.codes import FINISH_NAMES, OPENAI, invalid
from gateway.http.fields import ROUTER_DEFAULTS, check_model, refuse_router_fields, refuse_unless
from gateway.http.reply import Ending, Reply, dumps, encode_basestring, new_id, now
from gateway.request import Request
from gateway.validation import (
    JsonObject,
    check_keys,
    get_bool,
    get_float,
    get_int,
    get_messages,
    get_stops,
    get_text,
    get_token_ids,
    load_object,
    present,
    validate,
)

# Accepted because they do not change the result.
_NEUTRAL = ("user", "metadata", "store", "service_tier", "safety_identifier", "prompt_cache_key")
# Refused unless given their no-op value (checked in _refuse_unsupported).
_NOOP_CHECKED = (
    "frequency_penalty",
    "presence_penalty",
    "logit_bias",
    "logprobs",
    "top_logprobs",
    "tools",
    "tool_choice",
    "parallel_tool_calls",
    "response_format",
    "n",
)
_SAMPLING = ("temperature", "top_p", "seed", "stop", "top_k", "ignore_eos", "prompt_id")
_COMMON = (
    "model",
    "max_tokens",
    "stream",
    "stream_options",
    *_SAMPLING,
    *_NEUTRAL,
    *ROUTER_DEFAULTS,
)
CHAT_KEYS = frozenset(("messages", "max_completion_tokens", *_COMMON, *_NOOP_CHECKED))
COMPLETION_KEYS = frozenset(
    ("prompt", "echo", "best_of", "suffix", "n", "logprobs", "frequency_penalty",
     "presence_penalty", "logit_bias", *_COMMON)
)  # fmt: skip
COMPLETION_MAX_TOKENS_DEFAULT = 16  # OpenAI's documented default for /v1/completions

_FINISH = FINISH_NAMES[OPENAI]


def _refuse_unsupported(obj: JsonObject) -> None:
    refuse_router_fields(obj)
    refuse_unless(obj, "n", obj.get("n") == 1, "only n = 1 is supported")
    for key in ("frequency_penalty", "presence_penalty"):
        refuse_unless(obj, key, obj.get(key) == 0, "penalties are not supported (0 only)")
    refuse_unless(obj, "logit_bias", obj.get("logit_bias") == {}, "logit_bias is not supported")
    refuse_unless(obj, "logprobs", obj.get("logprobs") is False, "logprobs are not supported")
    refuse_unless(obj, "top_logprobs", obj.get("top_logprobs") == 0, "logprobs are not supported")
    refuse_unless(obj, "tools", obj.get("tools") == [], "tools are not supported")
    refuse_unless(obj, "tool_choice", obj.get("tool_choice") == "none", "tools are not supported")
    refuse_unless(
        obj,
        "parallel_tool_calls",
        isinstance(obj.get("parallel_tool_calls"), bool) and "tools" not in obj,
        "tools are not supported",
    )
    refuse_unless(
        obj,
        "response_format",
        obj.get("response_format") == {"type": "text"},
        "only plain text output is supported",
    )
    refuse_unless(obj, "echo", obj.get("echo") is False, "echo is not supported")
    refuse_unless(obj, "best_of", obj.get("best_of") == 1, "only best_of = 1 is supported")
    refuse_unless(obj, "suffix", obj.get("suffix") == "", "suffix is not supported")


def _sampling(obj: JsonObject, req: Request) -> None:
    """The fields both endpoints share, read into ``req`` (their ranges: ``validate``)."""
    req.temperature = get_float(obj, "temperature", 1.0)
    req.top_p = get_float(obj, "top_p", 1.0)
    req.top_k = get_int(obj, "top_k", 0)
    if "seed" in obj:
        req.seed = get_int(obj, "seed", 0)
    req.prompt_id = get_int(obj, "prompt_id", 0)
    req.ignore_eos = get_bool(obj, "ignore_eos")
    req.stop_sequences = get_stops(obj, "stop", allow_string=True)


def _stream_flags(obj: JsonObject) -> tuple[bool, bool]:
    """(stream, include_usage)."""
    stream = get_bool(obj, "stream")
    options = obj.get("stream_options")
    if options is None:
        return stream, False
    if not stream:
        raise invalid("stream_options is only allowed with stream: true", "stream_options")
    if not isinstance(options, dict):
        raise invalid("stream_options must be an object", "stream_options")
    options = present(options)
    check_keys(options, ("include_usage",), "stream_options")
    return stream, get_bool(options, "include_usage")


def _max_tokens(obj: JsonObject, default: int | None) -> int | None:
    """max_tokens / max_completion_tokens; when absent, ``default`` (None: whatever fits)."""
    values = {get_int(obj, k, 0) for k in ("max_completion_tokens", "max_tokens") if k in obj}
    if len(values) > 1:
        raise invalid("max_tokens and max_completion_tokens disagree", "max_tokens")
    return values.pop() if values else default


def _messages(obj: JsonObject) -> tuple[list[dict[str, str]], str | None]:
    """Chat messages for the template, and the system text (system/developer messages first)."""
    out: list[dict[str, str]] = []
    system: list[str] = []
    for role, text, where in get_messages(obj, ("system", "developer", "user", "assistant")):
        if role in ("system", "developer"):
            if out:
                raise invalid(f"{where}: system messages must come before the conversation", where)
            system.append(text)
        else:
            out.append({"role": role, "content": text})
    if not out:
        raise invalid("messages must hold at least one user or assistant message", "messages")
    return out, ("\n".join(system) if system else None)


def parse_chat(body: bytes, served: str) -> ChatReply:
    """POST /v1/chat/completions."""
    obj = load_object(body)
    check_keys(obj, CHAT_KEYS)
    _refuse_unsupported(obj)
    model = check_model(obj, served)
    req = Request(max_tokens=_max_tokens(obj, None), want_text=True)
    _sampling(obj, req)
    req.messages, req.system = _messages(obj)
    stream, include_usage = _stream_flags(obj)
    return ChatReply(validate(req), stream, model, include_usage)


def parse_completion(body: bytes, served: str) -> CompletionReply:
    """POST /v1/completions: the prompt as text or token ids (one prompt only)."""
    obj = load_object(body)
    check_keys(obj, COMPLETION_KEYS)
    _refuse_unsupported(obj)
    refuse_unless(obj, "logprobs", False, "logprobs are not supported")
    model = check_model(obj, served)
    req = Request(max_tokens=_max_tokens(obj, COMPLETION_MAX_TOKENS_DEFAULT), want_text=True)
    _sampling(obj, req)
    prompt = obj.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        req.prompt_text = get_text(prompt, "prompt")
    elif isinstance(prompt, list) and prompt:
        req.prompt_ids = get_token_ids(prompt, "prompt")
    elif isinstance(prompt, list):
        raise invalid("prompt must hold one string or one list of token ids", "prompt")
    else:
        raise invalid("prompt is required (a string or a list of token ids)", "prompt")
    if not req.prompt_text and req.prompt_ids is None and not req.prompt_id:
        raise invalid("empty prompt without a prompt_id", "prompt")
    stream, include_usage = _stream_flags(obj)
    return CompletionReply(validate(req), stream, model, include_usage)


# ------------------------------------------------------------------------------------ replies


def _usage(ending: Ending) -> JsonObject:
    return {
        "prompt_tokens": ending.prompt_tokens,
        "completion_tokens": ending.completion_tokens,
        "total_tokens": ending.prompt_tokens + ending.completion_tokens,
    }


class _OpenAIReply(Reply):
    """Shared by both endpoints: the chunk prefix, the usage chunk and ``[DONE]``."""

    __slots__ = ("id", "created", "include_usage", "_head", "_pre", "_post")

    api = OPENAI
    object_name = ""
    id_prefix = ""
    _pre: bytes  # a token chunk's bytes before its text, set by each endpoint's reply
    _post: bytes  # and after it

    def __init__(self, req: Request, stream: bool, model: str, include_usage: bool) -> None:
        super().__init__(req, stream, model)
        self.id = new_id(self.id_prefix)
        self.created = now()
        self.include_usage = include_usage
        # Every chunk starts with the same bytes up to its choice; only the delta text varies.
        self._head = (
            f'data: {{"id":"{self.id}","object":"{self.object_name}.chunk",'
            f'"created":{self.created},"model":{encode_basestring(model)},"choices":'
        ).encode()

    def token(self, out: bytearray, text: str) -> None:
        out += self._pre
        out += encode_basestring(text).encode()
        out += self._post

    @abstractmethod
    def _choice(self, text: str) -> JsonObject:
        """The choice object of a non-streaming answer (chat: a message; completions: text)."""

    def body(self, text: str, ending: Ending) -> bytes:
        choice = {
            "index": 0,
            **self._choice(text),
            "logprobs": None,
            "finish_reason": _FINISH[ending.finish],
        }
        obj = {
            "id": self.id,
            "object": self.object_name,
            "created": self.created,
            "model": self.model,
            "choices": [choice],
            "usage": _usage(ending),
        }
        return dumps(obj)

    def _tail(self, out: bytearray, ending: Ending) -> None:
        if self.include_usage:
            out += self._head
            out += b"[],"
            out += dumps({"usage": _usage(ending)})[1:]
            out += b"\n\n"
        out += b"data: [DONE]\n\n"


class ChatReply(_OpenAIReply):
    """``chat.completion`` / ``chat.completion.chunk``."""

    __slots__ = ()
    object_name = "chat.completion"
    id_prefix = "chatcmpl-"

    def __init__(self, req: Request, stream: bool, model: str, include_usage: bool) -> None:
        super().__init__(req, stream, model, include_usage)
        self._pre = self._head + b'[{"index":0,"delta":{"content":'
        self._post = b'},"logprobs":null,"finish_reason":null}]}\n\n'

    def start(self, out: bytearray, prompt_tokens: int) -> None:
        out += self._head
        out += b'[{"index":0,"delta":{"role":"assistant","content":""},'
        out += b'"logprobs":null,"finish_reason":null}]}\n\n'

    def end(self, out: bytearray, ending: Ending) -> None:
        out += self._head
        out += b'[{"index":0,"delta":{},"logprobs":null,"finish_reason":"'
        out += _FINISH[ending.finish].encode()
        out += b'"}]}\n\n'
        self._tail(out, ending)

    def _choice(self, text: str) -> JsonObject:
        return {"message": {"role": "assistant", "content": text}}


class CompletionReply(_OpenAIReply):
    """``text_completion`` (streamed as ``text_completion`` chunks, as OpenAI does)."""

    __slots__ = ()
    object_name = "text_completion"
    id_prefix = "cmpl-"

    def __init__(self, req: Request, stream: bool, model: str, include_usage: bool) -> None:
        super().__init__(req, stream, model, include_usage)
        # OpenAI streams completions with object "text_completion" (no ".chunk").
        self._head = self._head.replace(b'text_completion.chunk"', b'text_completion"', 1)
        self._pre = self._head + b'[{"index":0,"text":'
        self._post = b',"logprobs":null,"finish_reason":null}]}\n\n'

    def end(self, out: bytearray, ending: Ending) -> None:
        out += self._pre
        out += b'"","logprobs":null,"finish_reason":"'
        out += _FINISH[ending.finish].encode()
        out += b'"}]}\n\n'
        self._tail(out, ending)

    def _choice(self, text: str) -> JsonObject:
        return {"text": text}


def models_body(served: str, created: int) -> bytes:
    """GET /v1/models: one model, in a shape both SDKs read (OpenAI's list with Anthropic's
    ``type``/``display_name``/``created_at``/``lifecycle``/``has_more`` fields alongside)."""
    return dumps(
        {
            "object": "list",
            "data": [model_object(served, created)],
            "has_more": False,
            "first_id": served,
            "last_id": served,
        }
    )


def model_body(served: str, created: int) -> bytes:
    """GET /v1/models/{id}."""
    return dumps(model_object(served, created))


def model_object(served: str, created: int) -> JsonObject:
    return {
        "id": served,
        "object": "model",
        "created": created,
        "owned_by": "zerolayer",
        "type": "model",
        "display_name": served,
        "created_at": datetime.fromtimestamp(created, timezone.utc).isoformat(),
        "lifecycle": "active",
    }
