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
  counter reset and a dump), the load slowed ``--instr-slow`` times so that the instrumented
  servers keep up with the open loop; every run's requests in flight recorded.
- **split**: each server under the native open loop sampled by py-spy (``PY_SPY``: its path),
  the running samples grouped by module; its section applies the shares to the instructions
  part's counts.
- **engine**: benchmarks/engine.py's daemon half (``--size``, default smollm2: the real default
  model) at 1, 8 and 32 streams: output tokens/s.

    python benchmarks/guard.py --base DIR [--parts flat,paced,instructions,split,engine]
        [--write] [--redraw: the sections again from the results files]

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
SPY_HZ = 250  # py-spy --native (each sample unwinds C stacks too)
SPY_RUNS = 2  # native open-loop runs under py-spy, per server
# A stack whose innermost C function is one of these is a thread waiting (for the GIL, a
# lock, the next step, a socket), not running: the split leaves it out.
WAITS = (
    "epoll_wait", "epoll_pwait", "clock_nanosleep", "nanosleep", "select", "poll", "ppoll",
    "futex_wait", "__futex_abstimed_wait_common", "pthread_cond_wait", "pthread_cond_timedwait",
    "do_futex_wait", "sem_wait", "sem_timedwait", "__lll_lock_wait", "syscall",
    "PyThread_acquire_lock_timed",
)  # fmt: skip
# (unnamed libc addresses under one of them, e.g. pthread_cond_timedwait's futex wait in the
# GIL's take_gil after a sleep, are the same wait: the innermost named function decides)
LOOP_C = "event loop (uvloop's C code)"


def in_flight(report: dict) -> dict[str, float]:
    """A run's requests in flight (sent, not yet ended): the peak, and the mean over the run
    (Little's law: the sum of the requests' lifetimes over the run's duration)."""
    return {
        "max": report["max_concurrent_requests"],
        "mean": sum(report["e2els"]) / report["duration"],
    }


OWN = {"zerolayer", "benchmarks"}  # our code; other leaves are charged to it as "X from Y"


def area(frame: str) -> tuple[str, bool]:
    """The area of one py-spy frame ``func (path:line)`` and whether it is our own code."""
    path = frame.rpartition(" (")[2].rpartition(":")[0]
    # a checkout's path (gateway/zerolayer/...) or site-packages' (zerolayer/...)
    mod = path.removesuffix(".py").replace("/", ".").removeprefix("gateway.")
    if mod.startswith("zerolayer.engine.backends.synthetic"):
        return "synthetic backend", True
    for own in (
        "zerolayer.engine",
        "zerolayer.request_path.outputs",
        "zerolayer.request_path.lifecycle",
        "zerolayer.ops",
    ):
        if mod.startswith(own):
            return own, True
    if mod.startswith(
        ("zerolayer.frames.door", "zerolayer.frames.protocol", "zerolayer.frames.framebuf")
    ):
        return "frame door", True
    if mod.startswith(("benchmarks", "_support")):  # py-spy may shorten the pump's path
        return "pump", True
    if mod.startswith("zerolayer"):
        return "zerolayer (other)", True
    if mod.startswith(("asyncio", "uvloop", "selectors")):
        return "asyncio/uvloop", False
    if mod.startswith(("threading", "queue")):
        return "threading", False
    if mod.startswith("numpy"):
        return "numpy", False
    return "other", False


def python_frame(frame: str) -> bool:
    """Whether a py-spy frame ``func (where)`` is Python's (a .py file or a frozen module)."""
    where = frame.rpartition(" (")[2]
    return ".py:" in where or where.startswith("<frozen")


def spy_split(raw: str) -> dict:
    """py-spy's raw stacks (``frame;frame;...;leaf count``, C frames among them) as shares of
    the running samples (a stack whose innermost C function is a wait, ``WAITS``, left out):
    by the innermost Python frame's area (one outside our code named with the innermost area
    of ours that called it, e.g. "numpy from zerolayer.engine") and by its module."""
    areas: dict[str, int] = {}
    modules: dict[str, int] = {}
    total = waiting = 0
    for line in raw.splitlines():
        stack, _, n = line.rpartition(" ")
        if not stack:
            continue
        every, count = stack.split(";"), int(n)
        names = [f.partition(" (")[0].strip() for f in every]
        named = next((f for f in reversed(names) if not f.startswith("0x")), "")
        if named in WAITS:
            waiting += count
            continue
        frames = [f for f in every if python_frame(f)]
        if not frames:
            continue
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
    return {"samples": total, "waiting_samples": waiting} | {
        k: dict(sorted(((a, c / total) for a, c in v.items()), key=lambda kv: -kv[1]))
        for k, v in share.items()
    }


def spied(endpoint: str, pid: int, load: dict, warmup: dict) -> dict:
    """``SPY_RUNS`` native runs of ``load`` with py-spy sampling the server (after a warm-up of
    ``warmup``): the in-flight figures of the run with the highest peak, the server's CPU per
    token, the seconds of CPU the running samples stand for, and the split of the samples."""
    srv.measure(endpoint, pid, warmup, warmup=True)
    with tempfile.TemporaryDirectory() as tmp:
        raw = Path(tmp) / "spy.raw"
        spy = subprocess.Popen(
            [PY_SPY, "record", "--native", "-r", str(SPY_HZ), "-f", "raw",
             "-o", str(raw), "-p", str(pid)],
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
        split = spy_split(raw.read_text())
    tokens = sum(r["total_output_tokens"] for r in reports)
    return {
        "in_flight": max((in_flight(r) for r in reports), key=lambda f: f["max"]),
        "cpu_us_per_token": [r["server_cpu_us_per_token"] for r in reports],
        "cpu_s": sum(r["server_cpu_us_per_token"] for r in reports) * tokens / len(reports) / 1e6,
        "sampled_cpu_s": split["samples"] / SPY_HZ,
        "split": split,
    }


def instructions(args, roots: dict[str, Path]) -> dict:
    """Instructions per request under callgrind, the load slowed ``args.instr_slow`` times
    (step time times it, the open loop's arrival rate divided by it) so that the instrumented
    server keeps up with the open loop's arrivals as it does natively; the in-flight figures of
    every run say whether it did (the native ones: the split part's)."""
    slow = argparse.Namespace(**{**vars(args), "step_ms": args.step_ms * args.instr_slow})
    loads = v1({"burst": srv.paced_load(slow, srv.PACED_TOKENS), "open": srv.open_load(slow)})
    out: dict = {
        "loads": loads,
        "slowdown": args.instr_slow,
        "step_ms": slow.step_ms,
        "runs": args.instr_runs,
        "per_request": {},
        "in_flight": {},
    }
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
            with server(roots, name, slow, wrapper) as s:
                out["per_request"][name] = count(name, s.endpoint, s.proc.pid)
                if isinstance(s, Daemon):
                    s.terminate()
    per = out["per_request"]
    out["new_vs_base"] = {n: per["new"][n] / per["base"][n] for n in loads}
    out["vs_pump"] = {t: {n: per[t][n] / per["pump"][n] for n in loads} for t in TREES}
    return out


def server(roots: dict[str, Path], name: str, env_args, wrapper: list[str] | None = None):
    """The pump ("pump") or a daemon of tree ``name``, paced by ``env_args.step_ms``."""
    if name == "pump":
        return Floor(env_args.step_ms, wrapper or ())
    return Daemon(srv.paced_env(env_args), wrapper=wrapper, root=roots[name])


def split(args, roots: dict[str, Path]) -> dict:
    """Where each server's time goes under the native open loop: py-spy's samples (``spied``)
    grouped by area; the markdown applies the shares to the instructions part's counts."""
    loads = v1({"burst": srv.paced_load(args, srv.PACED_TOKENS), "open": srv.open_load(args)})
    out: dict = {"load": loads["open"], "step_ms": args.step_ms, "hz": SPY_HZ, "runs": SPY_RUNS}
    for name in ("pump", *TREES):
        with server(roots, name, args) as s:
            out[name] = spied(s.endpoint, s.proc.pid, loads["open"], loads["burst"])
        got = out[name]
        print(f"split {name}: in flight {got['in_flight']}, {got['split']['samples']} running "
              f"samples ({got['sampled_cpu_s']:.2f} s) for {got['cpu_s']:.2f} s of CPU",
              file=sys.stderr)  # fmt: skip
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


PARTS = {
    "flat": flat, "paced": paced, "instructions": instructions, "split": split, "engine": engine,
}  # fmt: skip


def med(xs: list[float]) -> float:
    return statistics.median(xs)


LOADED = 1.0  # a 1-minute load average above this (2 cores): CPU-time figures inconclusive


SPLIT_ROW = 0.01  # the split table's rows: areas with at least this share in some server
NAMES = ("pump", *TREES)


def instructions_md(i: dict) -> str:
    """The instructions part's conditions: the slowed load and the requests in flight."""
    if "in_flight" not in i:  # a results file from before the slowed load
        return ""
    fl = i["in_flight"]
    return (
        f"\nUnder callgrind the load is slowed {i['slowdown']:g} times (step "
        f"{i['step_ms']:g} ms, the open loop {i['loads']['open']['request_rate']:.2f} "
        "requests/s) so that each server keeps up with the open loop's arrivals as natively. "
        "Requests in flight under callgrind, peak (mean over the run), open loop: "
        + ", ".join(f"{n} {fl[n]['open']['max']} ({fl[n]['open']['mean']:.0f})" for n in NAMES)
        + "; burst: "
        + ", ".join(f"{n} {fl[n]['burst']['max']} ({fl[n]['burst']['mean']:.0f})" for n in NAMES)
        + "."
    )


def split_md(r: dict) -> str:
    """The split part's section: the native conditions, and the open loop's instructions per
    request by area (each server's sample shares times its count in guard-instructions.json)."""
    sp = r["split"]
    path = RESULTS / "guard-instructions.json"
    counts = json.loads(path.read_text()) if path.exists() else None
    lines = [
        "## Guard (split): where the open loop's instructions go\n",
        f"`python benchmarks/guard.py --base <checkout of {r['commits']['base']}> --parts split` "
        f"at {r['commits']['new']}: each server under the native open loop (step "
        f"{sp['step_ms']:g} ms, {sp['load']['request_rate']:.1f} requests/s, "
        f"{sp['load']['num_requests']} requests, {sp['runs']} runs each) sampled by py-spy "
        f"(`--native`, {sp['hz']} Hz, every thread). Samples whose innermost C function is a "
        "wait (epoll, sleep, futex: for the GIL, a lock or the next step) are left out; the "
        "rest are grouped by the innermost Python frame's module (one outside our code, e.g. "
        "numpy or the event loop's Python, named with the innermost module of ours that called "
        'it; "event loop (uvloop\'s C code)": no Python callback running, uvloop reading and '
        "writing sockets, timers, scheduling). The 1-minute load average was "
        f"{r['machine'].get('load_average_1m')} when it started, "
        f"{r.get('load_average_end', float('nan')):.2f} when it ended.",
        "\nRunning samples against the server's measured CPU time (user + system) over the "
        "same runs: "
        + ", ".join(
            f"{n} {sp[n]['sampled_cpu_s']:.2f} s sampled / {sp[n]['cpu_s']:.2f} s CPU "
            f"({statistics.median(sp[n]['cpu_us_per_token']):.2f} µs/token)"
            for n in NAMES
        )
        + ". Requests in flight natively, peak (mean over the run): "
        + ", ".join(
            f"{n} {sp[n]['in_flight']['max']} ({sp[n]['in_flight']['mean']:.0f})" for n in NAMES
        )
        + ".",
    ]
    share = {n: sp[n]["split"]["areas"] for n in NAMES}
    if counts is None:
        per = {n: dict.fromkeys(share[n], 0.0) for n in NAMES}
        unit, scale = "share", None
    else:
        total = {n: counts["instructions"]["per_request"][n]["open"] for n in NAMES}
        per = {n: {a: v * total[n] for a, v in share[n].items()} for n in NAMES}
        unit, scale = "instructions / request", 1e3
        lines.append(
            "\nEach share times the server's open-loop instructions per request in "
            f"guard-instructions.json (at {counts['commits']['new']}): shares are of sampled "
            "native time, kernel time in system calls included, so the rows are an estimate "
            "of where the count goes, not a second count."
        )
    areas = sorted(
        {a for n in NAMES for a, v in share[n].items() if v >= SPLIT_ROW},
        key=lambda a: -share["new"].get(a, 0.0),
    )

    def cell(n: str, a: str) -> str:
        v = share[n].get(a, 0.0)
        return f"{per[n].get(a, 0.0) / scale:,.0f}k ({v:.0%})" if scale else f"{v:.1%}"

    rows = [[a, *(cell(n, a) for n in NAMES)] for a in areas]
    rest = {n: sum(v for a, v in share[n].items() if a not in areas) for n in NAMES}
    rows.append(["the rest (each under 1%)",
                 *(f"{rest[n] * total[n] / 1e3:,.0f}k ({rest[n]:.0%})" if scale
                   else f"{rest[n]:.1%}" for n in NAMES)])  # fmt: skip
    if scale:
        rows.append(["**total**", *(f"**{total[n] / 1e3:,.0f}k**" for n in NAMES)])
    lines.append("")
    lines.append(table([f"open loop, {unit}", *NAMES], rows))
    return "\n".join(lines)


def markdown(r: dict) -> str:
    if "split" in r and "instructions" not in r:
        return split_md(r)
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
    ap.add_argument("--redraw", action="store_true",
                    help="remake the parts' doc sections from their results files")  # fmt: skip
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
        if args.redraw:
            kept = json.loads((RESULTS / f"guard-{part}.json").read_text())
            publish(args, f"guard-{part}", None, markdown(kept))
            continue
        results = {**head, "machine": machine(), part: PARTS[part](args, roots)}
        results["load_average_end"] = os.getloadavg()[0]
        last = RESULTS / f"guard-{part}.last.json"  # the figures survive a print-only run
        last.write_text(json.dumps(results, indent=2) + "\n")
        publish(args, f"guard-{part}", results, markdown(results))
        if args.write:
            last.unlink()


if __name__ == "__main__":
    main()
