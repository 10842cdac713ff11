"""What one API request becomes once its body is read: the door-neutral ``Request`` plus a
``Reply`` that writes the answer in the API's format.

A Reply is made per request by the API module (openai.py, anthropic.py) and never parses
anything: the door calls ``start`` once the prompt is known, ``token`` per text delta, and
``end`` at the end (streaming), or ``body`` once (non-streaming). Streaming methods append to
the connection's write buffer; the per-token path only JSON-escapes the text delta between byte
strings built once per request.
"""

from __future__ import annotations

import itertools
import json
import os
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass
from json.encoder import encode_basestring  # the C escaper: "text" -> '"text"' (non-ASCII kept)

from gateway.request import Request

__all__ = ["Ending", "Reply", "dumps", "encode_basestring", "new_id", "now"]

_ID_PREFIX = os.urandom(6).hex()
_ID_COUNTER = itertools.count(1)


def dumps(obj: object) -> bytes:
    """Compact UTF-8 JSON (responses are not per token: the stdlib encoder is enough)."""
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode()


def new_id(prefix: str) -> str:
    """A response id unique in this process and unlikely across processes."""
    return f"{prefix}{_ID_PREFIX}{next(_ID_COUNTER):08x}"


def now() -> int:
    return int(time.time())


@dataclass(slots=True)
class Ending:
    """How a stream ended: the numbers every API reports."""

    finish: int  # FinishReason
    prompt_tokens: int
    completion_tokens: int
    cached_prompt: bool = False  # a precompiled system prompt's KV was reused
    stop_sequence: str | None = None  # the stop string that matched, when known


class Reply(ABC):
    """The answer to one request. ``stream`` picks SSE events or one JSON body."""

    __slots__ = ("req", "stream", "model")

    api = ""  # "openai" or "anthropic": error shapes and metrics labels
    content_type = b"application/json"

    def __init__(self, req: Request, stream: bool, model: str) -> None:
        self.req = req
        self.stream = stream
        self.model = model

    def start(self, out: bytearray, prompt_tokens: int) -> None:  # noqa: B027 - optional
        """The events before the first token (streaming); none by default."""

    @abstractmethod
    def token(self, out: bytearray, text: str) -> None:
        """One text delta as an event (streaming); never called with empty text."""

    @abstractmethod
    def end(self, out: bytearray, ending: Ending) -> None:
        """The closing events (streaming)."""

    @abstractmethod
    def body(self, text: str, ending: Ending) -> bytes:
        """The whole response object (non-streaming)."""
