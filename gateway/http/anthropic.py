"""The Anthropic Messages API: ``/v1/messages`` JSON in, ``Request`` + ``Reply`` out.

``parse_messages`` reads ``system`` (a string or text blocks), ``messages`` (user/assistant,
content as a string or text blocks), ``max_tokens`` (required), ``stop_sequences``,
``temperature`` (default 1.0), ``top_p``, ``top_k`` and ``stream`` (their ranges are
gateway.validation's, the same as every door's); tools, thinking, images and
an assistant prefill (a final assistant message) are refused with a 400 naming the field.
``parse_count_tokens`` reads the same conversation for ``/v1/messages/count_tokens``. The reply
writes the ``message`` object, or the event sequence message_start, content_block_start, ping,
content_block_delta (text_delta) ..., content_block_stop, message_delta, message_stop.
"""

from __future__ import annotations

from gateway.codes import ANTHROPIC, FINISH_NAMES, FinishReason, invalid
from gateway.http.fields import check_model, refuse_unless
from gateway.http.reply import Ending, Reply, dumps, encode_basestring, new_id
from gateway.request import Request
from gateway.validation import (
    check_keys,
    get_bool,
    get_float,
    get_int,
    get_messages,
    get_stops,
    get_text_parts,
    load_object,
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
        "stream",
        # Accepted because they do not change the result.
        "metadata",
        "service_tier",
    )
)
COUNT_TOKENS_KEYS = frozenset(_CONVERSATION)

_STOP_REASON = FINISH_NAMES[ANTHROPIC]


def _conversation(obj: dict, served: str, req: Request) -> str:
    """model, system and messages into ``req``; returns the model name."""
    refuse_unless(obj, "tools", obj.get("tools") == [], "tools are not supported")
    refuse_unless(
        obj, "tool_choice", obj.get("tool_choice") == {"type": "none"}, "tools are not supported"
    )
    refuse_unless(
        obj,
        "thinking",
        obj.get("thinking") == {"type": "disabled"},
        "extended thinking is not supported",
    )
    model = check_model(obj, served)
    if "system" in obj:
        req.system = get_text_parts(obj["system"], "system") or None
    out = [
        {"role": role, "content": text}
        for role, text, _ in get_messages(obj, ("user", "assistant"))
    ]
    if out[-1]["role"] != "user":
        where = f"messages[{len(out) - 1}]"
        raise invalid(
            f"{where}: a final assistant message (prefill) is not supported; end with a user turn",
            where,
        )
    req.messages = out
    return model


def parse_messages(body: bytes, served: str) -> MessagesReply:
    """POST /v1/messages."""
    obj = load_object(body)
    check_keys(obj, MESSAGES_KEYS)
    if "max_tokens" not in obj:
        raise invalid("max_tokens is required", "max_tokens")
    req = Request(
        max_tokens=get_int(obj, "max_tokens", 0),
        temperature=get_float(obj, "temperature", 1.0),
        top_p=get_float(obj, "top_p", 1.0),
        top_k=get_int(obj, "top_k", 0),
        stop_sequences=get_stops(obj, "stop_sequences", allow_string=False),
        want_text=True,
    )
    model = _conversation(obj, served, req)
    return MessagesReply(validate(req), get_bool(obj, "stream"), model)


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
    """``message`` / the Messages streaming events."""

    __slots__ = ("id",)

    api = ANTHROPIC

    def __init__(self, req: Request, stream: bool, model: str) -> None:
        super().__init__(req, stream, model)
        self.id = new_id("msg_")

    def _stop(self, ending: Ending) -> tuple[str, str | None]:
        """(stop_reason, stop_sequence). Which stop string matched is known when the request
        path says so, or when the request had only one."""
        stop = None
        if ending.finish == FinishReason.STOP:
            stop = ending.stop_sequence
            if stop is None and len(self.req.stop_sequences) == 1:
                stop = self.req.stop_sequences[0]
        return _STOP_REASON[ending.finish], stop

    def _message(self, content: list, stop_reason: str | None, stop: str | None, usage: dict):
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
        out += _BLOCK_START
        out += _PING

    def token(self, out: bytearray, text: str) -> None:
        out += _DELTA_PRE
        out += encode_basestring(text).encode()
        out += _DELTA_POST

    def end(self, out: bytearray, ending: Ending) -> None:
        reason, stop = self._stop(ending)
        delta = {
            "type": "message_delta",
            "delta": {"stop_reason": reason, "stop_sequence": stop},
            "usage": {"output_tokens": ending.completion_tokens},
        }
        out += _BLOCK_STOP
        out += _event(b"message_delta", dumps(delta))
        out += _MESSAGE_STOP

    def body(self, text: str, ending: Ending) -> bytes:
        reason, stop = self._stop(ending)
        usage = {"input_tokens": ending.prompt_tokens, "output_tokens": ending.completion_tokens}
        message = self._message([{"type": "text", "text": text}], reason, stop, usage)
        return dumps(message)
