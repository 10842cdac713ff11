"""The OpenAI API: Chat Completions and (legacy) Completions JSON in, ``Request`` + ``Reply`` out.

``parse_chat`` and ``parse_completion`` turn a request body into the door-neutral Request with
OpenAI's sampling defaults (temperature 1.0, top_p 1.0): penalties, ``logit_bias`` (string keys
→ ids), ``n``, logprobs, ``response_format`` or vLLM's ``structured_outputs`` as a
``Constraint``, and (chat) ``tools`` / ``tool_choice`` / ``parallel_tool_calls`` with the
history's calls and results; a forced tool choice becomes the request's constraint. Anything
that would change the result and is not supported is refused with a 400 naming the field
(``echo``, ``best_of`` > 1, ``suffix``, vLLM's removed ``guided_*`` fields, unknown fields).
vLLM-style extensions: ``top_k``, ``ignore_eos``, ``prompt_id`` (a registered system prompt),
``repetition_penalty``, ``min_tokens``, ``min_p``. The replies write ``chat.completion`` /
``text_completion`` objects with their n choices (tool calls, logprobs), or their ``chunk`` SSE
sequences ending in ``data: [DONE]``. ``models_body`` is the ``GET /v1/models`` list.
"""

from __future__ import annotations

import json
from abc import abstractmethod
from dataclasses import replace
from datetime import datetime, timezone
from typing import Any

from zerolayer import structured
from zerolayer.codes import FINISH_NAMES, OPENAI, FinishReason, invalid
from zerolayer.http import tools
from zerolayer.http.fields import (
    ROUTER_DEFAULTS,
    check_model,
    field_errors,
    refuse_router_fields,
    refuse_unless,
)
from zerolayer.http.json_body import dumps
from zerolayer.http.logprobs import (
    CompletionLogprobs,
    TokenLogprobs,
    TokenStrings,
    chat_entry,
    chat_entry_json,
)
from zerolayer.http.reply import ChoiceOut, Ending, Reply, encode_basestring, new_id, now
from zerolayer.http.tools import ArgumentsDelta, CallStart, Content, Event, ToolUse
from zerolayer.request_path.request import Request
from zerolayer.request_path.validation import (
    JsonObject,
    as_int,
    check_keys,
    get_bool,
    get_int,
    get_object,
    get_stops,
    get_text,
    get_text_parts,
    get_token_ids,
    load_object,
    present,
    range_of,
    read_common,
    refuse_range,
    validate,
)
from zerolayer.structured import Constraint

# Accepted because they do not change the result.
_NEUTRAL = ("user", "metadata", "store", "service_tier", "safety_identifier", "prompt_cache_key")
# vLLM's structured-output fields before 0.12: refused with a pointer to ``structured_outputs``.
_GUIDED = ("guided_json", "guided_regex", "guided_choice", "guided_grammar")
_SAMPLING = (
    "temperature", "top_p", "seed", "stop", "top_k", "ignore_eos", "prompt_id", "n",
    "presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias", "min_tokens",
    "min_p", "response_format", "structured_outputs", *_GUIDED,
)  # fmt: skip
_COMMON = (
    "model", "max_tokens", "stream", "stream_options", *_SAMPLING, *_NEUTRAL, *ROUTER_DEFAULTS,
)  # fmt: skip
CHAT_KEYS = frozenset(
    ("messages", "max_completion_tokens", "logprobs", "top_logprobs", "tools", "tool_choice",
     "parallel_tool_calls", *_COMMON)
)  # fmt: skip
COMPLETION_KEYS = frozenset(("prompt", "echo", "best_of", "suffix", "logprobs", *_COMMON))
COMPLETION_MAX_TOKENS_DEFAULT = 16  # OpenAI's documented default for /v1/completions
_STRUCTURED_KEYS = ("json", "regex", "choice", "json_object")

_FINISH = FINISH_NAMES[OPENAI]


def _refuse_unsupported(obj: JsonObject) -> None:
    refuse_router_fields(obj)
    for key in _GUIDED:
        refuse_unless(
            obj, key, False, f"removed in vLLM 0.12; use structured_outputs.{key[7:]} instead"
        )
    refuse_unless(obj, "best_of", obj.get("best_of") == 1, "only best_of = 1 is supported")
    refuse_unless(obj, "suffix", obj.get("suffix") == "", "suffix is not supported")


def _structured(obj: JsonObject) -> Constraint | None:
    """``response_format`` or vLLM's ``structured_outputs`` (json / regex / choice /
    json_object), at most one constraint."""
    found: list[Constraint] = []
    if "response_format" in obj:
        with field_errors():
            rf = structured.from_response_format(obj["response_format"])
        if rf is not None:
            found.append(rf)
    if "structured_outputs" in obj:
        so = get_object(obj["structured_outputs"], "structured_outputs")
        check_keys(so, _STRUCTURED_KEYS, "structured_outputs")
        if len(so) != 1:
            raise invalid(
                "structured_outputs must hold exactly one of json, regex, choice, json_object",
                "structured_outputs",
            )
        ((kind, value),) = so.items()
        where = f"structured_outputs.{kind}"
        with field_errors():
            if kind == "json":
                if isinstance(value, str):  # vLLM takes the schema as JSON text too
                    try:
                        value = json.loads(value)
                    except ValueError:
                        raise invalid(f"{where} is not valid JSON", where) from None
                found.append(Constraint.json_schema(value, where))
            elif kind == "regex":
                found.append(Constraint.regex(value, where))
            elif kind == "choice":
                found.append(Constraint.choice(value, where))
            elif value is True:
                found.append(Constraint.json_object(where))
            elif value is not False:
                raise invalid(f"{where} must be true or false", where)
    if len(found) > 1:
        raise invalid("give response_format or structured_outputs, not both", found[1].field)
    return found[0] if found else None


def _sampling(obj: JsonObject, req: Request) -> None:
    """The fields both endpoints share, read into ``req`` (the ones every door shares by
    ``read_common``, with OpenAI's temperature 1.0; their ranges: ``validate``)."""
    read_common(obj, req, temperature=1.0)
    req.ignore_eos = get_bool(obj, "ignore_eos")
    req.stop_sequences = get_stops(obj, "stop", allow_string=True)
    req.constraint = _structured(obj)


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


# ---------------------------------------------------------------------------- chat messages

_ROLES = ("system", "developer", "user", "assistant", "tool")
_MESSAGE_KEYS = {
    "system": ("role", "content", "name"),
    "developer": ("role", "content", "name"),
    "user": ("role", "content", "name"),
    "assistant": ("role", "content", "name", "tool_calls", "refusal"),
    "tool": ("role", "content", "tool_call_id", "name"),
}


def _call_history(value: object, where: str) -> list[dict[str, Any]]:
    """An assistant message's ``tool_calls``, with their arguments as objects."""
    if not isinstance(value, list):
        raise invalid(f"{where} must be a list", where)
    calls = []
    for j, call in enumerate(value):
        at = f"{where}[{j}]"
        call = get_object(call, at)
        check_keys(call, ("id", "type", "function"), at)
        if call.get("type", "function") != "function":
            raise invalid(f"{at}.type must be 'function'", f"{at}.type")
        fn = get_object(call.get("function"), f"{at}.function")
        check_keys(fn, ("name", "arguments"), f"{at}.function")
        name = get_text(fn.get("name"), f"{at}.function.name", allow_empty=False)
        args: Any = fn.get("arguments", "{}")
        if isinstance(args, str):
            try:
                args = json.loads(args) if args.strip() else {}
            except ValueError:
                where_args = f"{at}.function.arguments"
                raise invalid(f"{where_args} is not valid JSON", where_args) from None
        if not isinstance(args, dict):
            raise invalid(f"{at}.function.arguments must be a JSON object", f"{at}.function")
        call_id = call.get("id", f"call_{j}")
        calls.append(
            {
                "id": get_text(call_id, f"{at}.id"),
                "type": "function",
                "function": {"name": name, "arguments": args},
            }
        )
    return calls


def chat_messages(obj: JsonObject) -> tuple[list[dict[str, Any]], str | None]:
    """Chat messages for the template (zerolayer.http.tools' convention), and the system text:
    the leading system/developer messages; a later one stays in place as a ``system`` message
    (zerolayer.request_path.inputs renders it)."""
    messages = obj.get("messages")
    if not isinstance(messages, list) or not messages:
        raise invalid("messages must be a non-empty list", "messages")
    out: list[dict[str, Any]] = []
    system: list[str] = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        m = get_object(m, where)
        role = m.get("role")
        if role not in _ROLES:
            roles = ", ".join(_ROLES)
            raise invalid(f"{where}.role must be {roles}; got {role!r}", f"{where}.role")
        check_keys(m, _MESSAGE_KEYS[role], where)
        calls = _call_history(m["tool_calls"], f"{where}.tool_calls") if "tool_calls" in m else []
        if "content" not in m and not calls:
            raise invalid(f"{where}.content is required", f"{where}.content")
        text = get_text_parts(m.get("content", ""), f"{where}.content")
        if role in ("system", "developer"):
            if out:
                out.append({"role": "system", "content": text})
            else:
                system.append(text)
            continue
        message: dict[str, Any] = {"role": role, "content": text}
        if "name" in m:
            message["name"] = get_text(m["name"], f"{where}.name")
        if calls:
            message["tool_calls"] = calls
        if role == "tool":
            if "tool_call_id" not in m:
                raise invalid(f"{where}.tool_call_id is required", f"{where}.tool_call_id")
            message["tool_call_id"] = get_text(m["tool_call_id"], f"{where}.tool_call_id")
        out.append(message)
    if all(m["role"] == "system" for m in out):
        raise invalid("messages must hold at least one user or assistant message", "messages")
    return out, ("\n".join(system) if system else None)


def chat_tools(obj: JsonObject, req: Request) -> ToolUse | None:
    """``tools``, ``tool_choice`` and ``parallel_tool_calls``: the definitions go to the chat
    template (unless the choice is ``none``), a forced choice becomes the request's constraint."""
    parallel = get_bool(obj, "parallel_tool_calls", True)
    if "tools" not in obj:
        if obj.get("tool_choice", "none") != "none":
            raise invalid("tool_choice needs tools", "tool_choice")
        return None
    with field_errors():
        defined = tools.tools_from_openai(obj["tools"])
        choice = tools.choice_from_openai(obj.get("tool_choice"), defined)
        use = ToolUse(defined, choice, parallel)
        use.apply(req)
    return use


def parse_chat(body: bytes, served: str, strings: TokenStrings | None = None) -> ChatReply:
    """POST /v1/chat/completions."""
    obj = load_object(body)
    check_keys(obj, CHAT_KEYS)
    _refuse_unsupported(obj)
    model = check_model(obj, served)
    req = Request(max_tokens=_max_tokens(obj, None), want_text=True)
    _sampling(obj, req)
    req.messages, req.system = chat_messages(obj)
    use = chat_tools(obj, req)
    stream, include_usage = _stream_flags(obj)
    return ChatReply(validate(req), stream, model, include_usage, use, strings)


def parse_completion(
    body: bytes, served: str, strings: TokenStrings | None = None
) -> CompletionReply:
    """POST /v1/completions: the prompt as text or token ids (one prompt only)."""
    obj = load_object(body)
    check_keys(obj, COMPLETION_KEYS)
    _refuse_unsupported(obj)
    model = check_model(obj, served)
    req = Request(max_tokens=_max_tokens(obj, COMPLETION_MAX_TOKENS_DEFAULT), want_text=True)
    # The legacy logprobs is a number, the alternatives per token (OpenAI allows 5; up to
    # top_logprobs' 20 here, as vLLM), not the shared boolean.
    legacy_logprobs = obj.pop("logprobs", None)
    _sampling(obj, req)
    if legacy_logprobs is not None:  # how many alternatives per token, 0 = none
        k = as_int(legacy_logprobs, "logprobs")
        alternatives = range_of("top_logprobs")
        if not alternatives.holds(k):
            raise refuse_range("logprobs", k, alternatives)
        req.sampling = replace(req.sampling, logprobs=True, top_logprobs=k)
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
    req.echo = get_bool(obj, "echo")
    if req.echo:
        if req.prompt_id:
            raise invalid("echo returns the prompt sent; it cannot be a prompt_id", "echo")
        if req.sampling.logprobs:  # the prompt's tokens with theirs, as many alternatives
            req.prompt_logprobs = req.sampling.top_logprobs
    stream, include_usage = _stream_flags(obj)
    return CompletionReply(validate(req), stream, model, include_usage, None, strings)


# ------------------------------------------------------------------------------------ replies


def _usage(ending: Ending) -> JsonObject:
    return {
        "prompt_tokens": ending.prompt_tokens,
        "completion_tokens": ending.completion_tokens,
        "total_tokens": ending.prompt_tokens + ending.completion_tokens,
    }


class _OpenAIReply(Reply):
    """Shared by both endpoints: the chunk head, the usage chunk and ``[DONE]``."""

    __slots__ = ("id", "created", "include_usage", "_head", "_pre", "_post")

    api = OPENAI
    object_name = ""
    chunk_object = ""  # a streamed chunk's "object"
    id_prefix = ""
    # A token chunk's bytes before its JSON-encoded text (``% choice``), and after it.
    token_open = b""
    token_close = b""

    def __init__(
        self,
        req: Request,
        stream: bool,
        model: str,
        include_usage: bool,
        tools: ToolUse | None = None,
        strings: TokenStrings | None = None,
    ) -> None:
        super().__init__(req, stream, model, tools, strings)
        self.id = new_id(self.id_prefix)
        self.created = now()
        self.include_usage = include_usage
        # Every chunk starts with the same bytes up to its choice; only the delta text varies.
        self._head = (
            f'data: {{"id":"{self.id}","object":"{self.chunk_object}",'
            f'"created":{self.created},"model":{encode_basestring(model)},"choices":'
        ).encode()
        self._pre = [self._head + self.token_open % i for i in range(req.n)]  # by choice
        self._post = self.token_close
        self._setup()

    def _setup(self) -> None:
        """An endpoint's own state, after the shared part is set up (none by default)."""

    def token(self, out: bytearray, choice: int, text: str) -> None:
        out += self._pre[choice]
        out += encode_basestring(text).encode()
        out += self._post

    def _chunk(self, out: bytearray, choice: JsonObject) -> None:
        out += self._head
        out += b"["
        out += dumps(choice)
        out += b"]}\n\n"

    def _finish_name(self, c: ChoiceOut) -> str:
        assert c.ending is not None
        if c.calls is not None and c.calls.calls and c.ending.finish in _NATURAL:
            return "tool_calls"
        return _FINISH[c.ending.finish]

    @abstractmethod
    def _choice(self, c: ChoiceOut) -> JsonObject:
        """A choice of the non-streaming answer (chat: a message; completions: text)."""

    def body(self) -> bytes:
        obj = {
            "id": self.id,
            "object": self.object_name,
            "created": self.created,
            "model": self.model,
            "choices": [
                {"index": c.index, **self._choice(c), "finish_reason": self._finish_name(c)}
                for c in self.choices
            ],
            "usage": _usage(self.total()),
        }
        return dumps(obj)

    def tail(self, out: bytearray) -> None:
        if self.include_usage:
            out += self._head
            out += b"[],"
            out += dumps({"usage": _usage(self.total())})[1:]
            out += b"\n\n"
        out += b"data: [DONE]\n\n"


_NATURAL = (FinishReason.EOS, FinishReason.STOP)  # the answer ended by itself


class ChatReply(_OpenAIReply):
    """``chat.completion`` / ``chat.completion.chunk``."""

    __slots__ = ()
    object_name = "chat.completion"
    chunk_object = "chat.completion.chunk"
    id_prefix = "chatcmpl-"
    token_open = b'[{"index":%d,"delta":{"content":'
    token_close = b'},"logprobs":null,"finish_reason":null}]}\n\n'

    def start(self, out: bytearray, prompt_tokens: int) -> None:
        for i in range(self.req.n):
            out += self._head
            out += b'[{"index":%d,"delta":{"role":"assistant","content":""},' % i
            out += b'"logprobs":null,"finish_reason":null}]}\n\n'

    def delta(self, out: bytearray, choice: int, text: str, lp: TokenLogprobs | None) -> None:
        c = self.choices[choice]
        events: list[Event] = []
        if c.calls is not None:
            events = c.calls.feed(text)
        elif text:
            events = [Content(text)]
        self._events(out, choice, events, lp)

    def _events(
        self, out: bytearray, choice: int, events: list[Event], lp: TokenLogprobs | None
    ) -> None:
        logprobs = None  # the chunk's "logprobs" as JSON text: written once, in the first chunk
        if lp is not None:
            assert self.strings is not None
            logprobs = f'{{"content":[{chat_entry_json(self.strings, lp)}]}}'.encode()
        for e in events:
            if isinstance(e, Content):
                delta: JsonObject = {"content": e.text}
            elif isinstance(e, CallStart):
                fn = {"name": e.name, "arguments": ""}
                delta = {"tool_calls": [{"index": e.index, "id": e.id, "type": "function",
                                         "function": fn}]}  # fmt: skip
            elif isinstance(e, ArgumentsDelta):
                delta = {"tool_calls": [{"index": e.index, "function": {"arguments": e.text}}]}
            else:
                continue
            self._delta_chunk(out, choice, delta, logprobs)
            logprobs = None
        if logprobs is not None:  # a token with no text of its own yet
            self._delta_chunk(out, choice, {}, logprobs)

    def _delta_chunk(
        self, out: bytearray, choice: int, delta: JsonObject, logprobs: bytes | None
    ) -> None:
        """``_chunk`` of ``{"index", "delta", "logprobs", "finish_reason": null}`` with the
        logprobs given as JSON text."""
        out += self._head
        out += b'[{"index":%d,"delta":' % choice
        out += dumps(delta)
        out += b',"logprobs":'
        out += b"null" if logprobs is None else logprobs
        out += b',"finish_reason":null}]}\n\n'

    def end(self, out: bytearray, choice: int) -> None:
        c = self.choices[choice]
        if c.calls is not None:
            self._events(out, choice, c.calls.close(), None)
        out += self._head
        out += b'[{"index":%d,"delta":{},"logprobs":null,"finish_reason":"' % choice
        out += self._finish_name(c).encode()
        out += b'"}]}\n\n'

    def _choice(self, c: ChoiceOut) -> JsonObject:
        message: JsonObject = {"role": "assistant", "content": c.text}
        if c.calls is not None:
            content, calls = c.calls.result(c.text)
            c.calls.calls = len(calls)
            if calls:
                message["content"] = content or None
                message["tool_calls"] = [
                    {
                        "id": call.id,
                        "type": "function",
                        "function": {"name": call.name, "arguments": call.arguments},
                    }
                    for call in calls
                ]
        logprobs = None
        if self.req.sampling.logprobs:
            assert self.strings is not None
            logprobs = {"content": [chat_entry(self.strings, lp) for lp in c.logprobs]}
        return {"message": message, "logprobs": logprobs}


class CompletionReply(_OpenAIReply):
    """``text_completion`` (streamed as ``text_completion`` chunks, as OpenAI does)."""

    __slots__ = ("_logprobs",)
    object_name = "text_completion"
    chunk_object = "text_completion"  # as OpenAI streams completions (no ".chunk")
    id_prefix = "cmpl-"
    token_open = b'[{"index":%d,"text":'
    token_close = b',"logprobs":null,"finish_reason":null}]}\n\n'

    def _setup(self) -> None:
        self._logprobs: list[CompletionLogprobs] = []
        if self.req.sampling.logprobs:
            strings = self.strings
            assert strings is not None
            self._logprobs = [CompletionLogprobs(strings) for _ in range(self.req.n)]

    def _echo(self, c: ChoiceOut) -> tuple[str, CompletionLogprobs | None]:
        """The prompt as echoed (``echo``): its text (as sent, or its ids decoded) and, when
        asked, its tokens' logprobs (a fresh object; its ``offset`` is where the completion's
        offsets go on)."""
        req = self.req
        text = req.prompt_text
        if text is None:
            assert req.prompt_ids is not None and self.strings is not None
            text = self.strings.decode(req.prompt_ids)
        if not self._logprobs or c.prompt_ids is None:
            return text, None
        assert self.strings is not None
        lps = CompletionLogprobs(self.strings)
        lps.prompt(c.prompt_ids, c.prompt_logprobs)
        return text, lps

    def start(self, out: bytearray, prompt_tokens: int) -> None:
        """With ``echo``, each choice's first chunk is the prompt (and its logprobs)."""
        if not self.req.echo:
            return
        given = next((c for c in self.choices if c.prompt_ids is not None), self.choices[0])
        for c in self.choices:
            c.prompt_ids, c.prompt_logprobs = given.prompt_ids, given.prompt_logprobs
            text, echoed = self._echo(c)
            logprobs = None
            if echoed is not None:
                self._logprobs[c.index].offset = echoed.offset
                logprobs = echoed.body()
            self._chunk(out, {"index": c.index, "text": text, "logprobs": logprobs,
                              "finish_reason": None})  # fmt: skip

    def collect(self, choice: int, text: str, lp: TokenLogprobs | None) -> None:
        super().collect(choice, text, lp)
        if lp is not None:
            self._logprobs[choice].add(lp)

    def delta(self, out: bytearray, choice: int, text: str, lp: TokenLogprobs | None) -> None:
        logprobs = None
        if lp is not None:
            lps = self._logprobs[choice]
            lps.add(lp)
            logprobs = lps.body(len(lps.tokens) - 1)
        self._chunk(out, {"index": choice, "text": text, "logprobs": logprobs,
                          "finish_reason": None})  # fmt: skip

    def end(self, out: bytearray, choice: int) -> None:
        out += self._pre[choice]
        out += b'"","logprobs":null,"finish_reason":"'
        out += self._finish_name(self.choices[choice]).encode()
        out += b'"}]}\n\n'

    def _choice(self, c: ChoiceOut) -> JsonObject:
        logprobs = self._logprobs[c.index].body() if self._logprobs else None
        if not self.req.echo:
            return {"text": c.text, "logprobs": logprobs}
        text, echoed = self._echo(c)
        if echoed is not None and logprobs is not None:
            shift = echoed.offset
            logprobs["text_offset"] = [o + shift for o in logprobs["text_offset"]]
            prompt = echoed.body()
            logprobs = {k: prompt[k] + logprobs[k] for k in prompt}
        return {"text": text + c.text, "logprobs": logprobs}


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
