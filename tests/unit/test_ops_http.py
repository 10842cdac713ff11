"""The metrics/health HTTP server: Prometheus text, and probes that follow their callables."""

from __future__ import annotations

import threading
import urllib.error
import urllib.request
from collections.abc import Iterator

import pytest
from prometheus_client.parser import text_string_to_metric_families

from gateway.ops.health import HttpServerHandle, start_http_server
from gateway.ops.metrics import Metrics


class Flags:
    def __init__(self) -> None:
        self.alive = True
        self.ready = False


@pytest.fixture
def served() -> Iterator[tuple[HttpServerHandle, Metrics, Flags]]:
    m = Metrics()
    flags = Flags()
    handle = start_http_server("127.0.0.1", 0, m, lambda: flags.alive, lambda: flags.ready)
    try:
        yield handle, m, flags
    finally:
        handle.close()


def get(handle: HttpServerHandle, path: str) -> tuple[int, str, str]:
    url = f"http://127.0.0.1:{handle.port}{path}"
    try:
        with urllib.request.urlopen(url, timeout=10) as resp:
            return resp.status, resp.headers["Content-Type"], resp.read().decode()
    except urllib.error.HTTPError as err:
        return err.code, err.headers["Content-Type"], err.read().decode()


def test_port_zero_binds_a_real_port(served: tuple[HttpServerHandle, Metrics, Flags]) -> None:
    handle, _, _ = served
    assert handle.port > 0


def test_metrics_text_reflects_counters(served: tuple[HttpServerHandle, Metrics, Flags]) -> None:
    handle, m, _ = served
    m.request_finished("stop", 5, 7, queue_s=0.01, ttft_s=0.02, e2e_s=0.3)
    m.frames("out", "TOKEN", 7)
    status, ctype, body = get(handle, "/metrics")
    assert status == 200
    assert ctype.startswith("text/plain")
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for fam in text_string_to_metric_families(body)
        for s in fam.samples
    }
    assert samples[("zerolayer_generation_tokens_total", (("api", "frames"),))] == 7
    key = ("zerolayer_request_success_total", (("api", "frames"), ("finished_reason", "stop")))
    assert samples[key] == 1
    key = ("zerolayer_frames_total", (("direction", "out"), ("type", "TOKEN")))
    assert samples[key] == 7
    assert samples[("zerolayer_e2e_request_latency_seconds_count", ())] == 1


def test_healthz_follows_engine_alive(served: tuple[HttpServerHandle, Metrics, Flags]) -> None:
    handle, _, flags = served
    assert get(handle, "/healthz")[0] == 200
    flags.alive = False
    assert get(handle, "/healthz")[0] == 503
    flags.alive = True
    assert get(handle, "/healthz")[0] == 200


def test_readyz_flips_for_drain(served: tuple[HttpServerHandle, Metrics, Flags]) -> None:
    handle, _, flags = served
    assert get(handle, "/readyz")[0] == 503  # model not loaded yet
    flags.ready = True
    assert get(handle, "/readyz")[0] == 200
    flags.ready = False  # draining
    status, _, body = get(handle, "/readyz")
    assert status == 503
    assert "not ready" in body


def test_probe_that_raises_is_503() -> None:
    def boom() -> bool:
        raise RuntimeError("engine gone")

    handle = start_http_server("127.0.0.1", 0, Metrics(), boom, boom)
    try:
        assert get(handle, "/healthz")[0] == 503
        assert get(handle, "/readyz")[0] == 503
        assert get(handle, "/metrics")[0] == 200  # the server thread survived
    finally:
        handle.close()


def test_unknown_path_404(served: tuple[HttpServerHandle, Metrics, Flags]) -> None:
    handle, _, _ = served
    assert get(handle, "/nope")[0] == 404
    assert get(handle, "/metrics?name[]=x")[0] == 200


def test_served_off_the_calling_thread(served: tuple[HttpServerHandle, Metrics, Flags]) -> None:
    handle, m, flags = served
    seen: list[str] = []

    def probe() -> bool:
        seen.append(threading.current_thread().name)
        return True

    handle2 = start_http_server("127.0.0.1", 0, m, probe, probe)
    try:
        assert get(handle2, "/healthz")[0] == 200
    finally:
        handle2.close()
    assert seen and threading.main_thread().name not in seen


def test_close_releases_port() -> None:
    handle = start_http_server("127.0.0.1", 0, Metrics(), lambda: True, lambda: True)
    port = handle.port
    handle.close()
    again = start_http_server("127.0.0.1", port, Metrics(), lambda: True, lambda: True)
    again.close()
