"""The Anthropic Messages API: ``/v1/messages`` JSON in, ``Request`` + ``Reply`` out.

``parse_messages`` reads ``system`` (a string or text blocks), ``messages`` (user/assistant, and
system anywhere; content as a string or blocks: text, an assistant's ``tool_use``, a user's
``tool_result``),
``tools`` and ``tool_choice`` (auto, any, tool, none; ``any`` and a named tool forced by the
grammar), ``max_tokens`` (required), ``stop_sequences``, ``temperature`` (default 1.0),
``top_p``, ``top_k``, ``min_p`` (an extension) and ``stream`` (their ranges are
zerolayer.request_path.validation's, the same as every door's); thinking, images and an assistant
prefill (a final assistant message) are refused with a 400 naming the field.
``parse_count_tokens`` reads the same conversation for ``/v1/messages/count_tokens``. The reply
writes the ``message`` object (text and ``tool_use`` blocks), or the event sequence message_start,
content_block_start, ping, content_block_delta (text_delta, or input_json_delta for a tool_use
block) ..., content_block_stop, message_delta, message_stop.
"""

from __future__ import annotations

import json
from typing import Any

from zerolayer.codes import ANTHROPIC, FINISH_NAMES, FinishReason, invalid
from zerolayer.http import tools
from zerolayer.http.fields import check_model, field_errors, refuse_unless
from zerolayer.http.json_body import dumps
from zerolayer.http.logprobs import TokenLogprobs
from zerolayer.http.reply import ChoiceOut, Reply, encode_basestring, new_id
from zerolayer.http.tools import ArgumentsDelta, CallStart, Content, Event, ToolUse
from zerolayer.request_path.request import Request
from zerolayer.request_path.validation import (
    JsonObject,
    check_keys,
    get_bool,
    get_int,
    get_object,
    get_stops,
    get_text,
    get_text_parts,
    load_object,
    read_common,
    validate,
)

_CONVERSATION = ("model", "messages", "system", "tools", "tool_choice", "thinking")
MESSAGES_KEYS = frozenset(
    (
        *_CONVERSATION,
        "max_tokens",
        "stop_sequences",
        "temperature",
        "top_p",
        "top_k",
        "min_p",  # an extension, as top_k is on the OpenAI API
        "stream",
        # Accepted because they do not change the result.
        "metadata",
        "service_tier",
    )
)
COUNT_TOKENS_KEYS = frozenset(_CONVERSATION)

_STOP_REASON = FINISH_NAMES[ANTHROPIC]
_NATURAL = (FinishReason.EOS, FinishReason.STOP)  # the answer ended by itself


def _result_text(value: object, where: str) -> str:
    """A tool_result's ``content``: a string or text blocks."""
    if value is None:
        return ""
    return get_text_parts(value, where)


def _blocks(m: JsonObject, where: str, names: dict[str, str]) -> list[dict[str, Any]]:
    """One Anthropic message as chat-template messages (zerolayer.http.tools' convention): an
    assistant's text and ``tool_use`` blocks as one message with its calls; a user's
    ``tool_result`` blocks as ``tool`` messages, then its text as a user message. ``names``
    maps the tool_use ids seen so far to their tool (a result names its tool)."""
    role, content = m["role"], m["content"]
    if isinstance(content, str):
        return [{"role": role, "content": get_text(content, f"{where}.content")}]
    if not isinstance(content, list):
        raise invalid(f"{where}.content must be a string or a list of blocks", f"{where}.content")
    texts: list[str] = []
    calls: list[dict[str, Any]] = []
    results: list[dict[str, Any]] = []
    for i, block in enumerate(content):
        at = f"{where}.content[{i}]"
        block = get_object(block, at)
        kind = block.get("type")
        if kind == "text":
            check_keys(block, ("type", "text", "cache_control", "citations"), at)
            texts.append(get_text(block.get("text"), f"{at}.text"))
        elif kind == "tool_use" and role == "assistant":
            check_keys(block, ("type", "id", "name", "input", "cache_control"), at)
            call_id = get_text(block.get("id"), f"{at}.id", allow_empty=False)
            name = get_text(block.get("name"), f"{at}.name", allow_empty=False)
            args = get_object(block.get("input", {}), f"{at}.input")
            names[call_id] = name
            calls.append(
                {"id": call_id, "type": "function", "function": {"name": name, "arguments": args}}
            )
        elif kind == "tool_result" and role == "user":
            check_keys(block, ("type", "tool_use_id", "content", "is_error", "cache_control"), at)
            call_id = get_text(block.get("tool_use_id"), f"{at}.tool_use_id", allow_empty=False)
            text = _result_text(block.get("content"), f"{at}.content")
            if get_bool(block, "is_error"):
                text = f"Error: {text}"
            result = {"role": "tool", "content": text, "tool_call_id": call_id}
            if call_id in names:
                result["name"] = names[call_id]
            results.append(result)
        else:
            raise invalid(f"{at}: content of type {kind!r} is not supported here", at)
    if role == "assistant":
        message: dict[str, Any] = {"role": "assistant", "content": "\n".join(texts)}
        if calls:
            message["tool_calls"] = calls
        return [message]
    if texts or not results:
        results.append({"role": "user", "content": "\n".join(texts)})
    return results


def _history(obj: JsonObject) -> tuple[list[dict[str, Any]], list[str]]:
    """The messages for the template, and the texts of the leading ``system`` messages (the
    SDK's SystemMessageParam: a string or text blocks). A later system message stays in place
    as a ``system`` message (zerolayer.request_path.inputs renders it)."""
    messages = obj.get("messages")
    if not isinstance(messages, list) or not messages:
        raise invalid("messages must be a non-empty list", "messages")
    out: list[dict[str, Any]] = []
    leading: list[str] = []
    names: dict[str, str] = {}
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        m = get_object(m, where)
        role = m.get("role")
        if role not in ("user", "assistant", "system"):
            roles = "user, assistant, system"
            raise invalid(f"{where}.role must be {roles}; got {role!r}", f"{where}.role")
        check_keys(m, ("role", "content"), where)
        if "content" not in m:
            raise invalid(f"{where}.content is required", f"{where}.content")
        if role == "system":
            text = get_text_parts(m["content"], f"{where}.content")
            if out:
                out.append({"role": "system", "content": text})
            else:
                leading.append(text)
            continue
        out += _blocks(m, where, names)
    if all(m["role"] == "system" for m in out):
        raise invalid("messages must hold at least one user or assistant message", "messages")
    if out[-1]["role"] == "assistant":
        where = f"messages[{len(messages) - 1}]"
        raise invalid(
            f"{where}: a final assistant message (prefill) is not supported; end with a user turn",
            where,
        )
    return out, leading


def _tools(obj: JsonObject, req: Request) -> ToolUse | None:
    """``tools`` and ``tool_choice``: the definitions go to the chat template (unless the choice
    is ``none``), a forced choice (``any``, a named ``tool``) becomes the request's constraint."""
    value = obj.get("tool_choice")
    if "tools" not in obj:
        if value is not None and not (isinstance(value, dict) and value.get("type") == "none"):
            raise invalid("tool_choice needs tools", "tool_choice")
        return None
    with field_errors():
        defined = tools.tools_from_anthropic(obj["tools"])
    parallel = True
    if isinstance(value, dict):
        check_keys(value, ("type", "name", "disable_parallel_tool_use"), "tool_choice")
        parallel = not get_bool(value, "disable_parallel_tool_use")
    with field_errors():
        choice = tools.choice_from_anthropic(value, defined)
        use = ToolUse(defined, choice, parallel)
        use.apply(req)
    return use


def _conversation(obj: JsonObject, served: str, req: Request) -> tuple[str, ToolUse | None]:
    """model, system, messages and tools into ``req``; returns the model name and the tools."""
    refuse_unless(
        obj,
        "thinking",
        obj.get("thinking") == {"type": "disabled"},
        "extended thinking is not supported",
    )
    model = check_model(obj, served)
    system = [get_text_parts(obj["system"], "system")] if "system" in obj else []
    req.messages, leading = _history(obj)
    req.system = "\n".join(t for t in system + leading if t) or None
    return model, _tools(obj, req)


def parse_messages(body: bytes, served: str) -> MessagesReply:
    """POST /v1/messages."""
    obj = load_object(body)
    check_keys(obj, MESSAGES_KEYS)
    if "max_tokens" not in obj:
        raise invalid("max_tokens is required", "max_tokens")
    req = Request(max_tokens=get_int(obj, "max_tokens", 0), want_text=True)
    read_common(obj, req, temperature=1.0)  # Anthropic's default; MESSAGES_KEYS limit the rest
    req.stop_sequences = get_stops(obj, "stop_sequences", allow_string=False)
    model, use = _conversation(obj, served, req)
    return MessagesReply(validate(req), get_bool(obj, "stream"), model, use)


def parse_count_tokens(body: bytes, served: str) -> Request:
    """POST /v1/messages/count_tokens: the conversation only (what its prompt would be)."""
    obj = load_object(body)
    check_keys(obj, COUNT_TOKENS_KEYS)
    req = Request(max_tokens=None, want_text=True)
    _conversation(obj, served, req)
    return validate(req)


def count_tokens_body(input_tokens: int) -> bytes:
    return b'{"input_tokens":%d}' % input_tokens


def _event(name: bytes, data: bytes) -> bytes:
    return b"event: %s\ndata: %s\n\n" % (name, data)


def _json_event(obj: JsonObject) -> bytes:
    return _event(obj["type"].encode(), dumps(obj))


_DELTA_PRE = _event(
    b"content_block_delta",
    b'{"type":"content_block_delta","index":0,"delta":{"type":"text_delta","text":',
)[:-2]  # the event up to its text; _DELTA_POST closes it
_DELTA_POST = b"}}\n\n"
_BLOCK_START = _event(
    b"content_block_start",
    b'{"type":"content_block_start","index":0,"content_block":{"type":"text","text":""}}',
)
_PING = _event(b"ping", b'{"type":"ping"}')
_BLOCK_STOP = _event(b"content_block_stop", b'{"type":"content_block_stop","index":0}')
_MESSAGE_STOP = _event(b"message_stop", b'{"type":"message_stop"}')


class MessagesReply(Reply):
    """``message`` / the Messages streaming events. With tools, the content blocks open as the
    answer needs them: a text block for text, a ``tool_use`` block per call with its input as
    ``input_json_delta`` pieces."""

    __slots__ = ("id", "_blocks", "_open", "_space")

    api = ANTHROPIC
    call_id_prefix = "toolu_"

    def __init__(
        self, req: Request, stream: bool, model: str, tools: ToolUse | None = None
    ) -> None:
        super().__init__(req, stream, model, tools)
        self.id = new_id("msg_")
        self._blocks = 0  # content blocks opened so far (streaming with tools)
        self._open = False  # a block is open
        self._space = ""  # whitespace held until text follows it (none opens a block alone)

    def _stop(self, c: ChoiceOut) -> tuple[str, str | None]:
        """(stop_reason, stop_sequence). Which stop string matched is known when the request
        path says so, or when the request had only one."""
        ending = c.ending
        assert ending is not None
        if c.calls is not None and c.calls.calls and ending.finish in _NATURAL:
            return "tool_use", None
        stop = None
        if ending.finish == FinishReason.STOP:
            stop = ending.stop_sequence
            if stop is None and len(self.req.stop_sequences) == 1:
                stop = self.req.stop_sequences[0]
        return _STOP_REASON[ending.finish], stop

    def _message(
        self,
        content: list[JsonObject],
        stop_reason: str | None,
        stop: str | None,
        usage: JsonObject,
    ) -> JsonObject:
        return {
            "id": self.id,
            "type": "message",
            "role": "assistant",
            "model": self.model,
            "content": content,
            "stop_reason": stop_reason,
            "stop_sequence": stop,
            "usage": usage,
        }

    def start(self, out: bytearray, prompt_tokens: int) -> None:
        usage = {"input_tokens": prompt_tokens, "output_tokens": 0}
        start = {"type": "message_start", "message": self._message([], None, None, usage)}
        out += _event(b"message_start", dumps(start))
        if self.plain:
            out += _BLOCK_START
        out += _PING

    def token(self, out: bytearray, choice: int, text: str) -> None:
        out += _DELTA_PRE
        out += encode_basestring(text).encode()
        out += _DELTA_POST

    def delta(self, out: bytearray, choice: int, text: str, lp: TokenLogprobs | None) -> None:
        calls = self.choices[0].calls
        assert calls is not None
        self._events(out, calls.feed(text))

    def _close_block(self, out: bytearray) -> None:
        if self._open:
            out += _json_event({"type": "content_block_stop", "index": self._blocks - 1})
            self._open = False

    def _events(self, out: bytearray, events: list[Event]) -> None:
        for e in events:
            if isinstance(e, Content):
                text = self._space + e.text
                if not self._open:
                    if not text.strip():
                        self._space = text
                        continue
                    text = text.lstrip() if not self._blocks else text
                    out += _json_event(
                        {"type": "content_block_start", "index": self._blocks,
                         "content_block": {"type": "text", "text": ""}}
                    )  # fmt: skip
                    self._blocks += 1
                    self._open = True
                self._space = ""
                delta = {"type": "text_delta", "text": text}
                out += _json_event(
                    {"type": "content_block_delta", "index": self._blocks - 1, "delta": delta}
                )
            elif isinstance(e, CallStart):
                self._close_block(out)
                self._space = ""
                block: JsonObject = {"type": "tool_use", "id": e.id, "name": e.name, "input": {}}
                out += _json_event(
                    {"type": "content_block_start", "index": self._blocks, "content_block": block}
                )
                self._blocks += 1
                self._open = True
            elif isinstance(e, ArgumentsDelta):
                delta = {"type": "input_json_delta", "partial_json": e.text}
                out += _json_event(
                    {"type": "content_block_delta", "index": self._blocks - 1, "delta": delta}
                )
            else:
                self._close_block(out)

    def end(self, out: bytearray, choice: int) -> None:
        c = self.choices[0]
        if self.plain:
            out += _BLOCK_STOP
        else:
            assert c.calls is not None
            self._events(out, c.calls.close())
            self._close_block(out)
        assert c.ending is not None
        reason, stop = self._stop(c)
        delta = {
            "type": "message_delta",
            "delta": {"stop_reason": reason, "stop_sequence": stop},
            "usage": {"output_tokens": c.ending.completion_tokens},
        }
        out += _event(b"message_delta", dumps(delta))
        out += _MESSAGE_STOP

    def body(self) -> bytes:
        c = self.choices[0]
        assert c.ending is not None
        content: list[JsonObject] = [{"type": "text", "text": c.text}]
        if c.calls is not None:
            text, calls = c.calls.result(c.text)
            c.calls.calls = len(calls)
            if calls:
                content = [{"type": "text", "text": text}] if text.strip() else []
                content += [
                    {
                        "type": "tool_use",
                        "id": call.id,
                        "name": call.name,
                        "input": json.loads(call.arguments),
                    }
                    for call in calls
                ]
        reason, stop = self._stop(c)
        usage = {
            "input_tokens": c.ending.prompt_tokens,
            "output_tokens": c.ending.completion_tokens,
        }
        return dumps(self._message(content, reason, stop, usage))
