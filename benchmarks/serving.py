"""Serving-layer cost and tail latency: ZeroLayer vs no-logic uvloop servers, one scenario a run.

Every server runs as its own process on loopback (ZeroLayer: benchmarks/_support/daemon.py; the
floor and the paced pumps: benchmarks/_support/pump.py); the load comes from `zerolayer bench`'s
Python API (zerolayer.client.bench) in this process, with token-id prompts and no text deltas.
Server CPU = the server's threads' run time (/proc/PID/task/*/schedstat, nanoseconds) across the
load. Each scenario is a module of benchmarks/scenarios/ with its own results file and docs section:

- flat: flat out against the floor server (``scenarios.flat``);
- paced: at a model's pace, a burst against the paced pumps (``scenarios.paced``);
- paced-open: the burst against random (Poisson) arrivals (``scenarios.paced_open``);
- paced-split: CPU per step and per request (diagnostic, ``scenarios.paced_split``);
- paced-instructions: the same in callgrind instructions (``scenarios.paced_instructions``);
- engine-step: the engine thread alone, in process (diagnostic, ``scenarios.engine_step``).

The paced scenarios interleave: every server is started first (all alive at once; an idle one
costs next to nothing), warmed up once, then each round runs every load once, the order rotated
round by round; a ratio to the pump is taken within each round and the median taken over rounds
(benchmarks/scenarios/common.py).

    python benchmarks/serving.py [--scenario both|flat|paced|paced-open|paced-split|
                                  paced-instructions|engine-step] [--write]
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks._report import RESULTS, machine, machine_line, parser, publish  # noqa: E402
from benchmarks.scenarios import (  # noqa: E402
    engine_step,
    flat,
    paced,
    paced_instructions,
    paced_open,
    paced_split,
)

SCENARIOS = {
    "flat": flat,
    "paced": paced,
    "paced-open": paced_open,
    "paced-split": paced_split,
    "paced-instructions": paced_instructions,
    "engine-step": engine_step,
}
BOTH = ("flat", "paced")  # --scenario both (the default)


def main() -> None:
    ap = parser(__doc__.splitlines()[0])
    ap.add_argument("--scenario", choices=("both", *SCENARIOS), default="both")
    ap.add_argument("--streams", type=int, default=64, help="flat: concurrent streams")
    ap.add_argument("--tokens", type=int, default=256, help="flat: tokens per stream")
    ap.add_argument("--runs", type=int, default=3, help="flat, engine-step: measured runs")
    ap.add_argument("--rounds", type=int, default=30, help="flat: requests = streams x rounds")
    ap.add_argument("--step-ms", type=float, default=20.0, help="paced: engine step time")
    ap.add_argument(
        "--prefill-us-per-token",
        type=float,
        default=0.0,
        help="paced: added to a step's pause per prefill token (the pump has no prefill)",
    )
    ap.add_argument(
        "--paced-runs",
        type=int,
        default=3,
        help="paced, paced-open, paced-split: rounds, each running every server (under every "
        "load) once; paced-instructions: bursts counted per length",
    )
    ap.add_argument("--paced-prompt-len", type=int, default=16)
    args = ap.parse_args()
    args.plots = RESULTS / "plots" if args.write else None  # paced: the first run's plots
    for name in BOTH if args.scenario == "both" else (args.scenario,):
        scenario = SCENARIOS[name]
        results = {"machine": machine(), scenario.KEY: scenario.run(args)}
        md = (
            scenario.markdown(results[scenario.KEY], args)
            + "\n\n"
            + machine_line(results["machine"])
        )
        publish(args, scenario.NAME, results, md)


if __name__ == "__main__":
    main()
