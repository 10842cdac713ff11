"""``zerolayer bench``: a load generator and report for the daemon and any OpenAI-compatible
server (docs/bench.md). The Python API the benchmarks call:

    report = await run(BenchOptions(endpoint="tcp://127.0.0.1:7070", concurrency=32))

Modules: endpoint (what to talk to), workload (what to send, when), frames / http (the two
targets), stats (per-request records and the metric arithmetic), prom (the daemon's metrics
before/after), runner (the load loop), report (JSON, summary, compare), plot (PNGs), cli.
"""

from zerolayer.client.bench.cli import add_bench_subparser
from zerolayer.client.bench.options import BenchOptions
from zerolayer.client.bench.runner import run, sweep

__all__ = ["BenchOptions", "add_bench_subparser", "run", "sweep"]
