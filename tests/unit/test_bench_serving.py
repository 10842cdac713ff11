"""The serving benchmark's helpers (benchmarks/scenarios/, benchmarks/_support/pump.py): the
round-robin order and paired ratios of the interleaved paced scenarios, the open loop's arrival
rate, and the SCHED_IDLE spinner of the cold-call diagnostic."""

from __future__ import annotations

import os

import pytest

from benchmarks.scenarios import common
from benchmarks.scenarios.common import paired_ratio, rotations
from benchmarks.scenarios.engine_step import can_keep_busy, idle_spinner


def test_rotations_lead_with_each_item_in_turn():
    assert rotations(["pump", "a", "b"], 4) == [
        ["pump", "a", "b"],
        ["a", "b", "pump"],
        ["b", "pump", "a"],
        ["pump", "a", "b"],
    ]
    assert rotations(["only"], 2) == [["only"], ["only"]]
    assert rotations(["pump", "a"], 0) == []


def test_rotations_of_server_length_pairs_keep_each_length_together():
    units = [(name, t) for t in (50, 150) for name in ("pump", "z")]
    assert rotations(units, 2)[1] == [("z", 50), ("pump", 150), ("z", 150), ("pump", 50)]


def test_paired_ratio_is_the_median_of_per_round_ratios():
    # The pump drifts 1.0 -> 2.0 -> 1.5 between rounds; ZeroLayer tracks it at 1.2x, 1.3x, 1.1x.
    pump = [1.0, 2.0, 1.5]
    zerolayer = [1.2, 2.6, 1.65]
    median, ratios = paired_ratio(zerolayer, pump)
    assert ratios == pytest.approx([1.2, 1.3, 1.1])
    assert median == pytest.approx(1.2)
    # The ratio of medians mixes rounds: 1.65 / 1.5 = 1.1, not the paired 1.2.
    assert median != pytest.approx(sorted(zerolayer)[1] / sorted(pump)[1])
    even, _ = paired_ratio([2.0, 3.0], [1.0, 1.0])
    assert even == pytest.approx(2.5)


def test_paired_ratio_rejects_unpaired_runs():
    with pytest.raises(ValueError):
        paired_ratio([1.0, 2.0], [1.0])
    with pytest.raises(ValueError):
        paired_ratio([], [])


@pytest.mark.skipif(not can_keep_busy(), reason="needs Linux and 2 CPUs")
def test_idle_spinner_runs_pinned_at_idle_priority_and_always_dies():
    cpu = max(os.sched_getaffinity(0))
    before = _children()
    with pytest.raises(KeyError), idle_spinner(cpu, 30):
        new = _children() - before
        assert len(new) == 1
        (pid,) = new
        assert os.sched_getscheduler(pid) == os.SCHED_IDLE
        assert os.sched_getaffinity(pid) == {cpu}
        raise KeyError("the block fails")
    assert not os.path.exists(f"/proc/{pid}")  # killed and reaped


def _children() -> set[int]:
    """Child processes started by this process's main thread (as ``idle_spinner`` is here)."""
    me = os.getpid()
    with open(f"/proc/{me}/task/{me}/children") as fh:
        return {int(c) for c in fh.read().split()}


@pytest.mark.parametrize("threaded", [False, True])
def test_paced_pumps_serve_every_token_and_done(threaded: bool):
    """Both paced pumps, the loop's timer or a thread pacing (``Ticker``), answer a small
    burst in full: every stream gets all its tokens and its DONE."""
    import asyncio

    from benchmarks._support.pump import Floor
    from zerolayer.client.bench import BenchOptions, run

    with Floor(2.0, threaded=threaded) as floor:
        opts = BenchOptions(
            endpoint=floor.endpoint, concurrency=6, num_requests=12, input_len="4",
            output_len="5", connections=2, text_deltas=False, seed=1, request_timeout=30,
        )  # fmt: skip
        report = asyncio.run(run(opts))
    assert report["completed"] == 12 and report["failed"] == 0
    assert report["total_output_tokens"] == 12 * 5


@pytest.mark.parametrize("skip", [None, "nothing", "hand-off to the event loop", "step metrics"])
def test_engine_step_burst_ends_whatever_part_every_other_step_leaves_out(skip):
    """The engine-step diagnostic's burst runs to its end with a part left out of every other
    step (outputs that end sequences are still handed over), the part really is left out (the
    engine still makes the callback's calls), and the steady steps
    split into the two halves it compares only when asked to."""
    from benchmarks.scenarios.engine_step import engine_step_cost

    r = engine_step_cost(0.0, streams=8, tokens=40, skip=skip)
    assert r["steps"] >= 40
    assert r["kinds"]["steady"]["steps"] > 20
    assert r["steady_us_with"] > 0
    assert (r["steady_us_without"] > 0) == (skip is not None)
    assert (r["left_out_calls"] > 10) == (skip not in (None, "nothing"))


def test_sleep_floor_measures_a_thread_that_sleeps():
    from benchmarks.scenarios.engine_step import sleep_floor

    assert sleep_floor(0.001, n=5) > 0


def test_open_load_keeps_the_intended_share_of_slots_busy():
    """Little's law: arrivals per second x a stream's life (tokens x step) = streams in flight."""

    class Args:
        step_ms, paced_prompt_len = 20.0, 16

    load = common.open_load(Args(), tokens=150)
    in_flight = load["request_rate"] * 150 * Args.step_ms / 1e3
    assert in_flight == pytest.approx(common.OPEN_FILL * common.PACED_STREAMS)
    assert load["num_requests"] == common.OPEN_REQUESTS
    assert load["output_len"] == "150" and load["input_len"] == "16"
    assert "concurrency" not in load  # an open loop: arrivals are not held back by completions
