"""The codes every layer shares, defined once: ERROR codes, how a stream finished, and the one
refusal type.

Dependency-free on purpose: the protocol codec, the engine, the hooks, the doors, the metrics and
the CLI import these names instead of repeating numbers. docs/protocol.md is the wire contract
for their values.
"""

from __future__ import annotations

from enum import IntEnum, IntFlag


class ErrorCode(IntEnum):
    """ERROR frame codes (docs/protocol.md)."""

    MALFORMED_FRAME = 1
    FRAME_TOO_LARGE = 2
    UNSUPPORTED_VERSION = 3
    UNAUTHENTICATED = 4
    RATE_LIMITED = 5
    OVERLOADED = 6
    INVALID_REQUEST = 7
    PROMPT_TOO_LONG = 8
    UNKNOWN_PROMPT = 9
    STREAM_IN_USE = 10
    TOO_MANY_STREAMS = 11
    IDLE_TIMEOUT = 12
    SHUTTING_DOWN = 13
    SLOW_CONSUMER = 14
    INTERNAL = 15


class FrameType(IntEnum):
    """Frame types (docs/protocol.md); the metrics count frames by these names."""

    REQUEST = 0x01
    TOKEN = 0x02
    DONE = 0x03
    PING = 0x04
    PONG = 0x05
    ERROR = 0x06
    CANCEL = 0x07
    HELLO = 0x08
    WELCOME = 0x09
    GOAWAY = 0x0A
    LOGPROBS = 0x0B  # version 2


class Cached(IntFlag):
    """Where a stream's answer came from, beyond the engine: DONE's cache bits on the wire."""

    RESPONSE = 0x01  # replayed from the response cache
    PROMPT = 0x02  # the prefix store supplied part of the prompt's KV


class FinishReason(IntEnum):
    """How a stream ended: DONE's finish_reason on the wire, plus ERROR (never on the wire: the
    stream ended with an ERROR frame instead of DONE)."""

    ERROR = -1
    EOS = 0
    MAX_TOKENS = 1
    STOP = 2
    CANCELLED = 3

    @property
    def label(self) -> str:
        """The lower-case name used in metrics, logs and the CLI ("eos", "max_tokens", ...)."""
        return FINISH_LABELS[self]


#: FinishReason by value: ``FINISH_BY_VALUE[v]`` is ``FinishReason(v)`` without the enum's call
#: machinery (read once per request).
FINISH_BY_VALUE: dict[int, FinishReason] = {int(r): r for r in FinishReason}

#: The API labels (metrics, logs, error shapes): the frame door's and the HTTP APIs'.
FRAMES = "frames"
OPENAI = "openai"
ANTHROPIC = "anthropic"
OLLAMA = "ollama"
APIS: tuple[str, ...] = (FRAMES, OPENAI, ANTHROPIC, OLLAMA)

#: Each finish reason's name in each API, the one table: ``FINISH_NAMES[api][reason]``. The
#: frame door's names are the labels of metrics, logs and the CLI ("eos", "max_tokens", ...);
#: OpenAI's ``finish_reason``, Anthropic's ``stop_reason`` and Ollama's ``done_reason`` follow
#: their APIs (a cancelled stream is never answered over HTTP: its client went away). The
#: Responses API is OpenAI's: its ``status`` is read from OpenAI's names.
FINISH_NAMES: dict[str, dict[int, str]] = {
    FRAMES: {r: r.name.lower() for r in FinishReason},
    OPENAI: {
        FinishReason.EOS: "stop",
        FinishReason.MAX_TOKENS: "length",
        FinishReason.STOP: "stop",
        FinishReason.CANCELLED: "stop",
    },
    ANTHROPIC: {
        FinishReason.EOS: "end_turn",
        FinishReason.MAX_TOKENS: "max_tokens",
        FinishReason.STOP: "stop_sequence",
        FinishReason.CANCELLED: "end_turn",
    },
    OLLAMA: {
        FinishReason.EOS: "stop",
        FinishReason.MAX_TOKENS: "length",
        FinishReason.STOP: "stop",
        FinishReason.CANCELLED: "stop",
    },
}

#: FinishReason.label of each reason (it is read once per request).
FINISH_LABELS: dict[int, str] = FINISH_NAMES[FRAMES]

#: The finish reasons a DONE frame can carry, in wire order.
DONE_REASONS: tuple[FinishReason, ...] = (
    FinishReason.EOS,
    FinishReason.MAX_TOKENS,
    FinishReason.STOP,
    FinishReason.CANCELLED,
)
#: Finished with a complete answer (what a response cache may store).
COMPLETE_REASONS = frozenset({FinishReason.EOS, FinishReason.MAX_TOKENS, FinishReason.STOP})


U32_MAX = 2**32 - 1


class Refusal(Exception):
    """One request refused, by any layer (validation, the input processor, a hook, the request
    path): its stream ends in ERROR and the connection goes on.

    ``code`` is the ErrorCode (a value outside the protocol's becomes INTERNAL, said in the
    message); ``field`` is the name of the field at fault when there is one, and ``message``
    names it (prefixed with ``"<field>: "`` when the text given does not): the HTTP door sends
    ``field`` as OpenAI's ``error.param``, Anthropic's error and the frame door's ERROR carry it
    in the message. ``retry_after_ms`` is the retry hint (u32 on the wire); ``reason`` a
    machine-readable detail for APIs that carry one (OpenAI's ``error.code``; the code's
    lower-case name when empty). The request path hands the Refusal itself to the door
    (``Door.write_error``), whichever layer refused; each door turns it into its wire form
    through one table: the frame door into an ERROR frame, the HTTP door through
    zerolayer.http.errors.STATUS. Hooks raise it under its documented name
    ``zerolayer.hooks.HookError``.
    """

    def __init__(
        self,
        code: int,
        message: str,
        retry_after_ms: int = 0,
        field: str | None = None,
        reason: str = "",
    ) -> None:
        super().__init__(message)
        self.code = error_code(code)
        if self.code != code:
            message = f"{message} (refused with unknown error code {code!r})"
        if field and field not in message:
            message = f"{field}: {message}"
        self.message = message
        self.retry_after_ms = min(max(0, int(retry_after_ms)), U32_MAX)
        self.field = field
        self.reason = reason or self.code.name.lower()

    def __repr__(self) -> str:
        return (
            f"Refusal({self.code.name}, {self.message!r}, retry_after_ms={self.retry_after_ms}"
            f"{f', field={self.field!r}' if self.field else ''})"
        )


def invalid(message: str, field: str | None = None, reason: str = "") -> Refusal:
    """An INVALID_REQUEST refusal naming ``field``."""
    return Refusal(ErrorCode.INVALID_REQUEST, message, field=field, reason=reason)


def error_code(value: int) -> ErrorCode:
    """``value`` as an ErrorCode; a value outside the protocol's codes becomes INTERNAL."""
    try:
        return ErrorCode(value)
    except ValueError:
        return ErrorCode.INTERNAL
