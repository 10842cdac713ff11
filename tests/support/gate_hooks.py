"""A hook module for tests of the request path: an async on_request that waits on a gate (so a
test can act while the hooks run), can answer from a scripted "cache" or refuse, and an on_done
that records every Completion. Reset with ``reset()`` before each test."""

from __future__ import annotations

import asyncio
from typing import Any

from zerolayer.hooks import CachedResponse, Completion, HookError, hook

GATE: asyncio.Event | None = None
ANSWER: Any = None  # a CachedResponse (or anything, to make the replay fail), or a HookError
DONE: list[Completion] = []
STARTED = 0


def reset() -> None:
    global GATE, ANSWER, STARTED
    GATE, ANSWER, STARTED = None, None, 0
    DONE.clear()


@hook("on_request")
async def gate(ctx: Any) -> CachedResponse | None:
    global STARTED
    STARTED += 1
    if GATE is not None:
        await GATE.wait()
    if isinstance(ANSWER, HookError):
        raise ANSWER
    return ANSWER


@hook("on_done")
def record(ctx: Any, result: Completion) -> None:
    DONE.append(result)
