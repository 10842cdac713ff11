"""neuron-monitor as a supervised child process, its JSON reports exported as Prometheus metrics.

``neuron-monitor`` (AWS Neuron tools) prints one JSON report per period on stdout: per Neuron
runtime (``neuron_runtime_data[].report``) and per host (``system_data``), each metric group with
its own ``error`` field. ``NeuronMonitorExporter.update`` maps one report onto metrics named as
AWS's ``neuron-monitor-prometheus.py`` names them (``neuroncore_utilization_ratio``,
``neuron_runtime_memory_used_bytes``, ``execution_errors_total``, ...), so AWS's dashboards and
queries work against our /metrics unchanged. ``NeuronMonitor`` runs the binary, feeds each line
to the exporter, and restarts it with exponential backoff; nothing it does can stop the daemon.
"""

from __future__ import annotations

import collections
import json
import logging
import os
import shutil
import subprocess
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge

__all__ = [
    "NeuronMonitor",
    "NeuronMonitorExporter",
    "parse_line",
    "resolve_neuron_monitor",
    "start_neuron_monitor",
]

log = logging.getLogger("zerolayer.ops.neuron_monitor")

# Where the aws-neuronx-tools package installs the binary; systemd units often lack it on PATH.
DEFAULT_BINARY_DIR = "/opt/aws/neuron/bin"

INSTANCE_LABELS = (
    "instance_name",
    "instance_id",
    "instance_type",
    "availability_zone",
    "region",
    "subnet_id",
)
RUNTIME_LABELS = (*INSTANCE_LABELS, "runtime_tag")
NEURONCORE_MEMORY_KINDS = (
    "constants",
    "model_code",
    "model_shared_scratchpad",
    "runtime_memory",
    "tensors",
)
ECC_EVENTS = (
    "mem_ecc_corrected",
    "mem_ecc_uncorrected",
    "sram_ecc_corrected",
    "sram_ecc_uncorrected",
)
# System vCPU usage folded into two ratios, as AWS's exporter reports them.
VCPU_USAGE_FOLD = {"user": ("user", "nice"), "system": ("system", "io_wait", "irq", "soft_irq")}
RUNTIME_GROUPS = (
    "neuroncore_counters",
    "memory_used",
    "neuron_runtime_vcpu_usage",
    "execution_stats",
)
SYSTEM_GROUPS = ("neuron_hw_counters", "vcpu_usage", "memory_info")


def _num(value: Any) -> float | None:
    """A finite report number, or None for anything else (bool, str, null, NaN)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    f = float(value)
    if f != f or f in (float("inf"), float("-inf")):
        return None
    return f


def parse_line(line: str | bytes) -> dict[str, Any] | None:
    """One stdout line -> report dict, or None for a blank, truncated or non-object line."""
    try:
        report = json.loads(line)
    except (ValueError, UnicodeDecodeError):
        return None
    return report if isinstance(report, dict) else None


class NeuronMonitorExporter:
    """Owns the neuron-monitor metrics in ``registry``; ``update`` applies one report.

    Gauges take the report's values; counters (execution errors/status, ECC events) add them,
    because neuron-monitor reports those as counts within the report's period.
    """

    def __init__(self, registry: CollectorRegistry) -> None:
        r = registry
        rl = RUNTIME_LABELS
        il = INSTANCE_LABELS
        self.core_utilization = Gauge(
            "neuroncore_utilization_ratio", "NeuronCore utilization ratio", [*rl, "neuroncore"],
            registry=r,
        )  # fmt: skip
        self.core_flops = Gauge(
            "neuroncore_flops",
            "NeuronCore floating point operations per second (effective_flops when reported)",
            [*rl, "neuroncore"],
            registry=r,
        )
        self.runtime_memory = Gauge(
            "neuron_runtime_memory_used_bytes", "Runtime memory used bytes",
            [*rl, "memory_location"], registry=r,
        )  # fmt: skip
        self.core_memory = {
            kind: Gauge(
                f"neuroncore_memory_usage_{kind}",
                f"NeuronCore memory utilization for {kind}",
                [*rl, "neuroncore"],
                registry=r,
            )
            for kind in NEURONCORE_MEMORY_KINDS
        }
        self.runtime_vcpu = Gauge(
            "neuron_runtime_vcpu_usage_ratio", "Runtime vCPU utilization ratio",
            [*rl, "usage_type"], registry=r,
        )  # fmt: skip
        self.execution_errors = Counter(
            "execution_errors", "Execution errors total", [*rl, "error_type"], registry=r
        )
        self.execution_status = Counter(
            "execution_status", "Execution status total", [*rl, "status_type"], registry=r
        )
        self.execution_latency = Gauge(
            "execution_latency_seconds", "Execution latency in seconds", [*rl, "percentile"],
            registry=r,
        )  # fmt: skip
        self.ecc_events = Counter(
            "neurondevice_hw_ecc_events", "Neuron device hardware ECC events",
            [*il, "neuron_device_index", "event_type"], registry=r,
        )  # fmt: skip
        self.vcpu_count = Gauge("system_vcpu_count", "System vCPU count", il, registry=r)
        self.vcpu_usage = Gauge(
            "system_vcpu_usage_ratio", "System CPU utilization ratio", [*il, "usage_type"],
            registry=r,
        )  # fmt: skip
        self.system_memory = {
            field: Gauge(f"system_{field}", f"System {field.replace('_', ' ')}", il, registry=r)
            for field in (
                "memory_total_bytes",
                "memory_used_bytes",
                "swap_total_bytes",
                "swap_used_bytes",
            )
        }
        self.instance_info = Gauge("instance_info", "EC2 instance information", il, registry=r)
        self.hardware_info = Gauge(
            "neuron_hardware_info",
            "Neuron hardware information",
            [
                *il,
                "neuron_device_type",
                "neuron_device_version",
                "neuroncore_version",
                "neuron_device_count",
                "neuroncore_per_device_count",
            ],
            registry=r,
        )
        # Our own health of the pipeline.
        self.up = Gauge(
            "zerolayer_neuron_monitor_up",
            "1 while neuron-monitor runs and its last line parsed, else 0.",
            registry=r,
        )
        self.reports = Counter(
            "zerolayer_neuron_monitor_reports", "neuron-monitor reports applied.", registry=r
        )
        self.bad_reports = Counter(
            "zerolayer_neuron_monitor_bad_reports",
            "neuron-monitor output lines that were not a JSON object.",
            registry=r,
        )
        self.group_errors = Counter(
            "zerolayer_neuron_monitor_group_errors",
            "Metric groups skipped: error field set by neuron-monitor, or malformed.",
            ["group"],
            registry=r,
        )
        self.restarts = Counter(
            "zerolayer_neuron_monitor_restarts",
            "Times neuron-monitor exited or failed to start and was started again.",
            registry=r,
        )
        self._runtime_gauges: list[Gauge] = [
            self.core_utilization,
            self.core_flops,
            self.runtime_memory,
            *self.core_memory.values(),
            self.runtime_vcpu,
            self.execution_latency,
        ]
        self._instance: tuple[str, ...] = ("",) * len(INSTANCE_LABELS)
        self._logged_errors: set[tuple[str, str]] = set()

    # -- one report -----------------------------------------------------------------------

    def update(self, report: Mapping[str, Any]) -> None:
        """Apply one report. Missing or failed groups are skipped; never raises on bad data."""
        if not isinstance(report, Mapping):
            self.bad_reports.inc()
            return
        self._update_instance(report.get("instance_info"))
        runtimes = report.get("neuron_runtime_data")
        if isinstance(runtimes, list) and runtimes:
            for runtime in runtimes:
                self._update_runtime(runtime)
        elif "neuron_runtime_data" in report:
            # No runtime alive (ours restarted or not yet loaded): stale per-core values would
            # lie, so drop them until a runtime reports again.
            for g in self._runtime_gauges:
                g.clear()
        system = report.get("system_data")
        if isinstance(system, Mapping):
            for name in SYSTEM_GROUPS:
                self._apply(name, system.get(name), self._instance, None)
        self._update_hardware(report.get("neuron_hardware_info"))
        self.reports.inc()

    def _ok(self, name: str, group: Any, where: str | None) -> bool:
        if group is None:
            return False  # group not enabled in neuron-monitor's config: nothing to say
        if not isinstance(group, Mapping):
            self.group_errors.labels(name).inc()
            return False
        err = group.get("error") or ""
        if err:
            self.group_errors.labels(name).inc()
            key = (name, str(err))
            if key not in self._logged_errors and len(self._logged_errors) < 256:
                self._logged_errors.add(key)
                log.warning("neuron-monitor %s%s: %s", name, f" ({where})" if where else "", err)
            return False
        return True

    def _apply(self, name: str, group: Any, labels: tuple[str, ...], where: str | None) -> None:
        if not self._ok(name, group, where):
            return
        handler = getattr(self, "_group_" + name)
        try:
            handler(group, labels)
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            self.group_errors.labels(name).inc()
            log.debug("neuron-monitor %s malformed: %r", name, exc)

    def _update_instance(self, info: Any) -> None:
        if not isinstance(info, Mapping) or info.get("error"):
            return

        def s(key: str) -> str:
            v = info.get(key)
            return v if isinstance(v, str) else ""

        labels = (
            s("instance_name"),
            s("instance_id"),
            s("instance_type"),
            s("instance_availability_zone"),
            s("instance_region"),
            s("subnet_id"),
        )
        if labels != self._instance:
            self.instance_info.clear()
            self._instance = labels
        self.instance_info.labels(*labels).set(1)

    def _update_hardware(self, info: Any) -> None:
        if not isinstance(info, Mapping) or info.get("error"):
            return

        def s(key: str) -> str:
            v = info.get(key)
            return "" if v is None or isinstance(v, (dict, list)) else str(v)

        self.hardware_info.clear()
        self.hardware_info.labels(
            *self._instance,
            s("neuron_device_type"),
            s("neuron_device_version"),
            s("neuroncore_version"),
            s("neuron_device_count"),
            s("neuroncore_per_device_count"),
        ).set(1)

    def _update_runtime(self, runtime: Any) -> None:
        if not isinstance(runtime, Mapping):
            self.group_errors.labels("neuron_runtime_data").inc()
            return
        tag = str(runtime.get("neuron_runtime_tag") or runtime.get("pid") or "")
        if not self._ok("neuron_runtime_data", runtime, f"runtime {tag}"):
            return
        report = runtime.get("report")
        if not isinstance(report, Mapping):
            return
        labels = (*self._instance, tag)
        for name in RUNTIME_GROUPS:
            self._apply(name, report.get(name), labels, f"runtime {tag}")

    # -- runtime groups -------------------------------------------------------------------

    def _group_neuroncore_counters(self, g: Mapping[str, Any], labels: tuple[str, ...]) -> None:
        for core, data in g["neuroncores_in_use"].items():
            util = _num(data.get("neuroncore_utilization"))
            if util is not None:
                self.core_utilization.labels(*labels, str(core)).set(util / 100.0)
            # Newer neuron-monitor reports effective_flops; older ones flops only.
            flops = _num(data.get("effective_flops"))
            if flops is None:
                flops = _num(data.get("flops"))
            if flops is not None:
                self.core_flops.labels(*labels, str(core)).set(flops)

    def _group_memory_used(self, g: Mapping[str, Any], labels: tuple[str, ...]) -> None:
        used = g["neuron_runtime_used_bytes"]
        for location in ("host", "neuron_device"):
            v = _num(used.get(location))
            if v is not None:
                self.runtime_memory.labels(*labels, location).set(v)
        breakdown = used.get("usage_breakdown") or {}
        for core, kinds in (breakdown.get("neuroncore_memory_usage") or {}).items():
            for kind, gauge in self.core_memory.items():
                v = _num(kinds.get(kind))
                if v is not None:
                    gauge.labels(*labels, str(core)).set(v)

    def _group_neuron_runtime_vcpu_usage(
        self, g: Mapping[str, Any], labels: tuple[str, ...]
    ) -> None:
        usage = g["vcpu_usage"]
        for kind in ("user", "system"):
            v = _num(usage.get(kind))
            if v is not None:
                self.runtime_vcpu.labels(*labels, kind).set(v / 100.0)

    def _group_execution_stats(self, g: Mapping[str, Any], labels: tuple[str, ...]) -> None:
        for error_type, count in (g.get("error_summary") or {}).items():
            v = _num(count)
            if v is not None and v >= 0:
                self.execution_errors.labels(*labels, str(error_type)).inc(v)
        for status, count in (g.get("execution_summary") or {}).items():
            v = _num(count)
            if v is not None and v >= 0:
                self.execution_status.labels(*labels, str(status)).inc(v)
        total = (g.get("latency_stats") or {}).get("total_latency")
        if isinstance(total, Mapping):
            for percentile, seconds in total.items():
                v = _num(seconds)
                if v is not None:
                    self.execution_latency.labels(*labels, str(percentile)).set(v)

    # -- system groups --------------------------------------------------------------------

    def _group_neuron_hw_counters(self, g: Mapping[str, Any], labels: tuple[str, ...]) -> None:
        for device in g["neuron_devices"]:
            index = str(device["neuron_device_index"])
            for event in ECC_EVENTS:
                v = _num(device.get(event))
                if v is not None and v >= 0:
                    self.ecc_events.labels(*labels, index, event).inc(v)

    def _group_vcpu_usage(self, g: Mapping[str, Any], labels: tuple[str, ...]) -> None:
        per_cpu = g.get("usage_data")
        if isinstance(per_cpu, Mapping):
            self.vcpu_count.labels(*labels).set(len(per_cpu))
        average = g["average_usage"]
        for kind, fields in VCPU_USAGE_FOLD.items():
            parts = [_num(average.get(f)) for f in fields]
            total = sum(p for p in parts if p is not None)
            self.vcpu_usage.labels(*labels, kind).set(min(total, 100.0) / 100.0)

    def _group_memory_info(self, g: Mapping[str, Any], labels: tuple[str, ...]) -> None:
        for field, gauge in self.system_memory.items():
            v = _num(g.get(field))
            if v is not None:
                gauge.labels(*labels).set(v)


def next_backoff(current: float, maximum: float) -> float:
    """The delay after ``current``: doubled, capped at ``maximum``."""
    return min(current * 2.0, maximum)


class NeuronMonitor:
    """Runs ``argv`` (neuron-monitor) in a thread, feeding each stdout line to ``exporter``.

    When the child exits or cannot start, it is started again after a delay that doubles from
    ``backoff_initial`` to ``backoff_max``; a run that lasted ``healthy_after_s`` resets it.
    """

    def __init__(
        self,
        exporter: NeuronMonitorExporter,
        argv: Sequence[str],
        *,
        backoff_initial: float = 1.0,
        backoff_max: float = 60.0,
        healthy_after_s: float = 60.0,
    ) -> None:
        self.exporter = exporter
        self.argv = list(argv)
        self.backoff_initial = backoff_initial
        self.backoff_max = backoff_max
        self.healthy_after_s = healthy_after_s
        self.delays: collections.deque[float] = collections.deque(maxlen=32)  # recent backoffs
        self.runs = 0  # child processes started
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._proc: subprocess.Popen[bytes] | None = None
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(
            target=self._supervise, name="zerolayer-neuron-monitor", daemon=True
        )
        self._thread.start()

    def close(self, timeout: float = 5.0) -> None:
        """Stop supervising and terminate the child."""
        self._stop.set()
        with self._lock:
            proc = self._proc
        if proc is not None and proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        if self._thread is not None:
            self._thread.join(timeout)
        self.exporter.up.set(0)

    @staticmethod
    def _child_env() -> dict[str, str]:
        # The child must not talk to systemd on our behalf.
        drop = ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID")
        return {k: v for k, v in os.environ.items() if k not in drop}

    def _supervise(self) -> None:
        delay = self.backoff_initial
        while not self._stop.is_set():
            started = time.monotonic()
            try:
                self._run_once()
            except Exception:
                # Whatever happened, the daemon goes on; the monitor gets another try.
                log.exception("neuron-monitor supervision error")
            self.exporter.up.set(0)
            if self._stop.is_set():
                break
            if time.monotonic() - started >= self.healthy_after_s:
                delay = self.backoff_initial
            self.exporter.restarts.inc()
            self.delays.append(delay)
            log.warning("neuron-monitor stopped; restarting in %.3g s", delay)
            if self._stop.wait(delay):
                break
            delay = next_backoff(delay, self.backoff_max)

    def _run_once(self) -> None:
        try:
            proc = subprocess.Popen(
                self.argv,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                env=self._child_env(),
                close_fds=True,
            )
        except OSError as exc:
            log.warning("cannot start %s: %s", self.argv[0], exc)
            return
        with self._lock:
            self._proc = proc
        self.runs += 1
        if self._stop.is_set():  # close() raced the start
            proc.terminate()
        assert proc.stdout is not None
        exporter = self.exporter
        try:
            for line in proc.stdout:
                report = parse_line(line)
                if report is None:
                    if line.strip():
                        exporter.bad_reports.inc()
                    continue
                exporter.update(report)
                exporter.up.set(1)
        finally:
            proc.stdout.close()
            rc = proc.wait()
            with self._lock:
                self._proc = None
            if not self._stop.is_set():
                log.warning("neuron-monitor exited with status %s", rc)


def resolve_neuron_monitor(setting: bool | None, binary: str = "neuron-monitor") -> str | None:
    """The binary to run for ``metrics.neuron_monitor`` = ``setting``, or None to run none.

    None (the default) means: run it when installed. True with no binary logs a warning.
    """
    if setting is False:
        return None
    found = shutil.which(binary)
    if found is None and os.sep not in binary:
        candidate = Path(DEFAULT_BINARY_DIR) / binary
        if candidate.is_file() and os.access(candidate, os.X_OK):
            found = str(candidate)
    if found is None and setting:
        log.warning("metrics.neuron_monitor is on but %s was not found; not running it", binary)
    return found


def start_neuron_monitor(
    setting: bool | None,
    registry: CollectorRegistry,
    binary: str = "neuron-monitor",
    config_file: str | None = None,
) -> NeuronMonitor | None:
    """Resolve, start and return the supervised monitor, or None when it is off or absent.

    Without ``config_file`` neuron-monitor collects every metric group every 5 s.
    """
    path = resolve_neuron_monitor(setting, binary)
    if path is None:
        return None
    argv = [path] if config_file is None else [path, "-c", config_file]
    monitor = NeuronMonitor(NeuronMonitorExporter(registry), argv)
    monitor.start()
    log.info("neuron-monitor started: %s", " ".join(argv))
    return monitor
