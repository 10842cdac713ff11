"""The OpenAI Responses API: ``POST /v1/responses`` JSON in, ``Request`` + ``ResponsesReply`` out.

Stateless (``store: false``): ``input`` is the whole conversation — a string, or items:
messages (user, assistant, system, developer; text parts), ``function_call`` items (joined to
the assistant turn they follow) and ``function_call_output`` items (tool results); ``reasoning``
items are skipped (we never emit any). ``instructions`` and the leading system items are the
system prompt, a later system item stays in place (zerolayer.request_path.inputs).
``previous_response_id``, ``conversation``, ``prompt``, ``background`` and ``context_management``
are refused with a 400 naming the field. Function ``tools``, ``tool_choice``,
``parallel_tool_calls`` and ``max_tool_calls``, ``text.format`` (text, json_object, json_schema
through the grammar), ``max_output_tokens``, ``temperature``, ``top_p``, and logprobs through
``include: ["message.output_text.logprobs"]`` with ``top_logprobs``. Unknown fields are a 400.

The reply is one ``response`` object, or its typed SSE events (``event: <type>`` with
``sequence_number`` from 0) in the order the openai SDK's ``responses.stream()`` checks:
``response.created``, ``response.in_progress``, per output item ``response.output_item.added``
… ``response.output_item.done`` (a message's ``content_part`` and ``output_text`` events, a
function call's ``function_call_arguments`` events), then ``response.completed`` (or
``response.incomplete`` when ``max_output_tokens`` cut it) with the whole object. The streamed
and the whole answer come from the same items: the choice's text through its tool-call parser
(zerolayer.http.tools.OutputCalls) as events, each opening, growing and closing an item.
"""

from __future__ import annotations

import json
from typing import Any

from zerolayer.codes import OPENAI, FinishReason, invalid
from zerolayer.http import tools
from zerolayer.http.errors import HttpError
from zerolayer.http.fields import check_model, field_errors
from zerolayer.http.json_body import dumps
from zerolayer.http.logprobs import TokenLogprobs, TokenStrings, chat_entry
from zerolayer.http.reply import Reply, encode_basestring, new_id, now
from zerolayer.http.tools import ArgumentsDelta, CallEnd, CallStart, Content, Event, ToolUse
from zerolayer.ops.escape import client_text
from zerolayer.request_path.request import Request
from zerolayer.request_path.validation import (
    JsonObject,
    check_keys,
    get_bool,
    get_int,
    get_object,
    get_text,
    load_object,
    present,
    read_common,
    validate,
)
from zerolayer.structured import Constraint

# Accepted, no effect on the result (``store`` is answered false: nothing is stored).
_NEUTRAL = (
    "store", "metadata", "user", "safety_identifier", "prompt_cache_key", "prompt_cache_retention",
    "prompt_cache_options", "service_tier", "truncation", "include", "stream_options",
)  # fmt: skip
# State kept by OpenAI between requests: refused (send the whole conversation as input).
_STATEFUL = ("previous_response_id", "conversation", "prompt", "context_management")
RESPONSES_KEYS = frozenset(
    ("model", "input", "instructions", "max_output_tokens", "temperature", "top_p",
     "top_logprobs", "tools", "tool_choice", "parallel_tool_calls", "max_tool_calls", "text",
     "stream", "reasoning", "background", *_NEUTRAL, *_STATEFUL)
)  # fmt: skip
LOGPROBS_INCLUDE = "message.output_text.logprobs"
_TEXT_PARTS = ("input_text", "output_text", "refusal", "text")


def _refuse_stateful(obj: JsonObject) -> None:
    for key in _STATEFUL:
        if key in obj:
            raise invalid(
                f"{key}: responses are not stored (store: false); send the whole conversation"
                " as input",
                key,
                "unsupported_parameter",
            )
    if get_bool(obj, "background"):
        raise invalid("background: responses run in the foreground only", "background")
    reasoning = obj.get("reasoning")
    if reasoning is not None:
        reasoning = present(get_object(reasoning, "reasoning"))
        check_keys(reasoning, ("effort", "summary", "generate_summary"), "reasoning")
        if reasoning.get("effort", "none") != "none" or "summary" in reasoning:
            raise invalid("reasoning: the served model does not reason", "reasoning.effort")


def _text_of(content: Any, where: str) -> str:
    """A message's ``content``: a string, or text parts (joined with a newline); an image,
    file or audio part is a 400 naming it."""
    if isinstance(content, str):
        return get_text(content, where)
    if not isinstance(content, list):
        raise invalid(f"{where} must be a string or a list of parts", where)
    texts = []
    for j, part in enumerate(content):
        at = f"{where}[{j}]"
        part = get_object(part, at)
        if part.get("type") not in _TEXT_PARTS:
            raise invalid(f"{at}: content of type {part.get('type')!r} is not supported", at)
        key = "refusal" if part.get("type") == "refusal" else "text"
        texts.append(get_text(part.get(key, ""), f"{at}.{key}"))
    return "\n".join(texts)


def _arguments(value: Any, where: str) -> dict[str, Any]:
    text = get_text(value, where)
    try:
        args = json.loads(text) if text.strip() else {}
    except ValueError:
        raise invalid(f"{where} is not valid JSON", where) from None
    if not isinstance(args, dict):
        raise invalid(f"{where} must be a JSON object", where)
    return args


def _input(obj: JsonObject) -> tuple[list[dict[str, Any]], list[str]]:
    """``input`` as chat-template messages (zerolayer.http.tools' convention), and the texts of
    its leading system/developer items."""
    value = obj.get("input")
    if isinstance(value, str):
        return [{"role": "user", "content": get_text(value, "input")}], []
    if not isinstance(value, list) or not value:
        raise invalid("input must be a string or a non-empty list of items", "input")
    out: list[dict[str, Any]] = []
    leading: list[str] = []
    names: dict[str, str] = {}  # call_id → the function it called
    for i, item in enumerate(value):
        where = f"input[{i}]"
        item = present(get_object(item, where))
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                roles = "user, assistant, system, developer"
                raise invalid(f"{where}.role must be {roles}; got {role!r}", f"{where}.role")
            check_keys(item, ("type", "role", "content", "id", "status"), where)
            if "content" not in item:
                raise invalid(f"{where}.content is required", f"{where}.content")
            text = _text_of(item["content"], f"{where}.content")
            if role in ("system", "developer"):
                if out:
                    out.append({"role": "system", "content": text})
                else:
                    leading.append(text)
                continue
            out.append({"role": role, "content": text})
        elif kind == "function_call":
            check_keys(
                item, ("type", "call_id", "name", "arguments", "id", "status", "namespace"), where
            )
            call_id = get_text(item.get("call_id"), f"{where}.call_id", allow_empty=False)
            name = get_text(item.get("name"), f"{where}.name", allow_empty=False)
            args = _arguments(item.get("arguments", ""), f"{where}.arguments")
            names[call_id] = name
            call = {
                "id": call_id,
                "type": "function",
                "function": {"name": name, "arguments": args},
            }
            last = out[-1] if out else None
            if last is None or last["role"] != "assistant":
                last = {"role": "assistant", "content": ""}
                out.append(last)
            last.setdefault("tool_calls", []).append(call)
        elif kind == "function_call_output":
            check_keys(item, ("type", "call_id", "output", "id", "status"), where)
            call_id = get_text(item.get("call_id"), f"{where}.call_id", allow_empty=False)
            result = {
                "role": "tool",
                "content": _text_of(item.get("output", ""), f"{where}.output"),
                "tool_call_id": call_id,
            }
            if call_id in names:
                result["name"] = names[call_id]
            out.append(result)
        elif kind == "reasoning":
            continue  # a reasoning model's trace, sent back by agent loops: nothing to render
        else:
            raise invalid(f"{where}.type {kind!r} is not supported", f"{where}.type")
    if all(m["role"] == "system" for m in out):
        raise invalid("input must hold at least one user or assistant message", "input")
    return out, leading


def _format(obj: JsonObject) -> tuple[Constraint | None, JsonObject]:
    """``text``: its ``format`` as the request's constraint, and the ``text`` to answer with."""
    text = present(get_object(obj.get("text", {}), "text"))
    check_keys(text, ("format", "verbosity"), "text")
    if text.get("verbosity", "medium") != "medium":
        raise invalid("text.verbosity: only medium is supported", "text.verbosity")
    fmt = present(get_object(text.get("format", {"type": "text"}), "text.format"))
    kind = fmt.get("type")
    answer: JsonObject = {"format": fmt, "verbosity": "medium"}
    if kind == "text":
        check_keys(fmt, ("type",), "text.format")
        return None, answer
    if kind == "json_object":
        check_keys(fmt, ("type",), "text.format")
        return Constraint.json_object("text.format"), answer
    if kind == "json_schema":
        check_keys(fmt, ("type", "name", "schema", "strict", "description"), "text.format")
        get_text(fmt.get("name", ""), "text.format.name")
        with field_errors():
            if "schema" not in fmt:
                return Constraint.json_object("text.format"), answer
            return Constraint.json_schema(fmt["schema"], "text.format.schema"), answer
    raise invalid("text.format.type must be text, json_object or json_schema", "text.format.type")


def _tools(obj: JsonObject, req: Request) -> tuple[ToolUse | None, int]:
    """``tools``, ``tool_choice``, ``parallel_tool_calls``, ``max_tool_calls``: the definitions
    go to the chat template, a forced choice becomes the constraint (zerolayer.http.tools'
    one rule); and how many calls the answer may hold."""
    parallel = get_bool(obj, "parallel_tool_calls", True)
    most = get_int(obj, "max_tool_calls", 1 << 30)
    if most < 1:
        raise invalid("max_tool_calls must be at least 1", "max_tool_calls")
    if most == 1:
        parallel = False
    if "tools" not in obj or obj["tools"] == []:
        if obj.get("tool_choice", "none") not in ("none", "auto"):
            raise invalid("tool_choice needs tools", "tool_choice")
        return None, most
    with field_errors():
        defined = tools.tools_from_responses(obj["tools"])
        choice = tools.choice_from_responses(obj.get("tool_choice"), defined)
        use = ToolUse(defined, choice, parallel)
        use.apply(req)
    return use, most


def parse_responses(
    body: bytes, served: str, strings: TokenStrings | None = None
) -> ResponsesReply:
    """POST /v1/responses."""
    obj = load_object(body)
    check_keys(obj, RESPONSES_KEYS)
    _refuse_stateful(obj)
    model = check_model(obj, served)
    max_tokens = get_int(obj, "max_output_tokens", 0) if "max_output_tokens" in obj else None
    req = Request(max_tokens=max_tokens, want_text=True)
    include = obj.get("include", [])
    if not isinstance(include, list) or not all(isinstance(x, str) for x in include):
        raise invalid("include must be a list of strings", "include")
    sampling: JsonObject = {k: obj[k] for k in ("temperature", "top_p", "top_logprobs") if k in obj}
    if LOGPROBS_INCLUDE in include:
        sampling["logprobs"] = True
    elif "top_logprobs" in sampling:
        sampling["logprobs"] = True  # as OpenAI: top_logprobs asks for logprobs
    read_common(sampling, req, temperature=1.0)
    options = present(get_object(obj.get("stream_options", {}), "stream_options"))
    check_keys(options, ("include_obfuscation",), "stream_options")
    req.constraint, text = _format(obj)
    messages, leading = _input(obj)
    instructions = get_text(obj["instructions"], "instructions") if "instructions" in obj else ""
    req.messages = messages
    req.system = "\n".join(t for t in (instructions, *leading) if t) or None
    use, most = _tools(obj, req)
    echo: JsonObject = {
        "instructions": instructions or None,
        "max_output_tokens": max_tokens,
        "max_tool_calls": None if most == 1 << 30 else most,
        "parallel_tool_calls": use.parallel if use is not None else True,
        "temperature": req.sampling.temperature,
        "top_p": req.sampling.top_p,
        "top_logprobs": req.sampling.top_logprobs,
        "tool_choice": obj.get("tool_choice", "auto"),
        "tools": obj.get("tools", []),
        "text": text,
        "metadata": obj.get("metadata", {}),
    }
    reply = ResponsesReply(validate(req), get_bool(obj, "stream"), model, use, strings)
    reply.echo, reply.most_calls = echo, most
    return reply


# ------------------------------------------------------------------------------------ replies


class _Item:
    """One output item as it is written: a message (its text and logprobs) or a function call
    (its arguments)."""

    __slots__ = ("index", "obj", "parts", "logprobs")

    def __init__(self, index: int, obj: JsonObject) -> None:
        self.index = index
        self.obj = obj
        self.parts: list[str] = []
        self.logprobs: list[JsonObject] = []

    @property
    def text(self) -> str:
        return "".join(self.parts)


class ResponsesReply(Reply):
    """A ``response`` object, or its typed event sequence (module docstring). ``n`` is 1."""

    __slots__ = ("id", "created", "echo", "most_calls", "seq", "items", "_msg", "_call", "_pre")

    api = OPENAI

    def __init__(
        self,
        req: Request,
        stream: bool,
        model: str,
        tools: ToolUse | None = None,
        strings: TokenStrings | None = None,
    ) -> None:
        super().__init__(req, stream, model, tools, strings)
        self.id = new_id("resp_")
        self.created = now()
        self.echo: JsonObject = {}
        self.most_calls = 1 << 30
        self.seq = 0  # the next event's sequence_number
        self.items: list[_Item] = []
        self._msg: _Item | None = None  # the message item open for text
        self._call: _Item | None = None  # the function call item open for arguments
        self._pre = b""  # an open message's text delta event up to its sequence number

    # ------------------------------------------------------------------ the response object

    def _status(self) -> tuple[str, JsonObject | None]:
        ending = self.choices[0].ending
        if ending is None:
            return "in_progress", None
        if ending.finish == FinishReason.MAX_TOKENS:
            return "incomplete", {"reason": "max_output_tokens"}
        return "completed", None

    def _response(self, done: bool) -> JsonObject:
        status, incomplete = self._status() if done else ("in_progress", None)
        usage = None
        if done:
            total = self.total()
            usage = {
                "input_tokens": total.prompt_tokens,
                "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
                "output_tokens": total.completion_tokens,
                "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": total.prompt_tokens + total.completion_tokens,
            }
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created,
            "status": status,
            "background": False,
            "error": None,
            "incomplete_details": incomplete,
            "model": self.model,
            "output": [item.obj for item in self.items] if done else [],
            "usage": usage,
            "previous_response_id": None,
            "reasoning": {"effort": None, "summary": None},
            "store": False,
            "truncation": "disabled",
            "user": None,
            **self.echo,
        }

    # ------------------------------------------------------------------ items from events

    def _emit(self, out: bytearray, kind: str, fields: JsonObject) -> None:
        if self.stream:
            data = dumps({"type": kind, "sequence_number": self.seq, **fields})
            out += b"event: %s\ndata: %s\n\n" % (kind.encode(), data)
        self.seq += 1

    def _open_message(self, out: bytearray) -> _Item:
        self._close_call(out)
        obj: JsonObject = {
            "id": new_id("msg_"),
            "type": "message",
            "status": "in_progress",
            "role": "assistant",
            "content": [],
        }
        item = self._msg = _Item(len(self.items), obj)
        self.items.append(item)
        self._emit(out, "response.output_item.added", {"output_index": item.index, "item": obj})
        part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        where = {"item_id": obj["id"], "output_index": item.index, "content_index": 0}
        self._emit(out, "response.content_part.added", {**where, "part": part})
        self._pre = (
            b'event: response.output_text.delta\ndata: {"type":"response.output_text.delta",'
            b'"item_id":"%s","output_index":%d,"content_index":0,"sequence_number":'
            % (obj["id"].encode(), item.index)
        )
        return item

    def _text(self, out: bytearray, text: str, logprobs: list[JsonObject]) -> None:
        item = self._msg or self._open_message(out)
        item.parts.append(text)
        item.logprobs += logprobs
        if self.stream:
            out += self._pre
            out += b'%d,"delta":' % self.seq
            out += encode_basestring(text).encode()
            out += b',"logprobs":%s}\n\n' % (dumps(logprobs) if logprobs else b"[]")
        self.seq += 1

    def _close_message(self, out: bytearray) -> None:
        item = self._msg
        if item is None:
            return
        self._msg = None
        text, obj = item.text, item.obj
        where = {"item_id": obj["id"], "output_index": item.index, "content_index": 0}
        self._emit(
            out, "response.output_text.done", {**where, "text": text, "logprobs": item.logprobs}
        )
        part = {"type": "output_text", "text": text, "annotations": [], "logprobs": item.logprobs}
        self._emit(out, "response.content_part.done", {**where, "part": part})
        obj["status"] = "completed"
        obj["content"] = [part]
        self._emit(out, "response.output_item.done", {"output_index": item.index, "item": obj})

    def _start_call(self, out: bytearray, e: CallStart) -> None:
        self._close_message(out)
        self._close_call(out)
        obj: JsonObject = {
            "id": new_id("fc_"),
            "type": "function_call",
            "status": "in_progress",
            "call_id": e.id,
            "name": e.name,
            "arguments": "",
        }
        item = self._call = _Item(len(self.items), obj)
        self.items.append(item)
        self._emit(out, "response.output_item.added", {"output_index": item.index, "item": obj})

    def _arguments(self, out: bytearray, text: str) -> None:
        item = self._call
        if item is None or not text:
            return
        item.parts.append(text)
        fields = {"item_id": item.obj["id"], "output_index": item.index, "delta": text}
        self._emit(out, "response.function_call_arguments.delta", fields)

    def _close_call(self, out: bytearray) -> None:
        item = self._call
        if item is None:
            return
        self._call = None
        obj = item.obj
        obj["arguments"] = item.text
        obj["status"] = "completed"
        fields = {"item_id": obj["id"], "output_index": item.index, "arguments": item.text}
        self._emit(out, "response.function_call_arguments.done", {**fields, "name": obj["name"]})
        self._emit(out, "response.output_item.done", {"output_index": item.index, "item": obj})

    def _events(self, out: bytearray, events: list[Event], logprobs: list[JsonObject]) -> None:
        for e in events:
            if isinstance(e, Content):
                if e.text:
                    self._text(out, e.text, logprobs)
                    logprobs = []
            elif e.index >= self.most_calls:
                continue  # max_tool_calls: the calls after it are dropped
            elif isinstance(e, CallStart):
                self._start_call(out, e)
            elif isinstance(e, ArgumentsDelta):
                self._arguments(out, e.text)
            elif isinstance(e, CallEnd):
                self._close_call(out)
        if logprobs and self._msg is not None:  # a token with no text of its own yet
            self._msg.logprobs += logprobs

    def _entries(self, lp: TokenLogprobs | None) -> list[JsonObject]:
        if lp is None:
            return []
        assert self.strings is not None
        return [chat_entry(self.strings, lp)]

    # ------------------------------------------------------------------ Reply

    def start(self, out: bytearray, prompt_tokens: int) -> None:
        self._emit(out, "response.created", {"response": self._response(False)})
        self._emit(out, "response.in_progress", {"response": self._response(False)})

    def token(self, out: bytearray, choice: int, text: str) -> None:
        self._text(out, text, [])

    def delta(self, out: bytearray, choice: int, text: str, lp: TokenLogprobs | None) -> None:
        calls = self.choices[0].calls
        events: list[Event] = calls.feed(text) if calls is not None else [Content(text)]
        self._events(out, events, self._entries(lp))

    def end(self, out: bytearray, choice: int) -> None:
        calls = self.choices[0].calls
        if calls is not None:
            self._events(out, calls.close(), [])
        self._close_message(out)
        self._close_call(out)

    def tail(self, out: bytearray) -> None:
        response = self._response(True)
        kind = "response.incomplete" if response["status"] == "incomplete" else "response.completed"
        self._emit(out, kind, {"response": response})

    def body(self) -> bytes:
        c = self.choices[0]
        scratch = bytearray()  # not streamed: the same items, no events written
        entries = [e for lp in c.logprobs for e in self._entries(lp)]
        events: list[Event] = [Content(c.text)]
        if c.calls is not None:
            events = c.calls.feed(c.text) + c.calls.close()
        self._events(scratch, events, entries)
        self._close_message(scratch)
        self._close_call(scratch)
        return dumps(self._response(True))

    def error_event(self, err: HttpError) -> bytes:
        param = None if err.param is None else client_text(err.param)
        fields = {"code": err.code, "message": client_text(err.message), "param": param}
        data = dumps({"type": "error", "sequence_number": self.seq, **fields})
        self.seq += 1
        return b"event: error\ndata: %s\n\n" % data
