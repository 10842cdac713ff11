"""The daemon as an operator meets it, end to end: ports named when taken (before the model
loads), health that answers 503 with the reason from the first second, readiness that follows a
required Redis, the wrong door answered in its own protocol, JSON-only logs, SIGHUP naming what
it did not apply, and gauges that follow the engine. Real daemons, synthetic backend unless said.
"""

from __future__ import annotations

import http.client
import json
import os
import signal
import socket
import ssl
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from benchmarks._support.daemon import ROOT, Daemon, free_port
from benchmarks._support.metrics import probe, scrape, value
from benchmarks._support.redis_server import RedisServer
from zerolayer.client import RateLimitedError, SyncClient

SERVE = [sys.executable, "-m", "zerolayer.cli.main", "serve"]


def _serve_fails(env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("ZEROLAYER_")}
    clean["ZEROLAYER_HTTP__PORT"] = "0"  # the default config serves HTTP on 8080: not here
    return subprocess.run(
        SERVE, cwd=ROOT, env={**clean, **env}, capture_output=True, text=True, timeout=120
    )


@pytest.mark.parametrize(
    ("taken_as", "listener"),
    [
        ("ZEROLAYER_SERVER__PORT", "frame protocol port {} (server.port)"),
        ("ZEROLAYER_METRICS__PORT", "metrics and health HTTP port {} (metrics.port)"),
        ("ZEROLAYER_HTTP__PORT", "HTTP API port {} (http.port)"),
    ],
)
def test_a_taken_port_is_named_and_found_before_the_model_loads(taken_as, listener):
    with socket.socket() as blocker:
        blocker.bind(("127.0.0.1", 0))
        blocker.listen()
        taken = blocker.getsockname()[1]
        env = {
            "ZEROLAYER_SERVER__PORT": "0",
            "ZEROLAYER_METRICS__PORT": "0",
            # Loading this would fail with a model error: the port error proves the order.
            "ZEROLAYER_ENGINE__BACKEND": "cpu",
            "ZEROLAYER_MODEL__PATH": "/nonexistent/model",
            taken_as: str(taken),
        }
        proc = _serve_fails(env)
    assert proc.returncode == 1
    last = proc.stderr.splitlines()[-1]
    where = listener.format(f"127.0.0.1:{taken}")
    assert last.endswith(f"zerolayer: cannot start: the {where}: Address already in use")
    assert "/nonexistent/model" not in proc.stderr
    assert "Traceback" not in proc.stderr


def test_a_user_error_at_start_up_is_one_line():
    proc = _serve_fails(
        {"ZEROLAYER_SERVER__PORT": "0", "ZEROLAYER_METRICS__PORT": "0",
         "ZEROLAYER_ENGINE__BACKEND": "neuron", "ZEROLAYER_LOGGING__LEVEL": "warning"}
    )  # fmt: skip
    assert proc.returncode == 1
    assert proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr
    assert 'model.path is required for engine.backend = "neuron"' in proc.stderr
    # With JSON logs the failure is a JSON line too, like every other line.
    proc = _serve_fails(
        {"ZEROLAYER_SERVER__PORT": "0", "ZEROLAYER_METRICS__PORT": "0",
         "ZEROLAYER_ENGINE__BACKEND": "neuron", "ZEROLAYER_LOGGING__JSON_LINES": "true"}
    )  # fmt: skip
    records = [json.loads(line) for line in proc.stderr.splitlines()]
    assert records[-1]["level"] == "error"
    assert records[-1]["msg"].startswith("cannot start: model.path is required")


GATE = """
import os, time
from zerolayer.hooks import hook

@hook
class Gate:
    # Holds start-up until the test creates the file (bounded), so health is seen mid-start.
    def __init__(self, settings):
        deadline = time.monotonic() + 60
        while not os.path.exists({go!r}) and time.monotonic() < deadline:
            time.sleep(0.02)

    def on_request(self, ctx):
        return None
"""


def test_health_answers_503_with_the_step_while_starting(tmp_path: Path):
    go = tmp_path / "go"
    (tmp_path / "gate.py").write_text(GATE.format(go=str(go)))
    metrics_port = free_port()
    env = {
        "METRICS__PORT": str(metrics_port),
        "HOOKS__MODULES": json.dumps([str(tmp_path / "gate.py")]),
    }
    started: list[Daemon] = []
    starter = threading.Thread(target=lambda: started.append(Daemon(env)), daemon=True)
    starter.start()
    url = f"http://127.0.0.1:{metrics_port}"
    seen: list[tuple[int, str]] = []  # every answer until the gate holds start-up
    try:
        try:
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline and (not seen or "hooks" not in seen[-1][1]):
                try:
                    seen.append(probe(url + "/readyz"))
                except OSError:  # not bound yet: the process is still importing
                    time.sleep(0.02)
            assert seen[-1] == (503, "starting: starting hooks\n")
            assert {s for s, _ in seen} == {503}
            assert all(body.startswith("starting: ") for _, body in seen)
            assert probe(url + "/healthz") == (503, "starting: starting hooks\n")
        finally:
            go.touch()
            starter.join(120)
        assert len(started) == 1
        assert probe(url + "/readyz") == (200, "ok\n")
        assert probe(url + "/healthz") == (200, "ok\n")
    finally:
        for d in started:  # stopped whatever failed above
            d.__exit__(None, None, None)


def test_readiness_follows_a_required_redis_that_goes_away():
    redis = RedisServer().start()
    try:
        env = {
            "RATELIMIT__STORE": "redis",
            "RATELIMIT__REDIS_URL": redis.url,
            "RATELIMIT__DEFAULT_RPM": "100000",
        }
        with Daemon(env) as d:
            assert probe(d.metrics_url + "/readyz") == (200, "ok\n")
            redis.stop()
            deadline = time.monotonic() + 30
            status, body = probe(d.metrics_url + "/readyz")
            while status == 200 and time.monotonic() < deadline:
                time.sleep(0.1)
                status, body = probe(d.metrics_url + "/readyz")
            assert status == 503
            assert body.startswith(f"ratelimit.redis_url {redis.url} unreachable: ")
            assert probe(d.metrics_url + "/healthz") == (200, "ok\n")  # alive, just not ready
            assert "/readyz answers 503 until it is back" in d.log
    finally:
        redis.stop()


def test_the_wrong_door_is_answered_in_its_own_protocol():
    with Daemon() as d:
        metrics_port = d.metrics_url.rsplit(":", 1)[1]
        conn = http.client.HTTPConnection(d.host, d.port, timeout=10)
        conn.request("POST", "/v1/chat/completions", body=b"{}")
        resp = conn.getresponse()
        assert resp.status == 400
        assert resp.read().decode() == (
            "This is the ZeroLayer frame protocol port (binary frames, see docs/protocol.md); "
            f"HTTP is served on port {d.http_port}; metrics and health on port {metrics_port}.\n"
        )
        conn.close()
        ctx = ssl.create_default_context()
        with (
            socket.create_connection((d.host, d.port), timeout=10) as raw,
            pytest.raises(ssl.SSLError, match="HANDSHAKE_FAILURE|handshake failure"),
        ):
            ctx.wrap_socket(raw, server_hostname="localhost")
        with SyncClient(d.endpoint) as client:  # frames on the same port still work
            assert client.generate("still fine", max_tokens=4).completion_tokens == 4


def test_generate_on_the_metrics_port_ends_with_a_named_deadline():
    with Daemon() as d:
        endpoint = "tcp://" + d.metrics_url.split("://", 1)[1]
        proc = subprocess.run(
            [sys.executable, "-m", "zerolayer.cli.main", "generate", "--endpoint", endpoint,
             "--timeout", "1", "hi"],
            cwd=ROOT, capture_output=True, text=True, timeout=60,
        )  # fmt: skip
    assert proc.returncode == 1
    assert proc.stderr == (
        f"zerolayer: {endpoint} accepted the connection but sent no WELCOME within 1 s: not a "
        "ZeroLayer frame port (an HTTP server, such as the metrics port, waits silently for a "
        "request line), or a daemon still starting\n"
    )


def test_json_lines_mode_writes_only_json_and_sighup_applies_or_names_each_change(tmp_path):
    config = tmp_path / "zl.toml"
    config.write_text((ROOT / "configs" / "default.toml").read_text())
    env = {"LOGGING__JSON_LINES": "true", "LOGGING__LEVEL": "info", "LOGGING__REQUESTS": "true"}
    with Daemon(env, config=str(config)) as d:
        with SyncClient(d.endpoint) as client:
            client.generate("logged", max_tokens=3)
            client.generate("again", max_tokens=3)  # no limit yet
        # A live setting (the default request rate) and one read only at start-up.
        config.write_text(
            config.read_text() + "\n[ratelimit]\ndefault_rpm = 1\n[cache]\nmax_bytes = 1024\n"
        )
        d.proc.send_signal(signal.SIGHUP)
        deadline = time.monotonic() + 30
        while d.log.count("SIGHUP") < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        with SyncClient(d.endpoint) as client:  # the new limit holds at once: 1 request/min
            client.generate("first", max_tokens=3)
            with pytest.raises(RateLimitedError):
                client.generate("second", max_tokens=3)
        assert d.terminate() == 0
        time.sleep(0.2)  # the drain thread reads the last lines
    records = [json.loads(line) for line in d.log.splitlines()]  # every line is JSON
    assert any(r["msg"] == "listening" and r["frame"].endswith(f":{d.port}") for r in records)
    warnings = [r["msg"] for r in records if r["level"] == "warning" and "SIGHUP" in r["msg"]]
    assert warnings == [
        "SIGHUP: cache.max_bytes: 67108864 -> 1024 changed but is read only at start-up; "
        "restart to apply it",
        "SIGHUP: ratelimit.default_rpm: None -> 1 applied",
    ]
    assert any(r["msg"] == "stopped" for r in records)


def test_queue_gauges_follow_the_engine_step_not_a_timer():
    # Regression: the gauges were set by the idle sweeper about once a second.
    with Daemon({"ENGINE__SYNTHETIC_STEP_MS": "40", "SERVER__IDLE_TIMEOUT_S": "60"}) as d:
        with SyncClient(d.endpoint) as client:
            events = client.stream("slow", max_tokens=40)
            next(events)  # the stream is running: the step that made this token set the gauge
            running = value(scrape(d.metrics_url), "zerolayer_num_requests_running")
            for _ in events:
                pass
        after = scrape(d.metrics_url)
    assert running == 1
    assert value(after, "zerolayer_num_requests_running") == 0
    assert value(after, "zerolayer_num_requests_waiting") == 0
