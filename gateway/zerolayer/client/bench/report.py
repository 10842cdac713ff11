"""The run report: the JSON document (schema in docs/bench.md), its text summary, and compare.

Field names follow vLLM's ``bench serve`` results where they mean the same (``completed``,
``request_throughput``, ``output_throughput``, ``mean_ttft_ms``, ``p99_itl_ms``, ...), so scripts
written for those read these.
"""

from __future__ import annotations

import json
import math
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Any

from zerolayer.client.bench.stats import (
    METRICS,
    PERCENTILES,
    RequestRecord,
    aggregate,
    token_timeline,
)

if TYPE_CHECKING:
    from zerolayer.client.bench.endpoint import Endpoint
    from zerolayer.client.bench.options import BenchOptions

SCHEMA = "zerolayer-bench/1"
_LABELS = {"ttft": "TTFT", "tpot": "TPOT", "itl": "ITL", "e2el": "E2E latency"}


def build_report(
    opts: BenchOptions,
    endpoint: Endpoint,
    info: dict[str, Any],
    records: list[RequestRecord],
    *,
    t0: float,
    duration: float,
    cpu_seconds: float,
    warmup_requests: int,
    slo: dict[str, float] | None,
    server: dict[str, Any] | None,
) -> dict[str, Any]:
    metrics = aggregate(records, duration, slo)
    bin_s = opts.timeline_bin_s or min(1.0, max(0.02, duration / 40))
    timeline = token_timeline(records, t0, bin_s)
    out_tokens = metrics["total_output_tokens"]
    report = {
        "schema": SCHEMA,
        "date": datetime.now(timezone.utc).strftime("%Y%m%d-%H%M%S"),
        "label": opts.label,
        "endpoint": str(endpoint),
        "backend": endpoint.protocol,
        "model_id": info.get("model_id", ""),
        "num_prompts": len(records),
        "request_rate": "inf" if math.isinf(opts.request_rate) else opts.request_rate,
        "burstiness": opts.burstiness,
        "max_concurrency": opts.concurrency,
        "connections": opts.connections if not endpoint.is_http else None,
        "seed": opts.seed,
        "warmup_requests": warmup_requests,
        "slo": slo,
        **metrics,
        "max_output_tokens_per_s": max((v for _, v in timeline), default=0.0),
        "client_cpu_seconds": cpu_seconds,
        "client_cpu_us_per_token": cpu_seconds / out_tokens * 1e6 if out_tokens else None,
        "client_cpu_fraction": cpu_seconds / duration if duration > 0 else None,
        "server_metrics": server,
        "tokens_per_s_timeline": timeline,
        "input_lens": [r.prompt_tokens for r in records],
        "output_lens": [r.output_tokens for r in records],
        "ttfts": [r.ttft for r in records],
        "e2els": [r.e2el for r in records],
        "errors": [r.error or "" for r in records],
        "extra": opts.extra,
    }
    if opts.detailed:
        report["itls"] = [r.itls() for r in records]
    return report


def _fmt(value: object) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:,.2f}"
    return str(value)


def summary(report: dict[str, Any]) -> str:
    """The human-readable block printed after a run."""
    rows = [
        ("Endpoint", f"{report['endpoint']} ({report['backend']})"),
        ("Model", report["model_id"]),
        ("Successful requests", report["completed"]),
        ("Failed requests", report["failed"]),
        ("Warm-up requests", report["warmup_requests"]),
        ("Response cache hits", report.get("response_cache_hits", 0)),
        ("Benchmark duration (s)", report["duration"]),
        ("Total input tokens", report["total_input_tokens"]),
        ("Total generated tokens", report["total_output_tokens"]),
        ("Request throughput (req/s)", report["request_throughput"]),
        ("Output token throughput (tok/s)", report["output_throughput"]),
        ("Total token throughput (tok/s)", report["total_token_throughput"]),
    ]
    if report.get("request_goodput") is not None:
        rows.append(("Request goodput (req/s)", report["request_goodput"]))
    for m in METRICS:
        for stat in ("mean", "median", *(f"p{p}" for p in PERCENTILES), "max"):
            rows.append((f"{stat.capitalize()} {_LABELS[m]} (ms)", report[f"{stat}_{m}_ms"]))
    rows.append(("Client CPU per token (us)", report["client_cpu_us_per_token"]))
    rows.append(("Client CPU (fraction of a core)", report["client_cpu_fraction"]))
    if report["errors_by_kind"]:
        rows.append(("Errors", ", ".join(f"{k} {v}" for k, v in report["errors_by_kind"].items())))
    server = report.get("server_metrics")
    if server:
        rows += [
            ("Server: generation tokens", server["generation_tokens"]),
            ("Server: engine busy seconds", server["engine_busy_seconds"]),
            ("Server: busy s per 1k output tokens", server["busy_seconds_per_1k_output_tokens"]),
            ("Server: mean queue time (ms)", server["mean_queue_time_ms"]),
        ]
    return "\n".join(f"{name:<40}{_fmt(value):>16}" for name, value in rows)


COMPARED = (
    "completed",
    "failed",
    "request_throughput",
    "output_throughput",
    "total_token_throughput",
    "request_goodput",
    *(
        f"{stat}_{m}_ms"
        for m in METRICS
        for stat in ("mean", "median", *(f"p{p}" for p in PERCENTILES), "max")
    ),
    "client_cpu_us_per_token",
)


def load(path: str | Path) -> dict[str, Any]:
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"{path}: not a readable report ({exc})") from None
    if not isinstance(data, dict) or data.get("schema") != SCHEMA:
        raise ValueError(f"{path}: not a zerolayer bench report (schema {SCHEMA})")
    return data


def runs(report: dict[str, Any]) -> list[dict[str, Any]]:
    """A report's runs: each level of a sweep, or the one run."""
    found: list[dict[str, Any]] = report.get("sweep", [report])
    return found


def compare(a: dict[str, Any], b: dict[str, Any], name_a: str = "A", name_b: str = "B") -> str:
    """Two reports side by side with B/A ratios; sweeps are matched by concurrency level."""
    out = []
    runs_b = {r.get("max_concurrency"): r for r in runs(b)}
    for ra in runs(a):
        rb = runs_b.get(ra.get("max_concurrency")) if "sweep" in a else runs(b)[0]
        if rb is None:
            continue
        if "sweep" in a:
            out.append(f"concurrency {ra.get('max_concurrency')}")
        out.append(f"{'metric':<28}{name_a[:16]:>18}{name_b[:16]:>18}{'B/A':>9}")
        for key in COMPARED:
            va, vb = ra.get(key), rb.get(key)
            if va is None and vb is None:
                continue
            numeric = isinstance(va, (int, float)) and isinstance(vb, (int, float))
            ratio = f"{vb / va:.2f}x" if numeric and va else "-"
            out.append(f"{key:<28}{_fmt(va):>18}{_fmt(vb):>18}{ratio:>9}")
        out.append("")
    return "\n".join(out).rstrip() + "\n"
