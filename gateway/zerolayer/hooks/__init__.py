"""Hooks: auth, rate limits, the response cache and custom hooks, linked into the daemon once.

The server builds one ``Chain`` at start-up and calls it per connection (``on_hello``) and per
request (``on_request`` / ``on_request_async``, then ``on_done``). See docs/hooks.md.
"""

from zerolayer.hooks.chain import BUILTIN_MODULES, Chain
from zerolayer.hooks.registry import STAGES, hook, hook_options
from zerolayer.hooks.types import (
    FINISH_CANCELLED,
    FINISH_EOS,
    FINISH_ERROR,
    FINISH_MAX_TOKENS,
    FINISH_STOP,
    INTERNAL,
    INVALID_REQUEST,
    RATE_LIMITED,
    UNAUTHENTICATED,
    CachedResponse,
    Completion,
    HookConfigError,
    HookError,
    Principal,
    RequestContext,
)

__all__ = [
    "BUILTIN_MODULES",
    "FINISH_CANCELLED",
    "FINISH_EOS",
    "FINISH_ERROR",
    "FINISH_MAX_TOKENS",
    "FINISH_STOP",
    "INTERNAL",
    "INVALID_REQUEST",
    "RATE_LIMITED",
    "STAGES",
    "UNAUTHENTICATED",
    "CachedResponse",
    "Chain",
    "Completion",
    "HookConfigError",
    "HookError",
    "Principal",
    "RequestContext",
    "hook",
    "hook_options",
]
