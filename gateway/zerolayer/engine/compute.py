"""The one thread that runs a daemon's model work: loading, prompt prefill, then the engine loop.

torch on CPU parallelises with OpenMP, and GNU OpenMP keeps a team of worker threads for every
thread that has started a parallel region. Once a process has more OpenMP threads than cores
(say, the main thread loaded the model and the engine thread then runs it), libgomp stops letting
idle workers spin and puts them to sleep between parallel regions, so every region pays a futex
wake-up: measured here, an elementwise op on a [256, 768] tensor took ~8 µs on the thread that
owned the only team and ~60 µs on a second thread once the first had a team too. Running every
torch call of the daemon on this single thread keeps one team.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, TypeVar

T = TypeVar("T")

_Job = tuple[Callable[..., Any], tuple[Any, ...], Future[Any]]


class ComputeThread:
    """Runs submitted calls one after another, in order, on one daemon thread."""

    def __init__(self, name: str = "zerolayer-engine") -> None:
        self._jobs: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self.thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self.thread.start()

    def submit(self, fn: Callable[..., T], *args: Any) -> Future[T]:
        """Queue ``fn(*args)``; its result or exception arrives in the returned future."""
        if not self.thread.is_alive():
            raise RuntimeError("the compute thread has stopped")
        future: Future[T] = Future()
        self._jobs.put((fn, args, future))
        return future

    def call(self, fn: Callable[..., T], *args: Any) -> T:
        """Run ``fn(*args)`` on the thread and wait for it; its exception is raised here."""
        return self.submit(fn, *args).result()

    def close(self, timeout: float = 10.0) -> None:
        """Finish the queued calls, then end the thread (waits up to ``timeout`` seconds)."""
        self._jobs.put(None)
        self.thread.join(timeout)

    def _loop(self) -> None:
        while (job := self._jobs.get()) is not None:
            fn, args, future = job
            if not future.set_running_or_notify_cancel():
                continue
            try:
                result = fn(*args)
            except BaseException as exc:  # handed to the caller, who decides
                future.set_exception(exc)
            else:
                future.set_result(result)
