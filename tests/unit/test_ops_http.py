"""The metrics/health HTTP server: Prometheus text, and probes that follow zerolayer.ops.readiness
(503 with the reason in the body, from start-up on)."""

from __future__ import annotations

import threading
import urllib.error
import urllib.request
from collections.abc import Iterator

import pytest
from prometheus_client.parser import text_string_to_metric_families

from zerolayer.ops.health import HttpServerHandle, start_http_server
from zerolayer.ops.metrics import Metrics
from zerolayer.ops.readiness import Health, StorePing


class Flags:
    def __init__(self) -> None:
        self.alive = True
        self.ready = False


def health_of(alive: object, ready: object) -> Health:
    """A Health past start-up whose checks follow two callables returning bools."""
    health = Health()
    health.add_liveness(lambda: None if alive() else "engine not stepping")
    health.add_readiness(lambda: None if ready() else "draining")
    health.serving()
    return health


@pytest.fixture
def served() -> Iterator[tuple[HttpServerHandle, Metrics, Flags]]:
    m = Metrics()
    flags = Flags()
    health = health_of(lambda: flags.alive, lambda: flags.ready)
    handle = start_http_server("127.0.0.1", 0, m, health)
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
    status, _, body = get(handle, "/healthz")
    assert (status, body) == (503, "engine not stepping\n")
    flags.alive = True
    assert get(handle, "/healthz")[0] == 200


def test_readyz_flips_for_drain(served: tuple[HttpServerHandle, Metrics, Flags]) -> None:
    handle, _, flags = served
    assert get(handle, "/readyz")[0] == 503
    flags.ready = True
    assert get(handle, "/readyz")[0] == 200
    flags.ready = False  # draining
    status, _, body = get(handle, "/readyz")
    assert (status, body) == (503, "draining\n")
    flags.alive = False  # every failing reason is named
    assert get(handle, "/readyz")[2] == "engine not stepping; draining\n"


def test_both_probes_say_the_start_up_step_until_serving() -> None:
    health = Health()
    handle = start_http_server("127.0.0.1", 0, Metrics(), health)
    try:
        health.starting("loading model")
        assert get(handle, "/healthz")[::2] == (503, "starting: loading model\n")
        assert get(handle, "/readyz")[::2] == (503, "starting: loading model\n")
        assert get(handle, "/metrics")[0] == 200  # scrapes work during start-up
        health.serving()
        assert get(handle, "/readyz")[::2] == (200, "ok\n")
    finally:
        handle.close()


def test_store_ping_reports_the_failure_and_the_recovery() -> None:
    state = {"up": True}

    def ping() -> bool:
        if not state["up"]:
            raise ConnectionError("Connection refused")
        return True

    store = StorePing("ratelimit.redis_url redis://x", ping)
    store.probe_once()
    assert store.check() is None
    state["up"] = False
    store.probe_once()
    assert store.check() == "ratelimit.redis_url redis://x unreachable: Connection refused"
    state["up"] = True
    store.probe_once()
    assert store.check() is None


def test_probe_that_raises_is_503() -> None:
    def boom() -> bool:
        raise RuntimeError("engine gone")

    handle = start_http_server("127.0.0.1", 0, Metrics(), health_of(boom, boom))
    try:
        assert get(handle, "/healthz")[::2] == (
            503,
            "health check failed: RuntimeError: engine gone\n",
        )
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

    handle2 = start_http_server("127.0.0.1", 0, m, health_of(probe, probe))
    try:
        assert get(handle2, "/healthz")[0] == 200
    finally:
        handle2.close()
    assert seen and threading.main_thread().name not in seen


def test_close_releases_port() -> None:
    handle = start_http_server("127.0.0.1", 0, Metrics(), Health())
    port = handle.port
    handle.close()
    again = start_http_server("127.0.0.1", port, Metrics(), Health())
    again.close()
