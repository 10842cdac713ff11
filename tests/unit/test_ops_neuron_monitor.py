"""neuron-monitor: the report parser on recorded lines and edge cases, and the supervisor."""

from __future__ import annotations

import copy
import json
import stat
import sys
import threading
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from zerolayer.ops.neuron_monitor import (
    NeuronMonitor,
    NeuronMonitorExporter,
    next_backoff,
    parse_line,
    resolve_neuron_monitor,
    start_neuron_monitor,
)

# In the repo's tests/fixtures when copied there; else the shared fixtures next to the checkout.
_CANDIDATES = [
    Path(__file__).resolve().parents[1] / "fixtures" / "neuron-monitor-sample.json",
    Path(__file__).resolve().parents[3] / "shared" / "fixtures" / "neuron-monitor-sample.json",
]
FIXTURE = next((p for p in _CANDIDATES if p.exists()), _CANDIDATES[0])

INSTANCE = {
    "availability_zone": "us-east-1d",
    "instance_id": "i-0123456789abcdef0",
    "instance_name": "",
    "instance_type": "inf2.xlarge",
    "region": "us-east-1",
    "subnet_id": "subnet-0123abcd",
}
RUNTIME = {**INSTANCE, "runtime_tag": "llm-worker-0"}


@pytest.fixture(scope="module")
def sample() -> dict[str, Any]:
    if not FIXTURE.exists():
        pytest.skip(f"fixture {FIXTURE} not present")
    report = parse_line(FIXTURE.read_text().strip())
    assert report is not None
    return report


def fresh() -> tuple[CollectorRegistry, NeuronMonitorExporter]:
    reg = CollectorRegistry()
    return reg, NeuronMonitorExporter(reg)


def val(reg: CollectorRegistry, name: str, **labels: str) -> float | None:
    return reg.get_sample_value(name, labels)


def test_fixture_runtime_metrics(sample: dict[str, Any]) -> None:
    reg, exp = fresh()
    exp.update(sample)
    assert val(reg, "neuroncore_utilization_ratio", **RUNTIME, neuroncore="0") == pytest.approx(
        0.894
    )
    assert val(reg, "neuroncore_utilization_ratio", **RUNTIME, neuroncore="1") == 0.0
    assert val(reg, "neuroncore_flops", **RUNTIME, neuroncore="0") == 875590474948
    host = val(reg, "neuron_runtime_memory_used_bytes", **RUNTIME, memory_location="host")
    assert host == 1166249984
    device = val(
        reg, "neuron_runtime_memory_used_bytes", **RUNTIME, memory_location="neuron_device"
    )
    assert device == 141649980
    assert val(reg, "neuroncore_memory_usage_constants", **RUNTIME, neuroncore="0") == 100663296
    assert val(reg, "neuroncore_memory_usage_model_code", **RUNTIME, neuroncore="0") == 20971520
    assert val(reg, "neuroncore_memory_usage_tensors", **RUNTIME, neuroncore="0") == 20015164
    assert val(
        reg, "neuron_runtime_vcpu_usage_ratio", **RUNTIME, usage_type="user"
    ) == pytest.approx(0.4201)
    assert val(reg, "execution_status_total", **RUNTIME, status_type="completed") == 816
    assert val(reg, "execution_errors_total", **RUNTIME, error_type="hardware") == 0
    assert val(reg, "execution_latency_seconds", **RUNTIME, percentile="p50") == 0.00117
    assert val(reg, "execution_latency_seconds", **RUNTIME, percentile="p99") == 0.0012


def test_fixture_system_metrics(sample: dict[str, Any]) -> None:
    reg, exp = fresh()
    exp.update(sample)
    ecc = {**INSTANCE, "neuron_device_index": "0", "event_type": "mem_ecc_uncorrected"}
    assert val(reg, "neurondevice_hw_ecc_events_total", **ecc) == 0
    assert val(reg, "system_vcpu_count", **INSTANCE) == 1
    # user = user + nice; system = system + io_wait + irq + soft_irq
    assert val(reg, "system_vcpu_usage_ratio", **INSTANCE, usage_type="user") == pytest.approx(
        0.3277
    )
    assert val(reg, "system_vcpu_usage_ratio", **INSTANCE, usage_type="system") == pytest.approx(
        0.2287
    )
    assert val(reg, "system_memory_total_bytes", **INSTANCE) == 16456654848
    assert val(reg, "system_swap_used_bytes", **INSTANCE) == 0
    assert val(reg, "instance_info", **INSTANCE) == 1
    hw = {
        **INSTANCE,
        "neuron_device_type": "inferentia2",
        "neuron_device_version": "v3",
        "neuroncore_version": "v2",
        "neuron_device_count": "1",
        "neuroncore_per_device_count": "2",
    }
    assert val(reg, "neuron_hardware_info", **hw) == 1
    assert val(reg, "zerolayer_neuron_monitor_reports_total") == 1


def test_counters_accumulate_per_period(sample: dict[str, Any]) -> None:
    reg, exp = fresh()
    second = copy.deepcopy(sample)
    second["neuron_runtime_data"][0]["report"]["execution_stats"]["error_summary"]["transient"] = 2
    dev = second["system_data"]["neuron_hw_counters"]["neuron_devices"][0]
    dev["sram_ecc_corrected"] = 3
    exp.update(sample)
    exp.update(second)
    exp.update(second)
    assert val(reg, "execution_status_total", **RUNTIME, status_type="completed") == 3 * 816
    assert val(reg, "execution_errors_total", **RUNTIME, error_type="transient") == 4
    ecc = {**INSTANCE, "neuron_device_index": "0", "event_type": "sram_ecc_corrected"}
    assert val(reg, "neurondevice_hw_ecc_events_total", **ecc) == 6


def test_effective_flops_preferred(sample: dict[str, Any]) -> None:
    reg, exp = fresh()
    r = copy.deepcopy(sample)
    cores = r["neuron_runtime_data"][0]["report"]["neuroncore_counters"]["neuroncores_in_use"]
    cores["0"]["effective_flops"] = 123.0  # newer neuron-monitor: both fields present
    del cores["1"]["flops"]
    cores["1"]["effective_flops"] = 7.0  # only the newer field
    exp.update(r)
    assert val(reg, "neuroncore_flops", **RUNTIME, neuroncore="0") == 123.0
    assert val(reg, "neuroncore_flops", **RUNTIME, neuroncore="1") == 7.0


def test_group_error_skips_only_that_group(sample: dict[str, Any]) -> None:
    reg, exp = fresh()
    r = copy.deepcopy(sample)
    rt = r["neuron_runtime_data"][0]["report"]
    rt["memory_used"]["error"] = "failed to read memory stats"
    r["system_data"]["neuron_hw_counters"]["error"] = "driver too old"
    exp.update(r)
    assert val(reg, "neuron_runtime_memory_used_bytes", **RUNTIME, memory_location="host") is None
    ecc = {**INSTANCE, "neuron_device_index": "0", "event_type": "mem_ecc_corrected"}
    assert val(reg, "neurondevice_hw_ecc_events_total", **ecc) is None
    # The other groups still apply.
    assert val(reg, "neuroncore_utilization_ratio", **RUNTIME, neuroncore="0") == pytest.approx(
        0.894
    )
    assert val(reg, "system_memory_used_bytes", **INSTANCE) == 6042344448
    assert val(reg, "zerolayer_neuron_monitor_group_errors_total", group="memory_used") == 1
    assert val(reg, "zerolayer_neuron_monitor_group_errors_total", group="neuron_hw_counters") == 1


def test_runtime_error_skips_runtime(sample: dict[str, Any]) -> None:
    reg, exp = fresh()
    r = copy.deepcopy(sample)
    r["neuron_runtime_data"][0]["error"] = "runtime not responding"
    exp.update(r)
    assert val(reg, "neuroncore_utilization_ratio", **RUNTIME, neuroncore="0") is None
    assert val(reg, "system_memory_total_bytes", **INSTANCE) == 16456654848
    assert val(reg, "zerolayer_neuron_monitor_group_errors_total", group="neuron_runtime_data") == 1


def test_missing_groups(sample: dict[str, Any]) -> None:
    reg, exp = fresh()
    r = copy.deepcopy(sample)
    del r["neuron_runtime_data"][0]["report"]["execution_stats"]
    del r["neuron_runtime_data"][0]["report"]["neuroncore_counters"]
    del r["system_data"]
    del r["neuron_hardware_info"]
    exp.update(r)
    assert val(reg, "neuroncore_utilization_ratio", **RUNTIME, neuroncore="0") is None
    assert val(reg, "execution_latency_seconds", **RUNTIME, percentile="p50") is None
    assert val(reg, "neuron_runtime_memory_used_bytes", **RUNTIME, memory_location="host") == (
        1166249984
    )
    assert val(reg, "system_vcpu_count", **INSTANCE) is None
    # A group that is absent is not an error (not enabled in neuron-monitor's config).
    assert val(reg, "zerolayer_neuron_monitor_group_errors_total", group="execution_stats") is None
    exp.update({})  # nothing at all: still no exception
    assert val(reg, "zerolayer_neuron_monitor_reports_total") == 2


def test_no_runtime_clears_runtime_gauges(sample: dict[str, Any]) -> None:
    reg, exp = fresh()
    exp.update(sample)
    assert val(reg, "neuroncore_utilization_ratio", **RUNTIME, neuroncore="0") is not None
    r = copy.deepcopy(sample)
    r["neuron_runtime_data"] = []
    exp.update(r)
    assert val(reg, "neuroncore_utilization_ratio", **RUNTIME, neuroncore="0") is None
    assert val(reg, "system_memory_total_bytes", **INSTANCE) == 16456654848


def test_malformed_values_do_not_raise(sample: dict[str, Any]) -> None:
    reg, exp = fresh()
    r = copy.deepcopy(sample)
    rt = r["neuron_runtime_data"][0]["report"]
    rt["neuroncore_counters"]["neuroncores_in_use"]["0"]["neuroncore_utilization"] = "high"
    rt["execution_stats"]["error_summary"]["generic"] = -5  # a counter never goes down
    rt["memory_used"]["neuron_runtime_used_bytes"] = None  # wrong type: group counted, skipped
    r["system_data"]["vcpu_usage"] = "garbage"
    r["neuron_runtime_data"].append(17)
    exp.update(r)
    assert val(reg, "neuroncore_utilization_ratio", **RUNTIME, neuroncore="0") is None
    assert val(reg, "neuroncore_utilization_ratio", **RUNTIME, neuroncore="1") == 0.0
    assert val(reg, "execution_errors_total", **RUNTIME, error_type="generic") is None
    assert val(reg, "zerolayer_neuron_monitor_group_errors_total", group="memory_used") == 1
    assert val(reg, "zerolayer_neuron_monitor_group_errors_total", group="vcpu_usage") == 1
    assert val(reg, "zerolayer_neuron_monitor_group_errors_total", group="neuron_runtime_data") == 1


@pytest.mark.parametrize(
    "line", ["", "   ", "not json", '{"truncated": ', "[1, 2]", "42", b"\xff\xfe", '"s"']
)
def test_parse_line_garbage(line: str | bytes) -> None:
    assert parse_line(line) is None


def test_parse_line_bytes(sample: dict[str, Any]) -> None:
    assert parse_line(json.dumps(sample).encode() + b"\n") == sample


def test_update_rejects_non_mapping() -> None:
    reg, exp = fresh()
    exp.update([1, 2, 3])  # type: ignore[arg-type]
    assert val(reg, "zerolayer_neuron_monitor_bad_reports_total") == 1


def test_next_backoff() -> None:
    assert next_backoff(1.0, 60.0) == 2.0
    assert next_backoff(40.0, 60.0) == 60.0
    assert next_backoff(60.0, 60.0) == 60.0


def fake_monitor(tmp_path: Path, lines: list[str], rc: int = 1) -> Path:
    data = tmp_path / "lines.txt"
    data.write_text("".join(line + "\n" for line in lines))
    script = tmp_path / "neuron-monitor"
    script.write_text(
        f"#!{sys.executable}\n"
        "import sys\n"
        f"sys.stdout.write(open({str(data)!r}).read())\n"
        "sys.stdout.flush()\n"
        f"sys.exit({rc})\n"
    )
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    return script


def wait_for(cond: Any) -> None:
    done = threading.Event()
    while not cond():
        done.wait(0.01)


def test_supervisor_restarts_with_backoff(tmp_path: Path, sample: dict[str, Any]) -> None:
    script = fake_monitor(tmp_path, [json.dumps(sample), "garbage {", json.dumps(sample)])
    reg, exp = fresh()
    mon = NeuronMonitor(exp, [str(script)], backoff_initial=0.01, backoff_max=0.04)
    mon.start()
    try:
        wait_for(lambda: mon.runs >= 5 and len(mon.delays) >= 4)
    finally:
        mon.close()
    assert list(mon.delays)[:4] == [0.01, 0.02, 0.04, 0.04]
    restarts = val(reg, "zerolayer_neuron_monitor_restarts_total")
    assert restarts is not None and restarts >= 4
    reports = val(reg, "zerolayer_neuron_monitor_reports_total")
    bad = val(reg, "zerolayer_neuron_monitor_bad_reports_total")
    assert reports is not None and bad is not None
    assert reports >= 2 * 4 and bad >= 4  # two good lines and one garbage line per run
    # Counters accumulate across restarts: each run's report adds its period's counts.
    completed = val(reg, "execution_status_total", **RUNTIME, status_type="completed")
    assert completed == 816 * reports
    assert val(reg, "zerolayer_neuron_monitor_up") == 0  # closed


def test_supervisor_survives_missing_binary(tmp_path: Path) -> None:
    reg, exp = fresh()
    mon = NeuronMonitor(exp, [str(tmp_path / "no-such-binary")], backoff_initial=0.01)
    mon.start()
    try:
        wait_for(lambda: len(mon.delays) >= 2)
    finally:
        mon.close()
    assert mon.runs == 0
    assert val(reg, "zerolayer_neuron_monitor_restarts_total") >= 2  # type: ignore[operator]


def test_close_stops_a_long_running_child(tmp_path: Path, sample: dict[str, Any]) -> None:
    script = tmp_path / "neuron-monitor"
    script.write_text(
        f"#!{sys.executable}\n"
        "import sys, time\n"
        f"sys.stdout.write({json.dumps(sample)!r} + '\\n')\n"
        "sys.stdout.flush()\n"
        "time.sleep(600)\n"
    )
    script.chmod(0o755)
    reg, exp = fresh()
    mon = NeuronMonitor(exp, [str(script)])
    mon.start()
    try:
        wait_for(lambda: val(reg, "zerolayer_neuron_monitor_up") == 1)
    finally:
        mon.close()
    assert mon._thread is not None and not mon._thread.is_alive()
    assert val(reg, "zerolayer_neuron_monitor_restarts_total") == 0


def test_resolve(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    script = fake_monitor(tmp_path, [])
    monkeypatch.setenv("PATH", str(tmp_path))
    assert resolve_neuron_monitor(None) == str(script)
    assert resolve_neuron_monitor(True) == str(script)
    assert resolve_neuron_monitor(False) is None
    assert resolve_neuron_monitor(None, binary="not-installed-anywhere") is None
    assert resolve_neuron_monitor(True, binary="not-installed-anywhere") is None
    assert start_neuron_monitor(False, CollectorRegistry()) is None
