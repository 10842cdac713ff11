"""The one thread pool that takes tokenizing and templating of large inputs off the event loop.

A request whose prompt text is above ``INLINE_BYTES`` is prepared (chat template, tokenizer) on
one of ``WORKERS`` threads while its stream waits (zerolayer.request_path.lifecycle: phase
PREPARING); smaller ones are prepared inline, where a thread hop would cost more than the work. The
pool is small and bounded: the text bound (zerolayer.request_path.inputs) caps each job, and a flood
of large requests queues here instead of on the loop. Its threads are daemon-lifetime and idle when
unused. A thread frees the loop only while it does not hold the GIL: the Hugging Face tokenizer
encodes a large text through ``encode_batch``, which releases it
(gateway/zerolayer/models/hf_tokenizer.py); a chat template (jinja, Python) gives the loop its turn
at the interpreter's switch interval (5 ms).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

INLINE_BYTES = 16 * 1024  # prompt text up to this many UTF-8 bytes is prepared on the loop
WORKERS = 2

_T = TypeVar("_T")
_pool: ThreadPoolExecutor | None = None


def run(fn: Callable[..., _T], *args: object) -> asyncio.Future[_T]:
    """``fn(*args)`` on the pool, as a future of the running loop."""
    global _pool
    if _pool is None:
        _pool = ThreadPoolExecutor(WORKERS, thread_name_prefix="zerolayer-tokenize")
    return asyncio.get_running_loop().run_in_executor(_pool, fn, *args)
