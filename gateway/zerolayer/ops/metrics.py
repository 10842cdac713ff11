"""The daemon's Prometheus metrics: one dedicated registry and the cheap calls the hot path makes.

Names follow vLLM's meaning with a ``zerolayer_`` prefix, so existing dashboards port by a rename.
Every labelled child is resolved once here, at start-up; a call on the hot path is one attribute
(or dict) lookup plus ``inc``/``observe``/``set``. No label ever names a key, client or connection,
so the number of series is fixed by this file. docs/metrics.md lists every metric.
"""

from __future__ import annotations

import bisect
import builtins
import itertools
import time
from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.metrics_core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.utils import floatToGoString

from zerolayer.codes import (  # APIS: doors (Stream.api)
    APIS,
    DONE_REASONS,
    FRAMES,
    ErrorCode,
    FrameType,
)

__all__ = [
    "CONTENT_TYPE_LATEST",
    "ERROR_CODES",
    "FINISH_REASONS",
    "FRAME_TYPES",
    "Metrics",
]

# The protocol's names (docs/protocol.md); each gets a pre-resolved child.
FRAME_TYPES: tuple[str, ...] = tuple(t.name for t in FrameType)
FINISH_REASONS: tuple[str, ...] = tuple(r.label for r in DONE_REASONS)
ERROR_CODES: tuple[str, ...] = tuple(c.name for c in ErrorCode)
DIRECTIONS: tuple[str, ...] = ("in", "out")
PHASES: tuple[str, ...] = ("prefill", "decode")

# LLM-sized buckets: a first token can take from a millisecond (cache hit) to minutes (long
# prompt on a saturated host); a whole request up to many minutes.
TTFT_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75,
    1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0, 640.0,
)  # fmt: skip
ITL_BUCKETS = (
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05,
    0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0,
)  # fmt: skip
E2E_BUCKETS = (
    0.01, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0,
    30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0,
)  # fmt: skip
QUEUE_BUCKETS = (
    0.0001, 0.0005, 0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5,
    1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0, 640.0,
)  # fmt: skip
BATCH_BUCKETS = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512)

# A pre-resolved child's key: its label values, where a protocol enum's int (or its upper-case
# name) may stand for one (the aliases Metrics sets up).
LabelKey = tuple[str | int, ...]


class Tally:
    """A counter or gauge that ONE thread writes (the event loop, or the engine thread), so
    ``inc`` and ``set`` take no lock: one attribute write. prometheus-client's children lock and
    check on every call, which per engine step and per write costs more than the work they count
    (docs/benchmarks.md, paced serving). A scrape reads ``value`` through ``TallyFamilies``."""

    __slots__ = ("value",)

    def __init__(self) -> None:
        self.value = 0.0

    def inc(self, amount: float = 1.0) -> None:
        self.value += amount

    def set(self, value: float) -> None:
        self.value = value


class TallyHistogram:
    """A histogram that one thread writes, without a lock (see Tally)."""

    __slots__ = ("bounds", "counts", "sum")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)  # the last one is +Inf
        self.sum = 0.0

    def observe(self, value: float, times: int = 1) -> None:
        """``times`` observations of ``value``."""
        self.counts[bisect.bisect_left(self.bounds, value)] += times  # le: value <= bound
        self.sum += value * times


class TallyFamilies:
    """The collector of the Tally metrics: families built from their values at each scrape."""

    def __init__(self) -> None:
        self.created = time.time()
        self._counters: list[tuple[str, str, list[str], dict[tuple[str, ...], Tally]]] = []
        self._gauges: list[tuple[str, str, list[str], dict[tuple[str, ...], Tally]]] = []
        self._histograms: list[tuple[str, str, TallyHistogram]] = []

    def counter(
        self, name: str, doc: str, labelnames: list[str], label_values: list[tuple[str, ...]]
    ) -> dict[tuple[str, ...], Tally]:
        """A counter family (``name`` gets ``_total`` on the wire) with one Tally per label
        value tuple."""
        children = {values: Tally() for values in label_values}
        self._counters.append((name, doc, labelnames, children))
        return children

    def gauge(
        self, name: str, doc: str, labelnames: list[str], label_values: list[tuple[str, ...]]
    ) -> dict[tuple[str, ...], Tally]:
        """A gauge family with one Tally per label value tuple (``set`` by its one writer)."""
        children = {values: Tally() for values in label_values}
        self._gauges.append((name, doc, labelnames, children))
        return children

    def histogram(self, name: str, doc: str, bounds: tuple[float, ...]) -> TallyHistogram:
        hist = TallyHistogram(bounds)
        self._histograms.append((name, doc, hist))
        return hist

    def collect(self) -> Iterator[Metric]:
        for name, doc, labelnames, children in self._counters:
            family = CounterMetricFamily(name, doc, labels=labelnames)
            for values, tally in list(children.items()):  # a copy: _new_child may add one
                family.add_metric(values, tally.value, created=self.created)
            yield family
        for name, doc, labelnames, children in self._gauges:
            gauge = GaugeMetricFamily(name, doc, labels=labelnames)
            for values, tally in children.items():
                gauge.add_metric(values, tally.value)
            yield gauge
        for name, doc, hist in self._histograms:
            cumulative = list(itertools.accumulate(hist.counts))
            les = [*map(floatToGoString, hist.bounds), "+Inf"]
            buckets = list(zip(les, cumulative, strict=True))
            yield HistogramMetricFamily(name, doc, buckets=buckets, sum_value=hist.sum)


class Metrics:
    """All zerolayer_* metrics in a private CollectorRegistry, with hot-path methods.

    Callable from the event loop and the engine thread alike: prometheus-client locks each
    child, except for the Tally metrics, each of which has one writer: the engine thread
    (``engine_step``, ``prefix_lookup``, ``prefix_bytes``) or the event loop (the per-request
    families: ``request_finished``, ``request_error``, ``inter_token``; and ``frames``,
    ``bytes``). ``registry`` is where other collectors (neuron-monitor) register too.
    """

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry(auto_describe=True)
        r = self.registry
        p = "zerolayer_"

        self.running = Gauge(p + "num_requests_running", "Sequences holding a KV slot.", registry=r)
        self.waiting = Gauge(
            p + "num_requests_waiting", "Requests queued for a KV slot.", registry=r
        )
        # The share of the rows (zerolayer.engine.admission) by principal class: the keys
        # file's ``class`` values, "default" and "anonymous"; never a key's name.
        self.class_running = Gauge(
            p + "principal_rows_running",
            "Rows (sequences, n choices counted as n) holding a KV slot, by principal class.",
            ["principal_class"],
            registry=r,
        )
        self.class_waiting = Gauge(
            p + "principal_rows_waiting",
            "Rows queued for a KV slot, by principal class.",
            ["principal_class"],
            registry=r,
        )
        self.class_preempted = Counter(
            p + "principal_rows_preempted",
            "Rows preempted (KV freed, recomputed later) to give their slot to another "
            "principal waiting, by principal class.",
            ["principal_class"],
            registry=r,
        )
        self._class_preempted_shown: dict[str, int] = {}  # set_classes: counted up to here
        tallies = TallyFamilies()
        # Written on the event loop only (the request path and the doors).
        self.ttft = tallies.histogram(
            p + "time_to_first_token_seconds",
            "Request received to first TOKEN frame written, seconds.",
            TTFT_BUCKETS,
        )
        self.itl = tallies.histogram(
            p + "inter_token_latency_seconds",
            "Time between consecutive output tokens of one stream, seconds.",
            ITL_BUCKETS,
        )
        self.e2e = tallies.histogram(
            p + "e2e_request_latency_seconds",
            "Request received to DONE written, seconds (successful requests).",
            E2E_BUCKETS,
        )
        self.queue_time = tallies.histogram(
            p + "request_queue_time_seconds",
            "Time a request waited for a batch slot, seconds.",
            QUEUE_BUCKETS,
        )
        prompt_tokens = tallies.counter(
            p + "prompt_tokens",
            "Prompt tokens of finished requests, by API.",
            ["api"],
            [(api,) for api in APIS],
        )
        generation_tokens = tallies.counter(
            p + "generation_tokens",
            "Output tokens sent to clients, by API.",
            ["api"],
            [(api,) for api in APIS],
        )
        success = tallies.counter(
            p + "request_success",
            "Requests that ended in DONE, by finish reason and API.",
            ["finished_reason", "api"],
            [(reason, api) for reason in FINISH_REASONS for api in APIS],
        )
        errors = tallies.counter(
            p + "request_errors",
            "Requests (or connections) that ended in an error, by error code name and API.",
            ["code", "api"],
            [(code, api) for code in ERROR_CODES for api in APIS],
        )
        # Written on the engine thread only.
        busy = tallies.counter(
            p + "backend_busy_seconds",
            "Backend (device) time spent in engine steps, seconds: the NeuronCore-seconds.",
            ["phase"],
            [(phase,) for phase in PHASES],
        )
        self.batch_size = tallies.histogram(
            p + "batch_size", "Sequences per engine step.", BATCH_BUCKETS
        )
        self.kv_slots_used = Gauge(
            p + "kv_slots_used_ratio", "Fraction of KV-cache slots in use (0..1).", registry=r
        )
        self.kv_pages_used = Gauge(
            p + "kv_pages_used_ratio",
            "Fraction of the KV pages in use (0..1; 0 on a backend without pages).",
            registry=r,
        )
        self.kv_preemptions = Counter(
            p + "kv_preemptions",
            "Sequences preempted (KV pages freed, recomputed later) for lack of KV pages.",
            registry=r,
        )
        self.kv_admission_waits = Counter(
            p + "kv_admission_waits",
            "Sequences that waited for KV pages before admission (each counted once).",
            registry=r,
        )
        # Written by the prefix store's owner: the engine thread (once per admitted request and
        # per prompt whose blocks it keeps), or start-up before it runs.
        self._prefix_queries = tallies.counter(
            p + "prefix_cache_queries",
            "Prompt tokens of requests looked up in the prefix store.",
            [],
            [()],
        )[()]
        self._prefix_hits = tallies.counter(
            p + "prefix_cache_hits",
            "Prompt tokens whose KV was copied from the prefix store instead of prefilled.",
            [],
            [()],
        )[()]
        prefix_bytes = tallies.gauge(
            p + "prefix_cache_bytes",
            "KV bytes held by the prefix store: pinned (registered prompts) and cached (LRU).",
            ["kind"],
            [("pinned",), ("cached",)],
        )
        self._prefix_pinned = prefix_bytes[("pinned",)]
        self._prefix_cached = prefix_bytes[("cached",)]
        self.response_cache_hits = Counter(
            p + "response_cache_hits", "Requests answered from the response cache.", registry=r
        )
        self.rate_limited_total = Counter(
            p + "rate_limited", "Requests refused by the rate limiter.", registry=r
        )
        self.connections = Gauge(p + "connections", "Open client connections.", registry=r)
        # Written on the event loop only (the doors).
        frames = tallies.counter(
            p + "frames",
            "Protocol frames, by direction (in = from clients) and frame type.",
            ["direction", "type"],
            [(d, t) for d in DIRECTIONS for t in FRAME_TYPES],
        )
        nbytes = tallies.counter(
            p + "bytes",
            "Protocol bytes (headers and payloads), by direction.",
            ["direction"],
            [(d,) for d in DIRECTIONS],
        )
        r.register(tallies)

        # Pre-resolved children: the hot path never calls .labels().
        self._success: dict[LabelKey, Tally] = {k: v for k, v in success.items()}
        self._errors: dict[LabelKey, Tally] = {k: v for k, v in errors.items()}
        self._success_family, self._errors_family = success, errors
        self._prompt_tokens = {api: prompt_tokens[(api,)] for api in APIS}
        self._generation_tokens = {api: generation_tokens[(api,)] for api in APIS}
        self._busy = {phase: busy[(phase,)] for phase in PHASES}
        self._frames: dict[LabelKey, Tally] = {k: v for k, v in frames.items()}
        self._bytes = {d: nbytes[(d,)] for d in DIRECTIONS}
        # Aliases so a caller can pass the protocol enums (IntEnum hashes as its int) or their
        # upper-case names without converting: FinishReason.EOS, "EOS", "eos" are one child.
        for api in APIS:
            for reason in DONE_REASONS:
                child = self._success[(reason.label, api)]
                self._success[(int(reason), api)] = self._success[(reason.name, api)] = child
            for code in ErrorCode:
                self._errors[(int(code), api)] = self._errors[(code.name, api)]
        for ftype in FrameType:
            for d in DIRECTIONS:
                self._frames[(d, int(ftype))] = self._frames[(d, ftype.name)]
        # Named children for the commonest calls, so a caller can hold them directly.
        self.frames_in_request = self._frames[("in", "REQUEST")]
        self.frames_out_token = self._frames[("out", "TOKEN")]
        self.frames_out_done = self._frames[("out", "DONE")]
        self.frames_out_logprobs = self._frames[("out", "LOGPROBS")]
        self.bytes_in = self._bytes["in"]
        self.bytes_out = self._bytes["out"]

    # -- requests -------------------------------------------------------------------------

    def request_finished(
        self,
        finished_reason: str | int,
        prompt_tokens: int,
        completion_tokens: int,
        queue_s: float,
        ttft_s: float | None,
        e2e_s: float,
        api: str = FRAMES,
    ) -> None:
        """A stream ended in DONE. ``ttft_s`` is None when no token was sent.

        ``finished_reason``: "eos"/"max_tokens"/"stop"/"cancelled", upper case, or the protocol's
        FinishReason value; ``api``: the door (APIS).
        """
        child = self._success.get((finished_reason, api))
        if child is None:
            child = self._new_child(self._success_family, (str(finished_reason), api))
            self._success[(finished_reason, api)] = child
        child.inc()
        self._prompt_tokens[api].inc(prompt_tokens)
        self._generation_tokens[api].inc(completion_tokens)
        self.queue_time.observe(queue_s)
        if ttft_s is not None:
            self.ttft.observe(ttft_s)
        self.e2e.observe(e2e_s)

    def request_disconnected(
        self, prompt_tokens: int, completion_tokens: int, api: str = FRAMES
    ) -> None:
        """A stream ended because its client went away (no DONE could be written): counted as
        finished_reason "cancelled", with the tokens sent before; no latency is observed."""
        key = ("cancelled", api)
        child = self._success.get(key)
        if child is None:
            child = self._new_child(self._success_family, key)
            self._success[key] = child
        child.inc()
        self._prompt_tokens[api].inc(prompt_tokens)
        self._generation_tokens[api].inc(completion_tokens)

    def request_error(self, code_name: str | int, api: str = FRAMES) -> None:
        """An ERROR was sent (a frame, or an HTTP error response or event); ``code_name`` is the
        protocol name ("OVERLOADED") or the ErrorCode value, ``api`` the door (APIS)."""
        child = self._errors.get((code_name, api))
        if child is None:
            child = self._new_child(self._errors_family, (str(code_name), api))
            self._errors[(code_name, api)] = child
        child.inc()

    @staticmethod
    def _new_child(family: dict[tuple[str, ...], Tally], values: tuple[str, ...]) -> Tally:
        """A series for label values outside the tables (which zerolayer.codes defines, so only a
        caller's bug gets here): exported like the others rather than failing the request."""
        return family.setdefault(values, Tally())

    def inter_token(self, seconds: float, n: int = 1) -> None:
        """``n`` tokens arrived ``seconds`` after the stream's previous token delivery.

        When one delivery carries several tokens, the gap is shared: each token counts as
        ``seconds / n`` apart, so the histogram's sum stays the stream's real decode time.
        """
        if n <= 1:
            self.itl.observe(seconds)
            return
        # n equal observations in O(1) (a stream's DONE reports all its gaps at once).
        self.itl.observe(seconds / n, n)

    def prefix_lookup(self, queried: int, hit: int) -> None:
        """The prefix store was asked for a ``queried``-token prompt and supplied ``hit`` tokens
        of KV (engine thread, once per admitted request)."""
        self._prefix_queries.inc(queried)
        if hit:
            self._prefix_hits.inc(hit)

    def prefix_bytes(self, pinned: int, cached: int) -> None:
        """What the prefix store holds now."""
        self._prefix_pinned.set(pinned)
        self._prefix_cached.set(cached)

    def response_cache_hit(self) -> None:
        self.response_cache_hits.inc()

    def rate_limited(self) -> None:
        self.rate_limited_total.inc()

    # -- engine ---------------------------------------------------------------------------

    def engine_step(self, phase: str, busy_s: float, batch_size: int) -> None:
        """One backend call: ``phase`` is "prefill" or "decode", ``busy_s`` its wall time."""
        self._busy[phase].inc(busy_s)
        self.batch_size.observe(batch_size)

    def set_queue(self, running: int, waiting: int, slots_used: int, slots_total: int) -> None:
        """Scheduler occupancy, set once per step (gauges: last value wins)."""
        self.running.set(running)
        self.waiting.set(waiting)
        self.kv_slots_used.set(slots_used / slots_total if slots_total else 0.0)

    def kv_pages(self, used_ratio: float, preemptions: int, admission_waits: int) -> None:
        """The KV pages' occupancy and new preemptions and waits (engine thread, when they
        changed)."""
        self.kv_pages_used.set(used_ratio)
        if preemptions:
            self.kv_preemptions.inc(preemptions)
        if admission_waits:
            self.kv_admission_waits.inc(admission_waits)

    def set_classes(
        self, rows: dict[str, list[int]], preempted: dict[str, int] | None = None
    ) -> None:
        """Rows [running, waiting] by principal class, and the rows preempted so far for
        another principal, set when they change."""
        for principal_class, (running, waiting) in rows.items():
            self.class_running.labels(principal_class).set(running)
            self.class_waiting.labels(principal_class).set(waiting)
            self.class_preempted.labels(principal_class)  # exported at 0
        for principal_class, total in (preempted or {}).items():
            shown = self._class_preempted_shown.get(principal_class, 0)
            if total > shown:
                self.class_preempted.labels(principal_class).inc(total - shown)
                self._class_preempted_shown[principal_class] = total

    # -- connections and frames -----------------------------------------------------------

    def connection_opened(self) -> None:
        self.connections.inc()

    def connection_closed(self) -> None:
        self.connections.dec()

    def frames(self, direction: str, type_name: str | int, n: int = 1) -> None:
        """Count ``n`` frames of one type ("TOKEN" or FrameType.TOKEN); callers batch (e.g. per
        read or per engine step)."""
        self._frames[(direction, type_name)].inc(n)

    def bytes(self, direction: str, n: int) -> None:
        self._bytes[direction].inc(n)

    # -- exposition -----------------------------------------------------------------------

    def render(self) -> builtins.bytes:  # plain ``bytes`` here names the method above
        """The registry in Prometheus text format (what GET /metrics returns)."""
        return generate_latest(self.registry)
