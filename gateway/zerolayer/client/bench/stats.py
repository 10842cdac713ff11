"""Per-request timing records and the arithmetic that turns them into the report's figures.

A request's record holds its send time, the arrival time of every chunk (a TOKEN frame, an SSE
event carrying text) with the number of tokens it carried, and how it ended. From it:
TTFT = first chunk - send; inter-token latency per token, where a chunk of k tokens gives one gap
since the previous chunk and k-1 gaps of 0 (the first chunk's k-1 extra tokens give gaps of 0
too), so a request of n tokens has n-1 ITL values; TPOT = (E2E - TTFT) / (n - 1); E2E = end - send.
Aggregates are mean, median, std, P90, P99 and max, with numpy's linear-interpolation percentiles.
"""

from __future__ import annotations

import math
import re
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import numpy as np

PERCENTILES = (90, 99)
METRICS = ("ttft", "tpot", "itl", "e2el")
_SLO_KEYS = {"ttft", "tpot", "e2el"}
_SLO_UNITS = {"ms": 1.0, "s": 1000.0, "us": 0.001}


@dataclass(slots=True)
class RequestRecord:
    t_send: float = 0.0
    t_end: float = 0.0
    chunk_t: list[float] = field(default_factory=list)
    chunk_k: list[int] = field(default_factory=list)
    prompt_tokens: int = 0
    error: str | None = None  # error kind, e.g. "OVERLOADED", "http_500", "connection_closed"
    message: str = ""  # the server's (or the socket's) words for the error
    finish: str | None = None  # finish reason when it ended normally
    cached: bool = False  # answered from the server's response cache (frames: DONE bit 0)

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def output_tokens(self) -> int:
        return sum(self.chunk_k)

    @property
    def ttft(self) -> float | None:
        return self.chunk_t[0] - self.t_send if self.chunk_t else None

    @property
    def e2el(self) -> float:
        return self.t_end - self.t_send

    @property
    def tpot(self) -> float | None:
        n = self.output_tokens
        ttft = self.ttft
        return (self.e2el - ttft) / (n - 1) if n > 1 and ttft is not None else None

    def itls(self) -> list[float]:
        """One value per token after the first (see the module docstring)."""
        out = [0.0] * (self.chunk_k[0] - 1) if self.chunk_k else []
        for i in range(1, len(self.chunk_t)):
            out.append(self.chunk_t[i] - self.chunk_t[i - 1])
            out.extend([0.0] * (self.chunk_k[i] - 1))
        return out


def parse_slo(text: str) -> dict[str, float]:
    """``ttft=500ms,tpot=50ms[,e2el=2s]`` -> limits in milliseconds."""
    slo = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        m = re.fullmatch(r"(\w+)=([\d.]+)(ms|s|us)?", part)
        if not m or m.group(1) not in _SLO_KEYS:
            raise ValueError(
                f"--slo takes KEY=VALUE[ms|s] with KEY in ttft, tpot, e2el, got {part!r}"
            )
        slo[m.group(1)] = float(m.group(2)) * _SLO_UNITS[m.group(3) or "ms"]
    return slo


def meets_slo(rec: RequestRecord, slo: dict[str, float]) -> bool:
    for key, limit_ms in slo.items():
        value = getattr(rec, key)
        if value is not None and value * 1000.0 > limit_ms:
            return False
    return True


def summarize(values_s: list[float] | np.ndarray, name: str) -> dict[str, float | None]:
    """mean/median/std/pNN/max of ``values_s`` (seconds) as ``*_{name}_ms`` fields."""
    a = np.asarray(values_s, dtype=np.float64) * 1000.0
    keys = [f"mean_{name}_ms", f"median_{name}_ms", f"std_{name}_ms"]
    keys += [f"p{p}_{name}_ms" for p in PERCENTILES] + [f"max_{name}_ms"]
    if not a.size:
        return dict.fromkeys(keys)
    values = [a.mean(), np.median(a), a.std()]
    values += [np.percentile(a, p) for p in PERCENTILES] + [a.max()]
    return {k: float(v) for k, v in zip(keys, values, strict=True)}


FIRST_ERRORS = 5


def first_errors(records: list[RequestRecord]) -> list[str]:
    """The first few distinct "kind: message" lines of failed requests, in order of sending."""
    out: list[str] = []
    for r in sorted((r for r in records if r.error), key=lambda r: r.t_send):
        line = f"{r.error}: {r.message}" if r.message else str(r.error)
        if line not in out:
            out.append(line)
            if len(out) == FIRST_ERRORS:
                break
    return out


def max_concurrency(records: list[RequestRecord]) -> int:
    events = sorted([(r.t_send, 1) for r in records] + [(r.t_end, -1) for r in records])
    peak = level = 0
    for _, step in events:
        level += step
        peak = max(peak, level)
    return peak


def token_timeline(records: list[RequestRecord], t0: float, bin_s: float) -> list[list[float]]:
    """[[bin start s, tokens/s], ...] over the run, from chunk arrival times."""
    times = [t for r in records for t in r.chunk_t]
    weights = [k for r in records for k in r.chunk_k]
    if not times:
        return []
    end = max(times) - t0
    n = max(1, math.ceil(end / bin_s + 1e-9))
    offsets = np.asarray(times) - t0
    counts, edges = np.histogram(offsets, bins=n, range=(0, n * bin_s), weights=weights)
    return [[float(e), float(c / bin_s)] for e, c in zip(edges[:-1], counts, strict=True)]


def aggregate(
    records: list[RequestRecord], duration: float, slo: dict[str, float] | None = None
) -> dict[str, Any]:
    """The report's metrics over measured (non-warm-up) records."""
    done = [r for r in records if r.ok]
    out = sum(r.output_tokens for r in done)
    inp = sum(r.prompt_tokens for r in done)
    duration = max(duration, 1e-9)
    result: dict[str, Any] = {
        "duration": duration,
        "completed": len(done),
        "failed": len(records) - len(done),
        "errors_by_kind": dict(Counter(r.error for r in records if r.error)),
        "finish_reasons": dict(Counter(r.finish for r in done if r.finish)),
        "response_cache_hits": sum(r.cached for r in done),
        "first_errors": first_errors(records),
        "total_input_tokens": inp,
        "total_output_tokens": out,
        "request_throughput": len(done) / duration,
        "output_throughput": out / duration,
        "total_token_throughput": (inp + out) / duration,
        "max_concurrent_requests": max_concurrency(records),
    }
    if slo:
        good = sum(meets_slo(r, slo) for r in done)
        result["request_goodput"] = good / duration
        result["goodput_fraction"] = good / len(done) if done else None
    ttfts = [r.ttft for r in done if r.ttft is not None]
    tpots = [r.tpot for r in done if r.tpot is not None]
    itls = [g for r in done for g in r.itls()]
    e2els = [r.e2el for r in done]
    for name, values in (("ttft", ttfts), ("tpot", tpots), ("itl", itls), ("e2el", e2els)):
        result.update(summarize(values, name))
    return result
