"""The compute thread: the daemon's one thread for torch work (model load, prompt prefill, the
engine loop), so that torch keeps a single OpenMP team (zerolayer.engine.compute)."""

from __future__ import annotations

import threading
import time

import pytest

from zerolayer.engine.backends.synthetic import SyntheticBackend
from zerolayer.engine.compute import ComputeThread
from zerolayer.engine.engine import Engine, Sequence, StepOutput
from zerolayer.sampling_params import SamplingParams
from zerolayer.tokenizer import ByteTokenizer


def test_calls_run_in_order_on_one_thread_and_raise_in_the_caller():
    compute = ComputeThread("test-compute")
    try:
        seen: list[tuple[int, int]] = []
        futures = [
            compute.submit(lambda i=i: seen.append((i, threading.get_ident()))) for i in range(5)
        ]
        for f in futures:
            f.result(timeout=5)
        assert [i for i, _ in seen] == [0, 1, 2, 3, 4]
        assert {t for _, t in seen} == {compute.thread.ident}
        assert compute.thread.ident != threading.get_ident()
        assert compute.call(lambda a, b: a + b, 2, 3) == 5
        with pytest.raises(ZeroDivisionError):
            compute.call(lambda: 1 / 0)
        assert compute.call(lambda: "still running") == "still running"
    finally:
        compute.close()
    assert not compute.thread.is_alive()
    with pytest.raises(RuntimeError):
        compute.submit(lambda: None)


def test_engine_loop_runs_on_the_thread_that_built_the_backend():
    compute = ComputeThread("test-engine")
    backend = compute.call(lambda: SyntheticBackend(num_slots=4, vocab_size=300, max_context=256))
    builder = compute.call(threading.get_ident)
    done = threading.Event()
    loop_threads: set[int] = set()

    def deliver(step: StepOutput) -> None:
        loop_threads.add(threading.get_ident())
        if step.finished:
            done.set()

    engine = Engine(
        backend, ByteTokenizer(), deliver, max_queue=4, max_step_tokens=64, prefill_chunk=32
    )
    engine.start(compute)
    try:
        assert engine.alive
        engine.submit(Sequence("a", ByteTokenizer().encode_prompt("hi"), 8, SamplingParams()))
        assert done.wait(5)
        assert loop_threads == {builder}
    finally:
        engine.stop()
    assert not engine.alive
    deadline = time.monotonic() + 5
    while compute.thread.is_alive() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not compute.thread.is_alive()
