"""How serving cost grows with the model: Llama-shaped 1B, 3B and 8B Q4_K_M files with random
weights, written at benchmark time, served by ZeroLayer (each mode of ``--modes``) and, on the
same files, by llama.cpp's ``llama-server`` (when its binary is found), with the same load client.

Files (``benchmarks/_support/llama_files.py``): the shapes of Llama-3.2-1B, Llama-3.2-3B and
Llama-3.1-8B (0.75, 1.9 and 4.6 GiB), each tensor of the type llama.cpp's ``llama-quantize``
gives it for Q4_K_M, random weights, a byte-level vocabulary of 128,256 tokens. They go to
``--cache-dir`` (not the repository) and are reused by later runs; ``--rope-freqs`` writes
Llama 3's per-frequency rope divisors as real files carry (another file name). ``--sizes`` also
takes a named real model installed by make (``@gemma3-270m``, ``@smollm2``).

Load: ``zerolayer bench`` over OpenAI completions, greedy, EOS ignored, ``--output-len`` tokens;
prompts of exactly ``--input-len`` token ids (sent as ids, no chat template), **new in every
round and at every stream count** (``_support/fresh_prompts.py``), so no server answers from its
prefix cache; in one round every server gets the same prompts. 1, 8 and 32 concurrent streams,
2 x streams requests after one warm-up request. Every server has ``--slots`` slots of
``--context`` positions and ``--threads`` threads; ZeroLayer's modes are named settings
(``MODES``) or ``--mode LABEL:ZEROLAYER_X=V,...`` (any ``ZEROLAYER_*`` variable: dtype, threads,
kernel paths; and libgomp's ``OMP_*`` / ``GOMP_*``, how its threads wait). ``--busy-core on``
measures every run while a process spins on CPU ``--busy-cpu`` (1), as a neighbour on a shared
machine would take a core; ``both`` measures each run without, then with it (rows marked "busy
CPU"). The servers take turns in each round (one running, the others SIGSTOPped);
for files above ``--one-at-a-time-above`` GiB (the 8B) each server runs all its rounds alone
and is stopped before the next starts: two such servers never hold memory at once.

Reported per size, server and stream count, as ranges over the rounds (each round is in the
JSON): output tokens/s, TPOT median, TTFT P99, the prompt tokens the server counted, peak RSS
(VmHWM summed over the server's processes), time to ready (first start and a restart on a
file seen before), and at one stream the fraction of the bandwidth roofline: the file's matrices
as a step reads them (``roofline.block_bytes``) / TPOT / the read bandwidth measured here at the
same thread count before any server starts (or ``--bandwidth``, a figure measured on a quiet
machine: a loaded one reads less). The load average before and after each run is kept; the
machine, threads and load go beside the table.

    python benchmarks/scale.py [--sizes 1b,3b,8b] [--streams 1,8,32] [--rounds 2]
        [--modes default] [--mode LABEL:ZEROLAYER_X=V,...] [--threads 2]
        [--servers zerolayer,llama-server] [--skip zerolayer@8b] [--llama-server PATH]
        [--busy-core off|on|both] [--busy-cpu 1] [--section scale] [--cache-dir DIR] [--write]
"""

from __future__ import annotations

import contextlib
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks._report import ROOT, machine, machine_line, parser, publish, table  # noqa: E402
from benchmarks._support import fresh_prompts, llama_files  # noqa: E402
from benchmarks._support.busy import busy_core  # noqa: E402
from benchmarks._support.peers import (  # noqa: E402
    THREADS,
    Server,
    bench,
    find_llama_server,
    measured,
    running,
    start_llama,
    start_zerolayer,
)

# ZeroLayer's named modes: the ZEROLAYER_* settings each adds ("default": what a user gets)
MODES: dict[str, dict[str, str]] = {
    "default": {},
    "float32": {"ZEROLAYER_MODEL__DTYPE": "float32"},
    "bfloat16": {"ZEROLAYER_MODEL__DTYPE": "bfloat16"},
    "int8": {"ZEROLAYER_MODEL__KERNEL": "int8"},
    "float-kernel": {"ZEROLAYER_MODEL__KERNEL": "float"},
    "parity": {"ZEROLAYER_MODEL__DTYPE": "float32", "ZEROLAYER_ENGINE__KV_DTYPE": "float32"},
}
# What a mode may set: ZeroLayer's settings, and how OpenMP waits (libgomp's variables)
MODE_PREFIXES = ("ZEROLAYER_", "OMP_", "GOMP_")
GIB = 1 << 30


def parse_mode(text: str) -> tuple[str, dict[str, str]]:
    """``LABEL:ZEROLAYER_X=V,OMP_Y=W`` -> (label, settings)."""
    label, _, rest = text.partition(":")
    settings = {}
    for pair in filter(None, rest.split(",")):
        key, eq, value = pair.partition("=")
        if not eq or not key.startswith(MODE_PREFIXES):
            raise SystemExit(
                f"--mode {text!r}: each setting is NAME=VALUE, NAME one of "
                f"{', '.join(p + '*' for p in MODE_PREFIXES)}"
            )
        settings[key] = value
    if not label:
        raise SystemExit(f"--mode {text!r}: needs a label before the colon")
    return label, settings


def model_file(size: str, cache: Path, rope_freqs: bool) -> Path:
    """A size of ``llama_files.SHAPES`` (written into ``cache`` on first use, after checking the
    disk) or a named real model's file (installed by make, never downloaded here)."""
    if size.startswith("@"):
        from zerolayer.models.bundled import named_gguf

        return named_gguf(size)[0]
    shape = llama_files.SHAPES[size]
    path = cache / f"scale-{size}{'-rope' if rope_freqs else ''}-q4_k_m.gguf"
    if not path.is_file():
        need = llama_files.file_bytes(shape) * 1.1
        if shutil.disk_usage(cache).free < need:
            raise SystemExit(f"{cache}: {need / GIB:.1f} GiB free needed to write the {size} file")
        t = time.monotonic()
        llama_files.write_model(shape, path, rope_freqs=rope_freqs)
        print(f"wrote {path} in {time.monotonic() - t:.0f} s", file=sys.stderr)
    return path


def available_gib() -> float:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) / (1 << 20)
    return 0.0


def bandwidth_gbs(threads: int) -> float:
    """The read bandwidth at ``threads`` threads, as roofline.py measures it."""
    import torch

    from benchmarks.roofline import bandwidth_gbs as measure

    torch.set_num_threads(threads)
    return measure()


class Plan:
    """The servers of one size: how to start each (by label), started one at a time or all."""

    def __init__(self, args, path: Path, size: str, cache: Path, binary: str | None):
        self.args, self.path, self.size, self.cache = args, path, size, cache
        self.starters = {}
        common = {"streams": args.slots, "context": args.context, "threads": args.threads}
        servers = args.servers.split(",")
        if "zerolayer" in servers and f"zerolayer@{size}" not in args.skip:
            for label, settings in args.mode_settings.items():
                env = {"ZEROLAYER_MODEL__DATA_DIR": str(cache / "data"), **settings}
                log = cache / f"{_slug(label)}-{size}.log"
                self.starters[label] = lambda env=env, log=log: start_zerolayer(
                    path, log, env=env, **common
                )
        if binary and "llama-server" in servers and f"llama-server@{size}" not in args.skip:
            log = cache / f"llama-server-{size}.log"
            self.starters["llama-server"] = lambda: start_llama(binary, path, log, **common)

    def start(self, label: str) -> tuple[Server, list[float]]:
        """The server, started; its seconds to ready: first start (and a restart)."""
        t = time.monotonic()
        server = self.starters[label]()
        seconds = [time.monotonic() - t]
        if self.args.restart:
            server.stop()
            t = time.monotonic()
            server = self.starters[label]()
            seconds.append(time.monotonic() - t)
        return server, seconds


# --busy-core: the runs of each server and stream count without (False) and with (True) a core
# taken by a spinning process
BUSY = {"off": (False,), "on": (True,), "both": (False, True)}


def labelled(label: str, busy: bool) -> str:
    return f"{label}, busy CPU" if busy else label


def _slug(label: str) -> str:
    return "".join(c if c.isalnum() else "-" for c in label.lower())


def run_size(args, size: str, cache: Path, binary: str | None, streams: list[int]) -> dict:
    path = model_file(size, cache, args.rope_freqs)
    from benchmarks.roofline import block_bytes

    entry: dict = {
        "file": path.name,
        "file_mib": path.stat().st_size >> 20,
        "parameters": _parameters(path),
        "block_bytes": block_bytes(path),
        "servers": {},
    }
    if available_gib() < path.stat().st_size / GIB + 1:
        entry["skipped"] = f"{available_gib():.1f} GiB available: not enough to serve the file"
        return entry
    plan = Plan(args, path, size, cache, binary)
    ids = fresh_prompts.normal_tokens(path)
    requests = {n: 2 * n for n in streams}

    def prompts(round_: int, n: int) -> Path:
        name = cache / f"prompts-{size}-round{round_}-{n}.jsonl"
        return fresh_prompts.write_prompts(
            name, count=requests[n] + 1, length=args.input_len, max_tokens=args.output_len,
            ids=ids, seed=fresh_prompts.seed_for(size, round_, n, args.seed),
        )  # fmt: skip

    def one(server: Server, label: str, round_: int, n: int, file: Path) -> None:
        for busy in BUSY[args.busy_core]:  # quiet, then with a busy core, as asked
            out = cache / f"{_slug(label)}-{size}-{n}{'-busy' if busy else ''}.json"
            with busy_core(args.busy_cpu) if busy else contextlib.nullcontext():
                r = bench(server, out, streams=n, requests=requests[n], input_len=args.input_len,
                          output_len=args.output_len, prompts=file)  # fmt: skip
            r["round"] = round_
            entry["servers"][labelled(label, busy)]["runs"][str(n)].append(r)

    def record(label: str, seconds: list[float]) -> None:
        for busy in BUSY[args.busy_core]:
            runs = {str(n): [] for n in streams}
            entry["servers"][labelled(label, busy)] = {"start_s": seconds, "runs": runs}

    def peak(label: str, server: Server) -> None:
        for busy in BUSY[args.busy_core]:
            entry["servers"][labelled(label, busy)]["peak_rss_mib"] = server.peak_rss_mib()

    alone = path.stat().st_size > args.one_at_a_time_above * GIB
    entry["one_at_a_time"] = alone
    if alone:  # each server alone: started, all its rounds, stopped
        for label in plan.starters:
            server, seconds = plan.start(label)
            record(label, seconds)
            try:
                for round_ in range(args.rounds):
                    for n in streams:
                        one(server, label, round_, n, prompts(round_, n))
                peak(label, server)
            finally:
                server.stop()
        return entry
    started: dict[str, Server] = {}
    try:
        for label in plan.starters:
            started[label], seconds = plan.start(label)
            record(label, seconds)
            started[label].pause()  # the next one starts alone
    except BaseException:
        for s in started.values():
            s.stop()
        raise
    with running(list(started.values())):  # no server is timed while another one is busy
        for round_ in range(args.rounds):
            for n in streams:
                file = prompts(round_, n)
                for label, server in started.items():
                    with measured(server):
                        one(server, label, round_, n, file)
        for label, server in started.items():
            peak(label, server)
    return entry


def _parameters(path: Path) -> int:
    import gguf

    return sum(int(t.n_elements) for t in gguf.GGUFReader(str(path)).tensors)


def _span(values: list[float], fmt: str = "{:.0f}") -> str:
    lo, hi = fmt.format(min(values)), fmt.format(max(values))
    return lo if lo == hi else f"{lo}–{hi}"


def markdown(results: dict) -> str:
    """The docs section: one row per size, server and stream count, ranges over the rounds."""
    bw = results["bandwidth_gbs"]
    headers = ["model", "server", "streams", "output tok/s", "TPOT ms (median)", "TTFT P99 ms"]
    headers += ["prompt tokens", "peak RSS MiB", "ready s (first / restart)"]
    headers += ["roofline (1 stream)", "load (before → after)"]
    rows = []
    skipped = []
    for size, entry in results["sizes"].items():
        model = f"{size} ({entry['parameters'] / 1e9:.2f}B, {entry['file_mib']} MiB)"
        if "skipped" in entry:
            skipped.append(f"{size}: {entry['skipped']}")
        for label, server in entry["servers"].items():
            for n, runs in server["runs"].items():
                if not runs:
                    continue
                tpot = [r["median_tpot_ms"] for r in runs]
                roof = "" if n != "1" else _span(
                    [entry["block_bytes"] / (t / 1000) / (bw * 1e9) * 100 for t in tpot]
                ) + "%"  # fmt: skip
                prompt = _span([x for r in runs for x in r["prompt_tokens"]])
                load = f"{_span([r['load_average_1m_before'] for r in runs], '{:.1f}')} → "
                load += _span([r["load_average_1m"] for r in runs], "{:.1f}")
                failed = sum(r["failed"] for r in runs)
                rows.append([
                    model, label, n,
                    _span([r["output_tokens_per_s"] for r in runs], "{:.1f}"),
                    _span(tpot), _span([r["p99_ttft_ms"] for r in runs]),
                    prompt + (f" ({failed} failed)" if failed else ""),
                    f"{server.get('peak_rss_mib', 0):.0f}",
                    " / ".join(f"{s:.1f}" for s in server["start_s"]),
                    roof, load,
                ])  # fmt: skip
    a = results["args"]
    peer = results["peers"]["llama-server"]
    busy = a.get("busy_core", "off")
    busy_text = (
        ""
        if busy == "off"
        else f' Rows marked "busy CPU": measured while a process spun on CPU {a["busy_cpu"]}'
        + (" (each server's runs without and with it, back to back)." if busy == "both" else ".")
    )
    title = "Scale: Llama-shaped Q4_K_M files, ZeroLayer beside llama-server"
    if a.get("section", "scale") != "scale":
        title += f" ({a['section']})"
    lines = [
        f"## {title}",
        "",
        f"`python benchmarks/scale.py {a['command']}`: random-weight files in llama.cpp's "
        f"Q4_K_M type mix; prompts of {a['input_len']} token ids, new in every round, "
        f"{a['output_len']} output tokens (EOS ignored), greedy, `zerolayer bench` over OpenAI "
        f"completions; {a['slots']} slots x {a['context']} positions and {a['threads']} "
        f"thread(s) per server, each alone while measured; {a['rounds']} round(s), ranges over "
        f"the rounds (each round in `benchmarks/results/scale.json`). ZeroLayer's modes: "
        + "; ".join(f"{k} {v or '(no settings)'}" for k, v in a["modes"].items())
        + f". llama-server: {peer}. Roofline: the file's matrices read once a token "
        f"(`roofline.block_bytes`) / TPOT / {bw:.1f} GB/s, "
        + (
            "the read bandwidth given with --bandwidth"
            if results.get("bandwidth_given")
            else f"the read bandwidth measured here at {a['threads']} thread(s) before the "
            "servers started"
        )
        + ". Peak RSS: VmHWM summed over a "
        "server's processes. The machine is shared: the load average before and after the "
        "runs of each row." + busy_text,
        "",
        table(headers, rows),
        "",
    ]
    if skipped:
        lines += ["Skipped: " + "; ".join(skipped) + ".", ""]
    lines.append(machine_line(results["machine"]))
    return "\n".join(lines)


def main() -> None:
    ap = parser(__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="1b,3b,8b", help="llama_files.SHAPES and named models")
    ap.add_argument("--streams", default="1,8,32")
    ap.add_argument("--rounds", type=int, default=2, help="rounds per stream count")
    ap.add_argument("--input-len", type=int, default=128, help="prompt tokens (ids)")
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--slots", type=int, default=32, help="each server's")
    ap.add_argument("--context", type=int, default=512, help="positions per slot")
    ap.add_argument("--threads", type=int, default=THREADS, help="each server's")
    ap.add_argument("--modes", default="default", help=f"ZeroLayer's: {', '.join(MODES)}")
    ap.add_argument("--mode", action="append", default=[], metavar="LABEL:ZEROLAYER_X=V,...")
    ap.add_argument("--servers", default="zerolayer,llama-server")
    ap.add_argument("--skip", action="append", default=[], metavar="SERVER@SIZE")
    ap.add_argument("--one-at-a-time-above", type=float, default=3.0, metavar="GIB")
    ap.add_argument("--no-restart", dest="restart", action="store_false",
                    help="time the first start only")  # fmt: skip
    ap.add_argument("--rope-freqs", action="store_true", help="files with rope_freqs.weight")
    ap.add_argument("--seed", type=int, default=38, help="of the prompts")
    ap.add_argument(
        "--bandwidth", type=float, default=0.0, metavar="GBS", help="the roofline's (GB/s)"
    )
    ap.add_argument(
        "--busy-core", choices=tuple(BUSY), default="off",
        help="measure with a process spinning on --busy-cpu (on), or without and with (both)",
    )  # fmt: skip
    ap.add_argument("--busy-cpu", type=int, default=1, help="the CPU the busy process takes")
    ap.add_argument(
        "--section", default="scale", help="the results file and docs section (--write)"
    )
    ap.add_argument("--llama-server", default=None, metavar="PATH")
    ap.add_argument("--cache-dir", default=str(Path(tempfile.gettempdir()) / "zerolayer-scale"))
    args = ap.parse_args()
    args.mode_settings = {}
    for name in filter(None, args.modes.split(",")):
        if name not in MODES:
            raise SystemExit(f"--modes: {name!r} is none of {', '.join(MODES)}")
        args.mode_settings["ZeroLayer" if name == "default" else f"ZeroLayer {name}"] = MODES[name]
    for text in args.mode:
        label, settings = parse_mode(text)
        args.mode_settings[f"ZeroLayer {label}"] = settings
    cache = Path(args.cache_dir)
    cache.mkdir(parents=True, exist_ok=True)
    binary, skipped = find_llama_server(args.llama_server)
    streams = [int(s) for s in args.streams.split(",")]
    started = machine()
    results: dict = {
        "machine": started,
        "bandwidth_gbs": args.bandwidth or bandwidth_gbs(args.threads),
        "bandwidth_given": bool(args.bandwidth),
        "peers": {"llama-server": binary or f"skipped: {skipped}"},
        "args": {
            "command": " ".join(a for a in sys.argv[1:] if a != "--write"),
            "section": args.section,
            "input_len": args.input_len,
            "output_len": args.output_len,
            "slots": args.slots,
            "context": args.context,
            "threads": args.threads,
            "rounds": args.rounds,
            "busy_core": args.busy_core,
            "busy_cpu": args.busy_cpu,
            "modes": {
                k: " ".join(f"{a}={b}" for a, b in v.items()) for k, v in args.mode_settings.items()
            },
        },
        "sizes": {},
    }
    for size in args.sizes.split(","):
        results["sizes"][size] = run_size(args, size, cache, binary, streams)
    publish(args, args.section, results, markdown(results))


if __name__ == "__main__":
    os.chdir(ROOT)
    main()
