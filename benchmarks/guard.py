"""The redesign's guard: this tree against a baseline checkout, side by side in one run.

Each measurement runs a daemon of this tree ("new") and one of ``--base`` (another checkout of
the repository, e.g. ``git worktree add ../base 7a48e61``; "base") in the same script, their runs
interleaved round by round (the order alternating) so that the host's drift between rounds hits
both; a figure is the median over rounds, a ratio the median of the per-round ratios.

- **flat**: serving CPU per token flat out (serving.py's flat load, synthetic backend, no
  step time).
- **paced**: serving CPU per token of the paced burst and of the open loop (serving.py's paced
  and paced-open loads, synthetic step time ``--step-ms``), with the no-logic pump beside them.
- **instructions**: user-space instructions per request under callgrind, paced burst and open
  loop, for the pump, base and new (one warm-up, then ``--instr-runs`` runs per load between a
  counter reset and a dump).
- **engine**: benchmarks/engine.py's daemon half (``--size``, default smollm2: the real default
  model) at 1, 8 and 32 streams: output tokens/s.

    python benchmarks/guard.py --base DIR [--parts flat,paced,instructions,engine] [--write]

Results: ``benchmarks/results/guard-<part>.json`` and the ``guard-<part>`` sections of
docs/benchmarks.md, each stamped with the two commits.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks import engine as eng  # noqa: E402
from benchmarks._report import RESULTS, machine, parser, publish, table  # noqa: E402
from benchmarks._support.daemon import ROOT, Daemon  # noqa: E402
from benchmarks._support.pump import VOCAB, Floor  # noqa: E402
from benchmarks.scenarios import common as srv  # noqa: E402

TREES = ("base", "new")


def commit(root: Path) -> str:
    return subprocess.run(
        ["git", "-C", str(root), "rev-parse", "--short", "HEAD"],
        capture_output=True, text=True, check=True,
    ).stdout.strip()  # fmt: skip


def paired(runs: dict[str, list[float]], key: str = "base") -> tuple[float, list[float]]:
    """new / base, round by round: the median and the per-round ratios."""
    return srv.paired_ratio(runs["new"], runs[key])


# Both trees get the same bytes, those the baseline understands: a version-1 HELLO (it speaks
# protocol version 1 only, this tree 1 and 2) and no cache-bypass option bit (it came after the
# baseline; every prompt is new anyway, and ``measure`` refuses a run with a cache replay).
AS_BASE = {"frame_version": 1, "use_cache": True}


def v1(loads: dict[str, dict]) -> dict[str, dict]:
    return {name: {**load, **AS_BASE} for name, load in loads.items()}


def flat(args, roots: dict[str, Path]) -> dict:
    load = {
        "concurrency": 64, "num_requests": 64 * args.flat_rounds, "input_len": "4",
        "output_len": "256", "connections": 1, **AS_BASE,
    }  # fmt: skip
    env = {
        "ENGINE__BACKEND": "synthetic", "ENGINE__MAX_BATCH_SIZE": "64",
        "ENGINE__MAX_CONTEXT": "2048", "ENGINE__SYNTHETIC_VOCAB_SIZE": str(VOCAB),
    }  # fmt: skip
    cpu: dict[str, list[float]] = {t: [] for t in TREES}
    with contextlib.ExitStack() as stack:
        daemons = {t: stack.enter_context(Daemon(env, root=roots[t])) for t in TREES}
        for d in daemons.values():
            srv.measure(d.endpoint, d.proc.pid, load, warmup=True)
        for i, order in enumerate(srv.rotations(list(TREES), args.rounds), 1):
            for t in order:
                r = srv.measure(daemons[t].endpoint, daemons[t].proc.pid, load)
                cpu[t].append(r["server_cpu_us_per_token"])
                print(f"flat {i}: {t} {cpu[t][-1]:.3f} µs/token", file=sys.stderr, flush=True)
        for d in daemons.values():
            d.terminate()
    ratio, ratios = paired(cpu)
    return {"load": load, "cpu_us_per_token": cpu, "new_vs_base": ratio, "ratios": ratios}


def paced(args, roots: dict[str, Path]) -> dict:
    loads = v1({"burst": srv.paced_load(args, srv.PACED_TOKENS), "open": srv.open_load(args)})
    env = srv.paced_env(args)
    with contextlib.ExitStack() as stack:
        floor = stack.enter_context(Floor(args.step_ms))
        servers: srv.Servers = {"pump": (floor.endpoint, floor.proc.pid)}
        daemons = [stack.enter_context(Daemon(env, root=roots[t])) for t in TREES]
        for t, d in zip(TREES, daemons, strict=True):
            servers[t] = (d.endpoint, d.proc.pid)
        runs, orders = srv.interleaved_runs(servers, loads, args, warmup=loads["burst"])
        for d in daemons:
            d.terminate()
    out: dict = {"loads": loads, "step_ms": args.step_ms, "round_orders": orders}
    for load in loads:
        cpu = {name: [r["server_cpu_us_per_token"] for r in runs[(name, load)]] for name in servers}
        ratio, ratios = paired(cpu)
        out[load] = {
            "cpu_us_per_token": cpu,
            "new_vs_base": ratio,
            "ratios": ratios,
            "new_vs_pump": paired(cpu, "pump")[0],
            "base_vs_pump": srv.paired_ratio(cpu["base"], cpu["pump"])[0],
            "foreign_load": {n: [r["foreign_load"] for r in runs[(n, load)]] for n in servers},
        }
    return out


def instructions(args, roots: dict[str, Path]) -> dict:
    loads = v1({"burst": srv.paced_load(args, srv.PACED_TOKENS), "open": srv.open_load(args)})
    out: dict = {"loads": loads, "runs": args.instr_runs, "per_request": {}}
    with tempfile.TemporaryDirectory() as tmp:
        wrapper = srv.callgrind_wrapper(tmp)

        def count(endpoint: str, pid: int) -> dict[str, float]:
            srv.measure(endpoint, pid, loads["burst"], warmup=True)
            got = {}
            for name, load in loads.items():
                subprocess.run(["callgrind_control", "-z", str(pid)], check=True,
                               capture_output=True)  # fmt: skip
                for _ in range(args.instr_runs):
                    srv.measure(endpoint, pid, load, warmup=True)
                subprocess.run(["callgrind_control", "-d", str(pid)], check=True,
                               capture_output=True)  # fmt: skip
                requests = args.instr_runs * load["num_requests"]
                got[name] = srv.callgrind_total(tmp, pid) / requests
                print(f"instructions {name}: {got[name]:,.0f} / request", file=sys.stderr)
            return got

        with Floor(args.step_ms, wrapper) as floor:
            out["per_request"]["pump"] = count(floor.endpoint, floor.proc.pid)
        for t in TREES:
            with Daemon(srv.paced_env(args), wrapper=wrapper, root=roots[t]) as d:
                out["per_request"][t] = count(d.endpoint, d.proc.pid)
                d.terminate()
    per = out["per_request"]
    out["new_vs_base"] = {n: per["new"][n] / per["base"][n] for n in loads}
    out["vs_pump"] = {t: {n: per[t][n] / per["pump"][n] for n in loads} for t in TREES}
    return out


def engine(args, roots: dict[str, Path]) -> dict:
    e = argparse.Namespace(
        size=args.size, model="", data_dir="", tokens=None, requests=None, runs=1,
        streams=[1, 8, 32], threads=0, dtype=args.dtype, max_context=2048, seed=0,
        quiet_wait=10.0,
    )  # fmt: skip
    tokens, requests, _ = eng.SIZE_DEFAULTS[args.size]
    e.tokens, e.requests = tokens, requests
    directory, config = eng.checkpoint(e)
    prompts = eng.make_prompts(config, e.requests, e.seed)
    tps: dict[str, dict[str, list[float]]] = {t: {} for t in TREES}
    for i, order in enumerate(srv.rotations(list(TREES), args.rounds), 1):
        for t in order:
            res = eng.run_daemon(e, directory, prompts, root=roots[t])
            for streams, run in res.items():
                tps[t].setdefault(streams, []).append(run["tokens_per_s"])
            print(f"engine {i}: {t} {[round(v[-1]) for v in tps[t].values()]}", file=sys.stderr)
    paired_by = {s: srv.paired_ratio(tps["new"][s], tps["base"][s]) for s in tps["new"]}
    return {
        "size": args.size,
        "dtype": args.dtype,
        "tokens_per_s": tps,
        "new_vs_base": {s: p[0] for s, p in paired_by.items()},
        "ratios": {s: p[1] for s, p in paired_by.items()},
    }


PARTS = {"flat": flat, "paced": paced, "instructions": instructions, "engine": engine}


def med(xs: list[float]) -> float:
    return statistics.median(xs)


LOADED = 1.0  # a 1-minute load average above this (2 cores): CPU-time figures inconclusive


def markdown(r: dict) -> str:
    base, new = r["commits"]["base"], r["commits"]["new"]
    load = r["machine"].get("load_average_1m")
    loaded = load is None or load > LOADED
    end = r.get("load_average_end")
    loads = f"{load} when it started" + (f", {end:.2f} when it ended" if end is not None else "")
    loaded = loaded or (end is not None and end > LOADED)
    cpu_note = (
        f"inconclusive: the 1-minute load average was {loads} (other engineers' jobs on the 2 "
        "cores), and CPU time moves with it"
        if loaded
        else f"the 1-minute load average was {loads}"
    )
    lines = [
        f"## Guard ({', '.join(p for p in PARTS if p in r)}): this tree against a baseline\n",
        f"`python benchmarks/guard.py --base <checkout of {base}>` at {new}: both trees' "
        f"daemons side by side in one run, rounds interleaved ({r['rounds']} rounds, order "
        "rotated), median over rounds; a ratio is new / base (or / the pump), the median of "
        "per-round ratios.",
    ]
    if "instructions" in r:
        lines.append(
            "Instructions are callgrind's count of each server's user-space instructions, all "
            f"threads ({r['instructions']['runs']} run(s) of each load after a warm-up), which "
            "the machine's load does not change."
        )
    if any(p in r for p in ("flat", "paced", "engine")):
        lines.append(f"CPU time and tokens/s: {cpu_note}.")
    lines.append("")
    rows = []
    if "flat" in r:
        f = r["flat"]
        c = f["cpu_us_per_token"]
        rows.append(["flat out, server CPU µs/token", f"{med(c['base']):.3f}",
                     f"{med(c['new']):.3f}", f"{f['new_vs_base']:.2f}x"])  # fmt: skip
    if "paced" in r:
        for name in ("burst", "open"):
            p = r["paced"][name]
            c = p["cpu_us_per_token"]
            rows.append([f"paced {name}, server CPU µs/token (pump {med(c['pump']):.2f})",
                         f"{med(c['base']):.2f} ({p['base_vs_pump']:.2f}x pump)",
                         f"{med(c['new']):.2f} ({p['new_vs_pump']:.2f}x pump)",
                         f"{p['new_vs_base']:.2f}x"])  # fmt: skip
    if "instructions" in r:
        i = r["instructions"]
        for name in ("burst", "open"):
            per = i["per_request"]
            rows.append([f"paced {name}, instructions / request (pump {per['pump'][name]:,.0f})",
                         f"{per['base'][name]:,.0f} ({i['vs_pump']['base'][name]:.2f}x pump)",
                         f"{per['new'][name]:,.0f} ({i['vs_pump']['new'][name]:.2f}x pump)",
                         f"{i['new_vs_base'][name]:.2f}x"])  # fmt: skip
    if "engine" in r:
        e = r["engine"]
        for s in e["tokens_per_s"]["new"]:
            rows.append([f"engine tokens/s, {e['size']} {e['dtype']}, {s} streams",
                         f"{med(e['tokens_per_s']['base'][s]):,.0f}",
                         f"{med(e['tokens_per_s']['new'][s]):,.0f}",
                         f"{e['new_vs_base'][s]:.2f}x"])  # fmt: skip
    lines.append(table(["measure", f"base {base}", f"new {new}", "new / base"], rows))
    if "paced" in r:
        fl = [f"{name} {load}: {med(v):.2f}" for load in ("burst", "open")
              for name, v in r["paced"][load]["foreign_load"].items()]  # fmt: skip
        lines.append(
            "\nOther processes' share of the machine during the paced runs (median over rounds): "
            + ", ".join(fl)
            + "."
        )
    if "engine" in r:
        e = r["engine"]
        lines.append(
            "\nPer round, new / base at 1, 8, 32 streams: "
            + "; ".join(", ".join(f"{v:.2f}" for v in rs) for rs in e.get("ratios", {}).values())
            + "."
        )
    return "\n".join(lines)


def main() -> None:
    ap = parser(__doc__.split("\n")[0])
    ap.add_argument("--base", required=True, type=Path, help="the baseline checkout")
    ap.add_argument("--parts", default=",".join(PARTS))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--flat-rounds", type=int, default=10, help="flat: requests = 64 x this")
    ap.add_argument("--instr-runs", type=int, default=1)
    ap.add_argument("--step-ms", type=float, default=20.0)
    ap.add_argument("--prefill-us-per-token", type=float, default=0.0)
    ap.add_argument("--paced-prompt-len", type=int, default=16)
    ap.add_argument("--size", default="smollm2", choices=sorted(eng.SIZE_DEFAULTS))
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    args = ap.parse_args()
    args.paced_runs = args.rounds
    roots = {"base": args.base.resolve(), "new": ROOT}
    head = {
        "machine": machine(),
        "commits": {t: commit(roots[t]) for t in TREES},
        "rounds": args.rounds,
    }
    for part in args.parts.split(","):  # each part its own results file and docs section
        results = {**head, "machine": machine(), part: PARTS[part](args, roots)}
        results["load_average_end"] = os.getloadavg()[0]
        publish(args, f"guard-{part}", results, markdown(results))
        if not args.write:  # the figures survive a print-only run
            last = RESULTS / f"guard-{part}.last.json"
            last.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
