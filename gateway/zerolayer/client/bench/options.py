"""What a bench run is asked to do: ``BenchOptions``, from ``zerolayer bench``'s flags or a
caller."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from zerolayer.frames.protocol import VERSION as FRAME_VERSION


@dataclass
class BenchOptions:
    endpoint: str
    protocol: str | None = None  # http(s): openai-chat | openai-completions | anthropic
    model: str | None = None  # http(s): the model name to send (default: GET /v1/models)
    concurrency: int | None = None
    request_rate: float = math.inf
    burstiness: float = 1.0
    num_requests: int | None = None
    duration: float | None = None
    warmup: int = 0
    seed: int = 0
    input: str | None = None  # JSONL or ShareGPT JSON; None = the random dataset
    input_len: str = "128"  # MEAN[:SPREAD]
    output_len: str | None = None  # MEAN[:SPREAD]; None = 128 for random, the file's otherwise
    prompt_id: int = 0
    system_file: str | None = None
    api_key: str = ""
    connections: int = 1
    tls_ca: str | None = None  # tls:// and https://: the CA to verify the server with
    tls_cert: str | None = None  # ... and a client certificate and key, for mutual TLS
    tls_key: str | None = None
    ignore_eos: bool = False
    metrics_url: str | None = None
    slo: str | None = None
    text_deltas: bool = True  # frames: ask for text deltas (HTTP servers always send text)
    request_format: str = "auto"  # frames: auto | binary | json
    progress: bool | None = None  # None: only when stderr is a terminal
    detailed: bool = False  # per-token ITLs in the report
    timeline_bin_s: float | None = None  # None: the run's duration / 40, within 20 ms .. 1 s
    request_timeout: float = 600.0
    label: str = ""
    use_cache: bool = False  # False: every request bypasses the server's response cache
    frame_version: int = FRAME_VERSION  # the HELLO's protocol version (1: an older daemon)
    progress_interval_s: float = 5.0  # the progress line's period when stderr is not a terminal
    extra: dict[str, Any] = field(default_factory=dict)  # copied into the report (settings)
