"""What one API request becomes once its body is read: the door-neutral ``Request`` plus a
``Reply`` that writes the answer in the API's format.

A Reply is made per request by the API module (openai.py, anthropic.py) and never parses a
request: the door calls ``start`` once the prompt is known, ``write`` per text delta of a
choice, ``end`` as each choice ends and ``tail`` after the last (streaming), or ``collect`` per
delta and ``body`` once (non-streaming). Each choice's text goes through its tool-call parser
(zerolayer.http.tools.OutputCalls) when the request defined tools. Streaming methods append to the
connection's write buffer; a plain answer's per-token path only JSON-escapes the text delta
between byte strings built once per request.
"""

from __future__ import annotations

import itertools
import os
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass
from json.encoder import encode_basestring  # the C escaper: "text" -> '"text"' (non-ASCII kept)
from typing import TYPE_CHECKING

import numpy as np

from zerolayer.engine.types import PromptLogprobs
from zerolayer.http.json_body import dumps
from zerolayer.http.logprobs import TokenLogprobs, TokenStrings
from zerolayer.http.tools import OutputCalls, ToolUse
from zerolayer.request_path.request import Request

if TYPE_CHECKING:
    from zerolayer.http.errors import HttpError

__all__ = ["ChoiceOut", "Ending", "Reply", "dumps", "encode_basestring", "new_id", "now"]

_ID_PREFIX = os.urandom(6).hex()
_ID_COUNTER = itertools.count(1)


def new_id(prefix: str) -> str:
    """A response id unique in this process and unlikely across processes."""
    return f"{prefix}{_ID_PREFIX}{next(_ID_COUNTER):08x}"


def now() -> int:
    return int(time.time())


@dataclass(slots=True)
class Ending:
    """How a stream (one choice) ended: the numbers every API reports."""

    finish: int  # FinishReason
    prompt_tokens: int
    completion_tokens: int
    cached_prompt: bool = False  # a precompiled system prompt's KV was reused
    stop_sequence: str | None = None  # the stop string that matched, when known
    # (queue_s, ttft_s, total_s) from the request's arrival, as the request path measured them
    timings: tuple[float, float, float] | None = None


class ChoiceOut:
    """One choice of an answer as it is written: its text and logprobs so far (non-streaming),
    its tool-call parser, and its ending once it has one."""

    __slots__ = ("index", "parts", "logprobs", "calls", "ending", "prompt_ids", "pooled",
                 "prompt_logprobs")  # fmt: skip

    def __init__(self, index: int, calls: OutputCalls | None) -> None:
        self.index = index
        self.parts: list[str] = []
        self.logprobs: list[TokenLogprobs] = []
        self.calls = calls
        self.ending: Ending | None = None
        # Its prompt's outputs (zerolayer.engine.sequence), given by the door when the request
        # asked (echo, an embedding) before the first event or the ending: the prompt's ids,
        # the embedding, the logprobs of each prompt id after the first.
        self.prompt_ids: np.ndarray | None = None
        self.pooled: np.ndarray | None = None
        self.prompt_logprobs: PromptLogprobs | None = None

    @property
    def text(self) -> str:
        return "".join(self.parts)


class Reply(ABC):
    """The answer to one request: ``req.n`` choices, ``stream`` picks SSE events or one JSON
    body. ``tools`` (when the request defined tools) parses each choice's text into calls;
    ``strings`` names logprobs' tokens (when the request asked for logprobs).

    The door calls, per choice: ``write`` (streaming) or ``collect`` (not) with each text delta
    and the token's logprobs when asked, then ``finish`` with its ending; streaming, ``start``
    once before the first event and ``end`` per choice, ``tail`` after the last; not streaming,
    ``body`` once every choice ended."""

    __slots__ = ("req", "stream", "model", "tools", "strings", "choices", "left", "plain")

    api = ""  # zerolayer.codes.APIS: error shapes and metrics labels
    content_type = b"application/json"
    stream_type = b"text/event-stream"  # a streamed answer's (Ollama's: NDJSON)
    call_id_prefix = "call_"

    def __init__(
        self,
        req: Request,
        stream: bool,
        model: str,
        tools: ToolUse | None = None,
        strings: TokenStrings | None = None,
    ) -> None:
        self.req = req
        self.stream = stream
        self.model = model
        self.tools = tools
        self.strings = strings
        prefix = self.call_id_prefix
        self.choices = [
            ChoiceOut(i, tools.output(prefix) if tools is not None else None) for i in range(req.n)
        ]
        self.left = req.n  # choices not ended yet
        # Text deltas only: the per-token path writes prebuilt bytes around the escaped text.
        self.plain = not req.sampling.logprobs and all(c.calls is None for c in self.choices)

    def collect(self, choice: int, text: str, lp: TokenLogprobs | None) -> None:
        """A delta of a non-streamed answer."""
        out = self.choices[choice]
        if text:
            out.parts.append(text)
        if lp is not None:
            out.logprobs.append(lp)

    def finish(self, choice: int, ending: Ending) -> bool:
        """Choice ``choice`` ended; True when it was the last one."""
        self.choices[choice].ending = ending
        self.left -= 1
        return self.left == 0

    def total(self) -> Ending:
        """The request's numbers: the prompt once, the choices' tokens summed."""
        endings = [c.ending for c in self.choices if c.ending is not None]
        first = endings[0]
        return Ending(
            first.finish,
            first.prompt_tokens,
            sum(e.completion_tokens for e in endings),
            first.cached_prompt,
            first.stop_sequence,
            first.timings,
        )

    def start(self, out: bytearray, prompt_tokens: int) -> None:  # noqa: B027 - optional
        """The events before the first token (streaming); none by default."""

    def write(self, out: bytearray, choice: int, text: str, lp: TokenLogprobs | None) -> None:
        """A delta of a streamed answer: plain text through ``token``, else ``delta``."""
        if self.plain:
            self.token(out, choice, text)
        else:
            self.delta(out, choice, text, lp)

    @abstractmethod
    def token(self, out: bytearray, choice: int, text: str) -> None:
        """One text delta as an event (streaming, ``plain``); never called with empty text."""

    @abstractmethod
    def delta(self, out: bytearray, choice: int, text: str, lp: TokenLogprobs | None) -> None:
        """A text delta through the choice's tool-call parser, with its token's logprobs."""

    @abstractmethod
    def end(self, out: bytearray, choice: int) -> None:
        """The closing events of one choice (streaming), after its ``finish``."""

    def tail(self, out: bytearray) -> None:  # noqa: B027 - optional
        """After the last choice's ``end`` (streaming)."""

    def named(self, err: HttpError) -> HttpError:
        """A refusal of the request path as this API names its fields (a door whose body is
        read into another API's fields renames them back); the same error by default."""
        return err

    def error_event(self, err: HttpError) -> bytes | None:
        """The in-stream error event, when this reply writes its own (the Responses API
        numbers its events); None: the API's (zerolayer.http.errors.stream_error_event)."""
        return None

    @abstractmethod
    def body(self) -> bytes:
        """The whole response object (non-streaming), once every choice ended."""
