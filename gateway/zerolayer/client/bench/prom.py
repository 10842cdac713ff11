"""The daemon's own view of a run: its Prometheus endpoint read before and after, as deltas.

Reported: output tokens the daemon counted, backend busy seconds by phase (NeuronCore-seconds on
Neuron), busy seconds per 1,000 output tokens (the cost figure), mean queue time and mean TTFT as
the daemon measured them, and requests that ended in DONE or ERROR. Names are docs/metrics.md's.
"""

from __future__ import annotations

import urllib.request
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

Samples = dict[tuple[str, tuple[Any, ...]], float]


def metrics_url(url: str) -> str:
    """A base URL (http://H:P) gets /metrics appended; a URL with a path is used as given."""
    rest = url.split("://", 1)[-1]
    return url if "/" in rest.rstrip("/") else url.rstrip("/") + "/metrics"


def scrape(url: str, timeout: float = 10.0) -> Samples:
    with urllib.request.urlopen(metrics_url(url), timeout=timeout) as resp:
        text = resp.read().decode("utf-8")
    samples: Samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return samples


def _sum(samples: Samples, name: str, **labels: str) -> float:
    want = set(labels.items())
    return sum(v for (n, lab), v in samples.items() if n == name and want <= set(lab))


def _delta(before: Samples, after: Samples, name: str, **labels: str) -> float:
    return _sum(after, name, **labels) - _sum(before, name, **labels)


def _mean_ms(before: Samples, after: Samples, hist: str) -> float | None:
    count = _delta(before, after, f"{hist}_count")
    return _delta(before, after, f"{hist}_sum") / count * 1000.0 if count else None


def server_view(before: Samples, after: Samples) -> dict[str, Any]:
    tokens = _delta(before, after, "zerolayer_generation_tokens_total")
    prefill = _delta(before, after, "zerolayer_backend_busy_seconds_total", phase="prefill")
    decode = _delta(before, after, "zerolayer_backend_busy_seconds_total", phase="decode")
    return {
        "generation_tokens": tokens,
        "prompt_tokens": _delta(before, after, "zerolayer_prompt_tokens_total"),
        "requests_done": _delta(before, after, "zerolayer_request_success_total"),
        "request_errors": _delta(before, after, "zerolayer_request_errors_total"),
        "engine_busy_seconds_prefill": prefill,
        "engine_busy_seconds_decode": decode,
        "engine_busy_seconds": prefill + decode,
        "busy_seconds_per_1k_output_tokens": (prefill + decode) / tokens * 1000.0
        if tokens
        else None,
        "mean_queue_time_ms": _mean_ms(before, after, "zerolayer_request_queue_time_seconds"),
        "mean_server_ttft_ms": _mean_ms(before, after, "zerolayer_time_to_first_token_seconds"),
    }
