"""Engine-step (a diagnostic): the engine and the synthetic backend in this process on their own
thread, no server, 256 streams x 150 tokens of 16-id prompts at several step times: the engine
thread's CPU per step, back to back and paced, by kind of step; what parts of a steady step cost
(``ablations``: each left out of every other step, paired within a burst); and what single calls
cost right after a pause (``cold_call_cost``).

It drives the engine through its public interface only: the constructor's ``deliver`` and
``on_step`` callbacks (the daemon's own ``StepSink`` and ``Metrics.engine_step`` behind them),
``Engine.start`` on a ``ComputeThread`` it made, ``submit`` and ``steps``."""

from __future__ import annotations

import contextlib
import os
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator

from benchmarks._report import cpu_seconds, table
from benchmarks._support.daemon import child_preexec
from benchmarks._support.pump import VOCAB
from benchmarks.scenarios.common import SEEDS

NAME, KEY = "serving-engine-step", "engine_step"

STEP_KINDS = ("admitting", "ending", "steady")
# Parts of a steady step that engine_step_cost(skip=...) leaves out of every other step, each a
# callback the engine is built with: "deliver" (the hand-off of a step to the event loop: the
# daemon's StepSink, which sets the occupancy gauges and puts the step into the Outbox; a step
# that ends sequences is still handed over) or "on_step" (the per-backend-call metrics).
ABLATIONS = {"hand-off to the event loop": "deliver", "step metrics": "on_step"}
NOTHING = "nothing"  # skip=NOTHING: steps split by turns as for a part, none left out


def engine_step_cost(
    step_ms: float, streams: int = 256, tokens: int = 150, skip: str | None = None
) -> dict:
    """The engine thread's CPU per step for one burst, its outputs handed through the daemon's
    StepSink and Outbox to an event loop on a thread of its own, which drops them (no server);
    and by kind of step, the thread CPU from one hand-off to the next (a step's pause, work and
    the previous hand-off): "admitting" (a prefill ran in it: the admission ramp), "ending" (some
    sequence ended in it), "steady" (neither: the decode rows go on unchanged). With ``skip`` (an
    ABLATIONS key, or NOTHING) every other step leaves that part out, and the steady steps'
    median is kept apart for steps with it and without it: a difference paired within one burst,
    free of the host's drift between runs."""
    import numpy as np
    import uvloop

    from zerolayer.daemon import StepSink
    from zerolayer.engine.backends.synthetic import SyntheticBackend
    from zerolayer.engine.compute import ComputeThread
    from zerolayer.engine.engine import Engine, Sequence
    from zerolayer.engine.outbox import Outbox
    from zerolayer.engine.step import StepOutput
    from zerolayer.ops.metrics import Metrics
    from zerolayer.sampling_params import SamplingParams
    from zerolayer.tokenizer import ByteTokenizer

    finished = threading.Event()
    ended = [0]

    def consume(steps: list[StepOutput]) -> None:  # on the event loop
        for step in steps:
            ended[0] += len(step.finished)
        if ended[0] >= streams:
            finished.set()

    loop = uvloop.new_event_loop()
    loop_thread = threading.Thread(target=loop.run_forever, daemon=True)
    loop_thread.start()
    outbox = Outbox()
    outbox.attach(loop, consume)
    metrics = Metrics()
    backend = SyntheticBackend(streams, VOCAB, 2048, step_ms=step_ms)
    sink = StepSink(outbox, metrics, streams)
    left_out_part = ABLATIONS.get(skip or "")
    skipping = [False]  # whether the step under way leaves ``skip`` out
    left_out = [0]  # calls the stand-in took: 0 would mean the engine no longer makes this call
    prefilled = [False]  # whether the step under way ran a prefill
    kinds: dict[str, list[int]] = {kind: [] for kind in STEP_KINDS}
    steady_by_skip: dict[bool, list[int]] = {False: [], True: []}
    last = [0]

    def on_step(phase: str, seconds: float, batch: int) -> None:  # on the engine thread
        prefilled[0] = prefilled[0] or phase == "prefill"
        if skipping[0] and left_out_part == "on_step":
            left_out[0] += 1
            return
        metrics.engine_step(phase, seconds, batch)

    def deliver(step: StepOutput) -> None:  # on the engine thread, after each step
        now = time.thread_time_ns()
        if last[0]:
            kind = "admitting" if prefilled[0] else "ending" if step.finished else "steady"
            kinds[kind].append(now - last[0])
            if kind == "steady":
                steady_by_skip[skipping[0]].append(now - last[0])
        last[0] = now
        prefilled[0] = False
        # This hand-off counts (in time and in being skipped) with the next step, as it does in
        # that step's interval.
        skipping[0] = skip is not None and not skipping[0]
        if skipping[0] and left_out_part == "deliver" and not step.finished:
            left_out[0] += 1
            return
        sink(step)

    engine = Engine(
        backend,
        ByteTokenizer(VOCAB),
        deliver,
        max_queue=4 * streams,
        max_step_tokens=512,
        prefill_chunk=256,
        on_step=on_step,
    )
    sink.engine = engine
    compute = ComputeThread()
    engine.start(compute)
    try:
        time.sleep(0.1)
        tid = compute.thread.native_id
        assert tid is not None  # started
        rng = np.random.default_rng(next(SEEDS))
        cpu0, steps0 = cpu_seconds(os.getpid(), tid), engine.steps
        for i in range(streams):
            prompt = rng.integers(0, VOCAB, 16).astype(np.int32)
            engine.submit(Sequence(i, prompt, tokens, SamplingParams()))
        finished.wait(120)
        cpu, steps = cpu_seconds(os.getpid(), tid) - cpu0, engine.steps - steps0
    finally:
        outbox.close()
        engine.stop()
        loop.call_soon_threadsafe(loop.stop)
        loop_thread.join()
        loop.close()

    def median_us(ns: list[int]) -> float:
        return statistics.median(ns) / 1e3 if ns else 0.0

    return {
        "step_ms": step_ms,
        "steps": steps,
        "cpu_us_per_step": cpu / max(steps, 1) * 1e6,
        "steady_us_with": median_us(steady_by_skip[False]),
        "steady_us_without": median_us(steady_by_skip[True]),
        "left_out_calls": left_out[0],
        "kinds": {
            kind: {"steps": len(ns), "median_us": median_us(ns), "ms_per_burst": sum(ns) / 1e6}
            for kind, ns in kinds.items()
        },
    }


def ablations(runs: int) -> dict[str, dict[str, float]]:
    """At 20 ms, per ABLATIONS part (and NOTHING, where both halves keep everything: the
    pairing's own spread), the steady steps' median with the part and without it, medians over
    ``runs`` bursts, and their difference: what the part costs a steady step."""
    out = {}
    for name in (NOTHING, *ABLATIONS):
        rs = [engine_step_cost(20.0, skip=name) for _ in range(runs)]
        with_us = statistics.median(r["steady_us_with"] for r in rs)
        without_us = statistics.median(r["steady_us_without"] for r in rs)
        out[name] = {"with_us": with_us, "without_us": without_us, "cost_us": with_us - without_us}
    return out


def sleep_floor(pause_s: float, n: int = 150) -> float:
    """Thread CPU (µs, median of ``n``) of a thread that only sleeps ``pause_s`` per step: what
    waking from a backend call costs before any work."""
    sleep = "sleep"
    return cold_call_cost(0.0, calls=n, ops={sleep: lambda: time.sleep(pause_s)})[sleep]


# A busy loop pinned to one CPU at SCHED_IDLE priority, for at most argv[2] seconds; it prints an
# empty line once pinned and demoted.
SPINNER = (
    "import os, sys, time\n"
    "cpu, limit = int(sys.argv[1]), float(sys.argv[2])\n"
    "os.sched_setaffinity(0, {cpu})\n"
    "os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))\n"
    "print(flush=True)\n"
    "end = time.monotonic() + limit\n"
    "while time.monotonic() < end:\n"
    "    pass\n"
)


def can_keep_busy() -> bool:
    """Whether ``idle_spinner`` can run here: Linux, and at least 2 CPUs this process may use."""
    return hasattr(os, "SCHED_IDLE") and len(os.sched_getaffinity(0)) >= 2


@contextlib.contextmanager
def idle_spinner(cpu: int, limit_s: float) -> Iterator[None]:
    """A child process busy-looping on ``cpu`` at SCHED_IDLE priority while the block runs (and
    never longer than ``limit_s``): that CPU never idles, yet a thread waking on it preempts the
    spinner at once."""
    proc = subprocess.Popen(
        [sys.executable, "-c", SPINNER, str(cpu), str(limit_s)],
        stdout=subprocess.PIPE,
        text=True,
        preexec_fn=child_preexec(),
    )
    try:
        if proc.stdout.readline() != "\n" or os.sched_getscheduler(proc.pid) != os.SCHED_IDLE:
            raise RuntimeError("the SCHED_IDLE spinner did not start")
        yield
    finally:
        proc.kill()
        proc.wait()


def cold_call_cost(
    pause_s: float,
    calls: int = 60,
    keep_busy: bool = False,
    ops: dict[str, Callable[[], object]] | None = None,
) -> dict[str, float]:
    """Thread CPU (µs) of single calls on a thread of their own (by default a few the engine
    thread could make once per step), each measured right after ``pause_s`` of sleep (0: back
    to back), median over ``calls``: what a call costs on a thread that wakes from a backend
    call. With ``keep_busy`` the measuring thread is pinned to one CPU and an ``idle_spinner``
    runs there while it sleeps: a call that then costs what it does back to back pays, after a
    plain sleep, for the CPU waking from idle (its caches cold after the host ran something
    else), not for its own working set."""
    import numpy as np

    a = np.arange(256, dtype=np.int32)
    if ops is None:
        ops = {
            "nothing (the clock read alone)": lambda: None,
            "numpy ufunc: (a == 2).any() on 256 int32": lambda: bool((a == 2).any()),
            "numpy ufunc: a + 1 on 256 int32": lambda: a + 1,
            "a.tolist() and a list search": lambda: 2 in a.tolist(),
            "Python loop over 256 ints": lambda: sum(range(256)),
        }
    out: dict[str, float] = {}
    cpu = max(os.sched_getaffinity(0)) if keep_busy else -1

    def body() -> None:
        if keep_busy:
            os.sched_setaffinity(0, {cpu})  # this thread only
        for name, op in ops.items():
            times = []
            for _ in range(calls):
                if pause_s:
                    time.sleep(pause_s)
                t0 = time.thread_time_ns()
                op()
                times.append(time.thread_time_ns() - t0)
            out[name] = statistics.median(times) / 1e3

    with contextlib.ExitStack() as stack:
        if keep_busy:  # started from this thread: child_preexec ties it to the main thread
            stack.enter_context(idle_spinner(cpu, len(ops) * calls * (pause_s + 0.01) + 30))
        thread = threading.Thread(target=body)
        thread.start()
        thread.join()
    return out


def run(args) -> dict:
    runs = {ms: [engine_step_cost(ms) for _ in range(args.runs)] for ms in (0.0, 1.0, 5.0, 20.0)}
    return {
        "steps": {
            str(ms): {
                "steps": statistics.median(r["steps"] for r in rs),
                "cpu_us_per_step": statistics.median(r["cpu_us_per_step"] for r in rs),
            }
            for ms, rs in runs.items()
        },
        # At the paced scenario's 20 ms: each kind's figures, median over runs.
        "kinds_20ms": {
            kind: {
                key: statistics.median(r["kinds"][kind][key] for r in runs[20.0])
                for key in ("steps", "median_us", "ms_per_burst")
            }
            for kind in STEP_KINDS
        },
        "sleep_floor_20ms_us": sleep_floor(0.02),
        "ablations_20ms": ablations(args.runs),
        "cold_calls": {
            "back_to_back": cold_call_cost(0.0),
            "after_20ms": cold_call_cost(0.02),
            # None where the CPU cannot be kept busy (not Linux, or a single CPU).
            "after_20ms_busy": cold_call_cost(0.02, keep_busy=True) if can_keep_busy() else None,
        },
    }


def markdown(r: dict, args) -> str:
    rows = [
        [f"{float(ms):g}", f"{v['steps']:.0f}", f"{v['cpu_us_per_step']:.0f}"]
        for ms, v in r["steps"].items()
    ]
    cold = r["cold_calls"]
    busy = cold["after_20ms_busy"]
    call_rows = [
        [
            name,
            f"{us:.1f}",
            f"{cold['after_20ms'][name]:.1f}",
            f"{busy[name]:.1f}" if busy else "n/a (needs Linux and 2 CPUs)",
        ]
        for name, us in cold["back_to_back"].items()
    ]
    kind_rows = [
        [kind, f"{k['steps']:.0f}", f"{k['median_us']:.0f}", f"{k['ms_per_burst']:.1f}"]
        for kind, k in r["kinds_20ms"].items()
    ]
    part_rows = [
        [name, f"{a['with_us']:.0f}", f"{a['without_us']:.0f}", f"{a['cost_us']:+.0f}"]
        for name, a in r["ablations_20ms"].items()
    ]
    return (
        "## Engine thread CPU per step, back to back and paced (diagnostic)\n\n"
        "`python benchmarks/serving.py --scenario engine-step` — the engine and the synthetic "
        "backend in the benchmark's process on their own thread, no server (outputs handed "
        "through the daemon's Outbox to an event loop thread that drops them), "
        "one burst of 256 streams x 150 tokens with 16-id prompts; CPU of the engine thread "
        f"(schedstat) per step, median of {args.runs} runs. The work per step is the same at "
        "every step time; what changes is the pause before it.\n\n"
        + table(["step time ms", "steps", "engine thread CPU µs / step"], rows)
        + "\n\nAt 20 ms by kind of step (thread CPU from one hand-off to the next, so a "
        "step's pause and the previous hand-off included; steps and ms per burst are medians "
        "over runs): admitting steps ran a prefill (the admission ramp), ending steps ended "
        "some sequence, steady steps did neither. A thread that only sleeps "
        f"20 ms a step costs {r['sleep_floor_20ms_us']:.0f} µs a step (median of 150): the "
        "floor of any step after a backend call.\n\n"
        + table(["kind of step", "steps / burst", "median µs / step", "ms / burst"], kind_rows)
        + "\n\nWhat parts of a steady step cost at 20 ms, paired within each burst: every other "
        "step leaves the part out (the hand-off of a step that ends no sequence; the step's "
        "metrics call), and the steady steps' median with it "
        "is set against the median without it, both medians over "
        f"{args.runs} bursts. The first row leaves nothing out: its difference is the pairing's "
        "own spread.\n\n"
        + table(
            ["left out of every other step", "steady step with it µs", "without it µs", "cost µs"],
            part_rows,
        )
        + "\n\nWhy the pause matters: single calls on a thread of their own, thread CPU "
        "(`time.thread_time_ns`) of one call, median of 60, back to back and right after a "
        "20 ms sleep (as the engine thread runs after a 20 ms backend call); the last column "
        "sleeps 20 ms too, but with the measuring thread pinned to one CPU and, pinned to the "
        "same CPU, a child process busy-looping at SCHED_IDLE priority, so the CPU never idles "
        "while the thread sleeps yet the thread preempts the spinner as soon as it wakes: where a "
        "call costs there about what it costs back to back, its cost after a plain sleep is the "
        "CPU waking from idle (caches cold after the host ran something else), not the thread's "
        "own working set.\n\n"
        + table(
            ["call", "back to back µs", "after 20 ms µs", "after 20 ms, CPU kept busy µs"],
            call_rows,
        )
    )
