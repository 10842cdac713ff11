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
import signal
import statistics
import subprocess
import sys
import tempfile
import time
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


PY_SPY = os.environ.get("PY_SPY", "py-spy")  # the sampling profiler of the native split
SPY_HZ = 1000  # py-spy --gil: only the thread holding the GIL, so few samples per run
SPY_RUNS = 2  # native open-loop runs under py-spy, per server
LOOP_C = "event loop (uvloop's C code)"


def in_flight(report: dict) -> dict[str, float]:
    """A run's requests in flight (sent, not yet ended): the peak, and the mean over the run
    (Little's law: the sum of the requests' lifetimes over the run's duration)."""
    return {
        "max": report["max_concurrent_requests"],
        "mean": sum(report["e2els"]) / report["duration"],
    }


OWN = {"gateway", "benchmarks"}  # our code; other leaves are charged to it as "X from Y"


def area(frame: str) -> tuple[str, bool]:
    """The area of one py-spy frame ``func (path:line)`` and whether it is our own code."""
    path = frame.rpartition(" (")[2].rpartition(":")[0]
    mod = path.removesuffix(".py").replace("/", ".")
    if mod.startswith("gateway.engine.synthetic"):
        return "synthetic backend", True
    for own in ("gateway.engine", "gateway.outputs", "gateway.lifecycle", "gateway.ops"):
        if mod.startswith(own):
            return own, True
    if mod.startswith(("gateway.server", "gateway.protocol", "gateway.framebuf")):
        return "gateway.server + frames", True
    if mod.startswith("benchmarks"):
        return "pump", True
    if mod.startswith("gateway"):
        return "gateway (other)", True
    if mod.startswith(("asyncio", "uvloop", "selectors")):
        return "asyncio/uvloop", False
    if mod.startswith(("threading", "queue")):
        return "threading", False
    if mod.startswith("numpy"):
        return "numpy", False
    return "other", False


def spy_split(raw: str) -> dict:
    """py-spy's raw stacks (``frame;frame;...;leaf count``, the GIL holder's) as shares of
    the samples: by the leaf's area (a leaf outside our code named with the innermost area of
    ours that called it, e.g. "numpy from gateway.engine") and by the leaf's module."""
    areas: dict[str, int] = {}
    modules: dict[str, int] = {}
    total = 0
    for line in raw.splitlines():
        stack, _, n = line.rpartition(" ")
        if not stack:
            continue
        frames, count = stack.split(";"), int(n)
        total += count
        leaf, own = area(frames[-1])
        if frames[-1].startswith("Runner.run (") or any(
            f.startswith("run.<locals>.wrapper (uvloop/") for f in frames
        ):  # no Python callback running: the loop's C code (its main coroutine is parked)
            leaf, own = LOOP_C, True
        if not own:
            caller = next((a for a, o in map(area, reversed(frames)) if o), None)
            leaf = f"{leaf} from {caller}" if caller else leaf
        areas[leaf] = areas.get(leaf, 0) + count
        mod = frames[-1].rpartition(" (")[2].rpartition(":")[0]
        modules[mod] = modules.get(mod, 0) + count
    if not total:
        raise SystemExit("py-spy recorded no samples")
    share = {"areas": areas, "modules": modules}
    return {"samples": total} | {
        k: dict(sorted(((a, c / total) for a, c in v.items()), key=lambda kv: -kv[1]))
        for k, v in share.items()
    }


def spied(endpoint: str, pid: int, load: dict, warmup: dict) -> tuple[dict, dict]:
    """The native run of ``load`` with py-spy sampling the server (after a warm-up of
    ``warmup``): the run's in-flight figures and the split of its samples."""
    srv.measure(endpoint, pid, warmup, warmup=True)
    with tempfile.TemporaryDirectory() as tmp:
        raw = Path(tmp) / "spy.raw"
        spy = subprocess.Popen(
            [PY_SPY, "record", "--gil", "-r", str(SPY_HZ), "-f", "raw", "-o", str(raw),
             "-p", str(pid)],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        try:
            time.sleep(1.0)  # attached before the first request
            reports = [srv.measure(endpoint, pid, load) for _ in range(SPY_RUNS)]
        finally:
            spy.send_signal(signal.SIGINT)
            _, err = spy.communicate(timeout=60)
        if not raw.exists():
            raise SystemExit(f"py-spy wrote no profile: {err}")
        flights = [in_flight(r) for r in reports]
        return max(flights, key=lambda f: f["max"]), spy_split(raw.read_text())


def instructions(args, roots: dict[str, Path]) -> dict:
    """Instructions per request under callgrind, the load slowed ``args.instr_slow`` times
    (step time times it, the open loop's arrival rate divided by it) so that the instrumented
    server keeps up with the open loop's arrivals as it does natively; the in-flight figures of
    every run say whether it did. Beside it, the native open loop under py-spy: where each
    server's time goes, by area, applied to its instruction count per request."""
    native = v1({"burst": srv.paced_load(args, srv.PACED_TOKENS), "open": srv.open_load(args)})
    slow = argparse.Namespace(**{**vars(args), "step_ms": args.step_ms * args.instr_slow})
    loads = v1({"burst": srv.paced_load(slow, srv.PACED_TOKENS), "open": srv.open_load(slow)})
    out: dict = {
        "loads": loads,
        "slowdown": args.instr_slow,
        "step_ms": slow.step_ms,
        "runs": args.instr_runs,
        "per_request": {},
        "in_flight": {},
        "native": {"load": native["open"], "step_ms": args.step_ms, "hz": SPY_HZ},
        "split": {},
        "native_in_flight": {},
    }

    def server(name: str, env_args, wrapper: list[str] | None = None):
        if name == "pump":
            return Floor(env_args.step_ms, wrapper or ())
        return Daemon(srv.paced_env(env_args), wrapper=wrapper, root=roots[name])

    for name in ("pump", *TREES):  # the native split first: no valgrind anywhere yet
        with server(name, args) as s:
            flight, split = spied(s.endpoint, s.proc.pid, native["open"], native["burst"])
        out["native_in_flight"][name], out["split"][name] = flight, split
        print(f"native open {name}: in flight {flight}, {split['samples']} samples",
              file=sys.stderr)  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        wrapper = srv.callgrind_wrapper(tmp)

        def count(name: str, endpoint: str, pid: int) -> dict[str, float]:
            srv.measure(endpoint, pid, loads["burst"], warmup=True)
            got, flights = {}, {}
            for load_name, load in loads.items():
                subprocess.run(["callgrind_control", "-z", str(pid)], check=True,
                               capture_output=True)  # fmt: skip
                runs = [srv.measure(endpoint, pid, load, warmup=True)
                        for _ in range(args.instr_runs)]  # fmt: skip
                subprocess.run(["callgrind_control", "-d", str(pid)], check=True,
                               capture_output=True)  # fmt: skip
                requests = args.instr_runs * load["num_requests"]
                got[load_name] = srv.callgrind_total(tmp, pid) / requests
                flights[load_name] = max((in_flight(r) for r in runs), key=lambda f: f["max"])
                print(f"instructions {name} {load_name}: {got[load_name]:,.0f} / request, "
                      f"in flight {flights[load_name]}", file=sys.stderr)  # fmt: skip
            out["in_flight"][name] = flights
            return got

        for name in ("pump", *TREES):
            with server(name, slow, wrapper) as s:
                out["per_request"][name] = count(name, s.endpoint, s.proc.pid)
                if isinstance(s, Daemon):
                    s.terminate()
    per = out["per_request"]
    out["new_vs_base"] = {n: per["new"][n] / per["base"][n] for n in loads}
    out["vs_pump"] = {t: {n: per[t][n] / per["pump"][n] for n in loads} for t in TREES}
    out["split_per_request"] = {
        name: {a: share * per[name]["open"] for a, share in out["split"][name]["areas"].items()}
        for name in out["split"]
    }
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


SPLIT_ROW = 0.01  # the split table's rows: areas with at least this share in some server


def instructions_md(i: dict) -> str:
    """The instructions part's conditions (the slowed load, requests in flight) and its split."""
    if "split" not in i:  # a results file from before the split
        return ""
    names = ("pump", *TREES)
    fl = i["in_flight"]
    nat = i["native_in_flight"]
    lines = [
        f"\nUnder callgrind the load is slowed {i['slowdown']:g} times (step "
        f"{i['step_ms']:g} ms, the open loop {i['loads']['open']['request_rate']:.2f} "
        "requests/s) so that each server keeps up with the open loop's arrivals as natively. "
        "Requests in flight, peak (mean), open loop: under callgrind "
        + ", ".join(f"{n} {fl[n]['open']['max']} ({fl[n]['open']['mean']:.0f})" for n in names)
        + f"; natively (step {i['native']['step_ms']:g} ms, "
        f"{i['native']['load']['request_rate']:.1f}/s) "
        + ", ".join(f"{n} {nat[n]['max']} ({nat[n]['mean']:.0f})" for n in names)
        + ". Burst, under callgrind: "
        + ", ".join(f"{n} {fl[n]['burst']['max']}" for n in names)
        + ".",
        "\nWhere the open loop's instructions go: py-spy samples of each server under the native "
        f"open loop ({SPY_RUNS} runs each, {i['native']['hz']} Hz, `--gil`: only the thread "
        "holding the GIL, so waits and sleeps are not counted: "
        + ", ".join(f"{n} {i['split'][n]['samples']}" for n in names)
        + " samples), grouped by the running Python function's module (a leaf outside our "
        "code, e.g. numpy or the event loop, named with the innermost module of ours that "
        f'called it; "{LOOP_C}": no Python callback running, uvloop\'s socket reads and '
        "writes, timers and scheduling); each share times the server's callgrind "
        "instructions per request. "
        "Shares are of sampled time, not of instructions: a split, not a second count.\n",
    ]
    per = i["split_per_request"]
    areas = sorted(
        {a for n in names for a, v in i["split"][n]["areas"].items() if v >= SPLIT_ROW},
        key=lambda a: -per["new"].get(a, 0.0),
    )
    rows = []
    for a in areas:
        vals = [per[n].get(a, 0.0) for n in names]
        rows.append([a, *(f"{v / 1e3:,.0f}k ({i['split'][n]['areas'].get(a, 0.0):.0%})"
                          for n, v in zip(names, vals, strict=True)),
                     f"{(vals[2] - vals[0]) / 1e3:+,.0f}k"])  # fmt: skip
    rest = [sum(v for a, v in per[n].items() if a not in areas) for n in names]
    rows.append(["the rest (areas under 1% everywhere)", *(f"{v / 1e3:,.0f}k" for v in rest),
                 f"{(rest[2] - rest[0]) / 1e3:+,.0f}k"])  # fmt: skip
    total = [i["per_request"][n]["open"] for n in names]
    rows.append(["**total**", *(f"**{v / 1e3:,.0f}k**" for v in total),
                 f"**{(total[2] - total[0]) / 1e3:+,.0f}k**"])  # fmt: skip
    head = ["open loop, instructions / request", *names, "new - pump"]
    lines.append(table(head, rows))
    return "\n".join(lines)


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
    if "instructions" in r:
        lines.append(instructions_md(r["instructions"]))
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
    ap.add_argument("--instr-slow", type=float, default=10.0,
                    help="instructions: step time x this, open arrival rate / this")  # fmt: skip
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
        last = RESULTS / f"guard-{part}.last.json"  # the figures survive a print-only run
        last.write_text(json.dumps(results, indent=2) + "\n")
        publish(args, f"guard-{part}", results, markdown(results))
        if args.write:
            last.unlink()


if __name__ == "__main__":
    main()
