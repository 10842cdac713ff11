"""The codes every layer shares, defined once: ERROR codes and how a stream finished.

Dependency-free on purpose: the protocol codec, the engine, the hooks, the doors, the metrics and
the CLI import these names instead of repeating numbers. docs/protocol.md is the wire contract
for their values.
"""

from __future__ import annotations

from enum import IntEnum


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

#: FinishReason.label of each reason, computed once (it is read once per request).
FINISH_LABELS: dict[int, str] = {r: r.name.lower() for r in FinishReason}

#: The finish reasons a DONE frame can carry, in wire order.
DONE_REASONS: tuple[FinishReason, ...] = (
    FinishReason.EOS,
    FinishReason.MAX_TOKENS,
    FinishReason.STOP,
    FinishReason.CANCELLED,
)
#: Finished with a complete answer (what a response cache may store).
COMPLETE_REASONS = frozenset({FinishReason.EOS, FinishReason.MAX_TOKENS, FinishReason.STOP})


def error_code(value: int) -> ErrorCode:
    """``value`` as an ErrorCode; a value outside the protocol's codes becomes INTERNAL."""
    try:
        return ErrorCode(value)
    except ValueError:
        return ErrorCode.INTERNAL
