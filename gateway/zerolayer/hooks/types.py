"""The narrow types hooks exchange with the server: who is calling, what is asked, how it ended.

Error codes, finish reasons and the refusal type are zerolayer.codes' (defined once, re-exported
here) so that a hook module needs nothing but ``zerolayer.hooks`` to refuse a request.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from zerolayer.codes import ErrorCode, FinishReason, Refusal
from zerolayer.sampling_params import SamplingParams

UNAUTHENTICATED = ErrorCode.UNAUTHENTICATED
RATE_LIMITED = ErrorCode.RATE_LIMITED
INVALID_REQUEST = ErrorCode.INVALID_REQUEST
INTERNAL = ErrorCode.INTERNAL

# Completion.finish_reason values (DONE's finish_reason, plus ERROR for a stream that ended in
# an ERROR frame).
FINISH_EOS = FinishReason.EOS
FINISH_MAX_TOKENS = FinishReason.MAX_TOKENS
FINISH_STOP = FinishReason.STOP
FINISH_CANCELLED = FinishReason.CANCELLED
FINISH_ERROR = FinishReason.ERROR


#: Raised by a hook to refuse: ``HookError(code, message, retry_after_ms=0)``. It is the one
#: refusal type of every layer (zerolayer.codes.Refusal) under the name hooks have always used; the
#: server answers with an ERROR frame (or the HTTP API's error) carrying these fields.
HookError = Refusal


class HookConfigError(Exception):
    """The hook chain cannot be built; the message names the module or hook at fault."""


@dataclass(slots=True)
class Principal:
    """Who is calling. ``rpm``/``tpm`` None = fall back to the rate-limit defaults.

    ``key_id`` is set by the built-in auth hook (the key's SHA-256 hex digest) so that a key
    revoked by a reload stops working on connections that are already open. ``weight`` is the
    principal's part in the share of the engine's rows, ``principal_class`` the label its rows
    are counted under in the metrics (never the key's name): both from the keys file.
    """

    name: str
    rpm: int | None = None
    tpm: int | None = None
    key_id: str = ""
    weight: int = 1
    principal_class: str = "default"


@dataclass(slots=True)
class RequestContext:
    """One request, built by the server after validation and tokenization."""

    principal: Principal
    model: str
    prompt_ids: np.ndarray  # int32, after the chat template
    prompt_id: int  # precompiled system prompt id, 0 = none
    max_tokens: int
    sampling: SamplingParams  # temperature, top_p, top_k, seed (None = unseeded), penalties, ...
    stop_ids: tuple[int, ...]
    stop_sequences: tuple[str, ...]
    want_text: bool
    use_cache: bool = True  # False: the client asked to bypass the response cache
    state: dict[str, Any] = field(default_factory=dict)  # per-request scratch shared by the hooks


@dataclass(slots=True)
class CachedResponse:
    """A complete answer returned by on_request; the server replays it instead of running the
    engine and sets DONE's cache bit 0."""

    token_ids: np.ndarray  # int32, the stream's ids in order (read-only)
    text: str
    finish_reason: int  # 0 eos, 1 max_tokens, 2 stop
    prompt_tokens: int


@dataclass(slots=True)
class Completion:
    """How a request that passed on_request ended; given to every on_done hook."""

    finish_reason: int  # 0 eos, 1 max_tokens, 2 stop, 3 cancelled, -1 ended in ERROR
    prompt_tokens: int
    completion_tokens: int
    token_ids: np.ndarray | None = None  # int32; present when Chain.records is true
    text: str | None = None
    from_cache: bool = False
