"""Shared by the benchmark scripts: the command line they share (``--write``, SIGTERM), machine
facts, measuring (a process's CPU time, per-token medians), and publishing: JSON results and
sections of docs/benchmarks.md.

A benchmark is a tool first: it prints its table and writes tracked files (benchmarks/results/,
docs/benchmarks.md) only when run with ``--write`` (``make bench`` passes it). ``parser`` builds
every benchmark's argument parser and turns SIGTERM into a normal exit, so ``with Daemon(...)``
blocks and ``finally`` clauses stop the children; the children also get SIGKILL from the kernel
if the benchmark dies without cleaning up (benchmarks/_support/daemon.py's ``die_with_parent``).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import signal
import statistics
import subprocess
import sys
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
DOC = ROOT / "docs" / "benchmarks.md"


def machine() -> dict:
    cpu = platform.processor() or ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    try:
        mem = int(Path("/proc/meminfo").read_text().split()[1]) // (1024 * 1024)
    except (OSError, ValueError, IndexError):
        mem = 0
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True
        ).stdout.strip()
    except OSError:
        commit = ""
    try:
        load = float(Path("/proc/loadavg").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        load = None
    return {
        "cpu": cpu,
        "load_average_1m": load,
        "cores": os.cpu_count(),
        "memory_gib": mem,
        "python": platform.python_version(),
        "os": f"{platform.system()} {platform.release()}",
        "commit": commit,
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
    }


def machine_line(m: dict) -> str:
    load = m.get("load_average_1m")
    busy = f"; 1-minute load average {load:.1f} when it started" if load is not None else ""
    return (
        f"Machine: {m['cpu']}, {m['cores']} cores, {m['memory_gib']} GiB, Python {m['python']}, "
        f"{m['os']}; commit {m['commit']}, {m['date']}{busy}."
    )


def parser(description: str | None = None) -> argparse.ArgumentParser:
    """An ArgumentParser with ``--write``; SIGTERM from here on exits like Ctrl-C would."""
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument(
        "--write",
        action="store_true",
        help="update benchmarks/results/*.json and docs/benchmarks.md (default: print only)",
    )
    return ap


def _exit_on_sigterm(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)


def publish(args: argparse.Namespace, name: str, data: dict | None, markdown: str) -> None:
    """Print ``markdown``; with ``--write`` also write results/NAME.json (unless ``data`` is
    None: a section made from other results files) and the doc section."""
    print(markdown)
    if not args.write:
        print(f"(not written: pass --write to update the {name} section)", file=sys.stderr)
        return
    if data is not None:
        _write_json(name, data)
    _write_section(name, markdown)


def _write_json(name: str, data: dict) -> Path:
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{name}.json"
    path.write_text(json.dumps(data, indent=2) + "\n")
    return path


def _write_section(name: str, markdown: str) -> None:
    """Replace (or append) the section between <!-- NAME:begin --> and <!-- NAME:end -->."""
    begin, end = f"<!-- {name}:begin -->", f"<!-- {name}:end -->"
    block = f"{begin}\n{markdown.strip()}\n{end}"
    text = DOC.read_text() if DOC.exists() else "# Benchmarks\n"
    pattern = re.compile(re.escape(begin) + ".*?" + re.escape(end), re.S)
    text = (
        pattern.sub(lambda _: block, text) if pattern.search(text) else text + "\n" + block + "\n"
    )
    DOC.write_text(text)


def table(headers: list[str], rows: list[list[object]]) -> str:
    out = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    out += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(out)


def cpu_seconds(pid: int, tid: int | None = None) -> float:
    """CPU time of a process's threads (or of one thread), from the scheduler's nanosecond
    account (/proc/.../schedstat): /proc/PID/stat counts in 10 ms ticks, too coarse for a few
    seconds of load."""
    tids = [tid] if tid is not None else [int(t) for t in os.listdir(f"/proc/{pid}/task")]
    total = 0
    for t in tids:
        try:
            with open(f"/proc/{pid}/task/{t}/schedstat") as fh:
                total += int(fh.read().split()[0])
        except FileNotFoundError:  # a thread that ended meanwhile
            pass
    return total / 1e9


def per_token(runs: list[dict]) -> dict:
    """Medians over runs of {"cpu_s", "wall_s", "tokens"} (the same tokens each run): the runs,
    server CPU µs per token, tokens/s and wall seconds."""
    cpu = statistics.median(r["cpu_s"] for r in runs)
    wall = statistics.median(r["wall_s"] for r in runs)
    tokens = runs[0]["tokens"]
    return {
        "runs": runs,
        "cpu_us_per_token": cpu / tokens * 1e6,
        "tokens_per_s": tokens / wall,
        "wall_s": wall,
    }
