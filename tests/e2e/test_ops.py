"""Operations end to end: metrics after real requests, health during drain, systemd notify,
SO_REUSEPORT workers. Each test runs a real daemon process (synthetic backend)."""

from __future__ import annotations

import contextlib
import json
import os
import queue
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request

from prometheus_client.parser import text_string_to_metric_families

from benchmarks._support.daemon import ROOT, Daemon, free_port
from benchmarks._support.metrics import scrape, status, value
from tests.support import rawclient as rc


def test_scrape_after_requests_moves_counters_by_the_right_amounts():
    with Daemon({"ENGINE__SYNTHETIC_STEP_MS": "1"}) as d:
        before = scrape(d.metrics_url)
        conn = rc.RawConnection(d.host, d.port)
        conn.send(rc.request(4, b"abcd", 2000))
        first = conn.read_frame()
        assert (first[0], first[2]) == (rc.TOKEN, 4)
        conn.send(rc.frame(rc.CANCEL, 4))
        conn.send(rc.request(1, [1, 2, 3], 10) + rc.request(2, [4, 5], 7))
        conn.send(rc.request(3, b"", 5))  # INVALID_REQUEST
        res = rc.collect(conn, {1, 2, 3, 4})
        cancelled_tokens = len(res[4]["ids"]) + len(rc.parse_token(first[3])[0])
        completed = 17 + res[4]["done"]["completion_tokens"]
        # The engine sets its gauges after the step that ended the last request: wait for that.
        deadline = time.monotonic() + 10
        after = scrape(d.metrics_url)
        while value(after, "zerolayer_num_requests_running") != 0 and time.monotonic() < deadline:
            time.sleep(0.05)
            after = scrape(d.metrics_url)

        def delta(name, **labels):
            return value(after, name, **labels) - value(before, name, **labels)

        assert res[4]["done"]["completion_tokens"] == cancelled_tokens
        assert delta("zerolayer_generation_tokens_total", api="frames") == completed
        # prompt 3 + 2 ids, and "abcd" with BOS = 5 tokens
        assert delta("zerolayer_prompt_tokens_total", api="frames") == 3 + 2 + 5
        success = "zerolayer_request_success_total"
        assert delta(success, finished_reason="max_tokens", api="frames") == 2
        assert delta(success, finished_reason="cancelled", api="frames") == 1
        assert delta("zerolayer_request_errors_total", code="INVALID_REQUEST", api="frames") == 1
        assert delta("zerolayer_time_to_first_token_seconds_count") == 3
        assert delta("zerolayer_e2e_request_latency_seconds_count") == 3
        assert delta("zerolayer_request_queue_time_seconds_count") == 3
        assert delta("zerolayer_frames_total", direction="out", type="DONE") == 3
        assert delta("zerolayer_frames_total", direction="out", type="TOKEN") == completed
        assert delta("zerolayer_frames_total", direction="in", type="REQUEST") == 4
        assert delta("zerolayer_frames_total", direction="in", type="CANCEL") == 1
        assert delta("zerolayer_bytes_total", direction="out") == (
            20 * completed
            + 36 * 3
            + len(rc.frame(rc.ERROR, 3, b"\0" * 8))
            + len("empty prompt without a prompt_id")
        )
        assert value(after, "zerolayer_connections") == 1
        assert value(after, "zerolayer_num_requests_running") == 0
        assert delta("zerolayer_backend_busy_seconds_total", phase="decode") > 0
        assert delta("zerolayer_batch_size_count") > 0
        conn.close()


def test_readyz_flips_to_503_during_drain():
    with Daemon({"ENGINE__SYNTHETIC_STEP_MS": "5"}) as d:
        assert status(d.metrics_url + "/readyz") == 200
        assert status(d.metrics_url + "/healthz") == 200
        conn = rc.RawConnection(d.host, d.port)
        conn.send(rc.request(1, b"keep busy", 400))
        assert conn.read_frame()[0] == rc.TOKEN
        d.proc.send_signal(15)
        deadline = time.monotonic() + 10
        codes = []
        while time.monotonic() < deadline:
            codes.append(status(d.metrics_url + "/readyz"))
            if codes[-1] == 503:
                break
            time.sleep(0.05)
        assert codes[-1] == 503, codes
        assert status(d.metrics_url + "/healthz") == 200  # alive while draining
        res = rc.collect(conn, {1})[1]
        assert res["done"]["completion_tokens"] == 400
        assert d.proc.wait(30) == 0


def test_systemd_notify_ready_watchdog_stopping():
    path = os.path.join(tempfile.mkdtemp(), "notify.sock")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(path)
    sock.settimeout(30)
    try:
        with Daemon(raw_env={"NOTIFY_SOCKET": path, "WATCHDOG_USEC": "200000"}) as d:
            got = []
            while not any("WATCHDOG=1" in m for m in got):
                got.append(sock.recv(4096).decode())
            assert any("READY=1" in m for m in got)
            d.proc.send_signal(15)
            while not any("STOPPING=1" in m for m in got):
                got.append(sock.recv(4096).decode())
            assert d.proc.wait(30) == 0
    finally:
        sock.close()


def free_port_pair() -> int:
    """A port p with p + 1 free as well (worker i's metrics listen on metrics.port + i): a free
    port's neighbour is often taken by another test's daemon."""
    for _ in range(100):
        first = free_port()
        with contextlib.suppress(OSError), socket.socket() as s:
            s.bind(("127.0.0.1", first + 1))
            return first
    raise RuntimeError("no two consecutive free ports")


def test_reuse_port_workers_share_one_port():
    port, mport, hport = free_port(), free_port_pair(), free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("ZEROLAYER_")}
    env.update(
        ZEROLAYER_ENGINE__BACKEND="synthetic",
        ZEROLAYER_SERVER__PORT=str(port),
        ZEROLAYER_SERVER__WORKERS="2",
        ZEROLAYER_METRICS__PORT=str(mport),
        ZEROLAYER_HTTP__PORT=str(hport),  # the HTTP port is shared the same way
    )
    proc = subprocess.Popen(
        [sys.executable, "-m", "zerolayer.cli.main", "serve"],
        cwd=ROOT,
        env=env,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # one process group: the cleanup reaches the workers too
    )
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=lambda: [lines.put(ln) for ln in proc.stderr], daemon=True).start()
    try:
        seen, log = [], []
        deadline = time.monotonic() + 90
        while len(seen) < 2 and time.monotonic() < deadline:
            try:
                line = lines.get(timeout=1)
            except queue.Empty:
                assert proc.poll() is None, "daemon exited:\n" + "".join(log)
                continue
            log.append(line)
            m = re.search(r"listening frame=[\d.]+:(\d+) http=\S+ metrics=[\d.]+:(\d+)", line)
            if m:
                seen.append((int(m.group(1)), int(m.group(2))))
        assert sorted(seen) == [(port, mport), (port, mport + 1)], "".join(log)
        conns = [rc.RawConnection("127.0.0.1", port) for _ in range(24)]
        for c in conns:
            c.send(rc.request(1, b"w", 4))
            assert rc.collect(c, {1})[1]["done"]["completion_tokens"] == 4
        per_worker = [
            value(scrape(f"http://127.0.0.1:{mport + i}"), "zerolayer_connections")
            for i in range(2)
        ]
        assert sum(per_worker) == 24
        assert all(n > 0 for n in per_worker), per_worker  # the kernel spread them
        models = urllib.request.urlopen(f"http://127.0.0.1:{hport}/v1/models", timeout=10)
        assert json.loads(models.read())["data"][0]["id"] == "synthetic"
        for c in conns:
            c.close()
        proc.send_signal(15)
        assert proc.wait(30) == 0
    finally:
        with contextlib.suppress(ProcessLookupError):  # the workers, even if the parent is gone
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)


def test_a_worker_that_fails_to_start_stops_the_others():
    port = free_port()
    blocker = socket.socket()
    blocker.bind(("127.0.0.1", 0))
    blocker.listen()
    taken = blocker.getsockname()[1]  # worker 1's metrics port (taken - 1 + 1) is in use
    env = {k: v for k, v in os.environ.items() if not k.startswith("ZEROLAYER_")}
    env.update(
        ZEROLAYER_ENGINE__BACKEND="synthetic",
        ZEROLAYER_SERVER__PORT=str(port),
        ZEROLAYER_SERVER__WORKERS="2",
        ZEROLAYER_METRICS__PORT=str(taken - 1),
        ZEROLAYER_HTTP__PORT="0",
    )
    proc = subprocess.Popen(
        [sys.executable, "-m", "zerolayer.cli.main", "serve"],
        cwd=ROOT,
        env=env,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        _, err = proc.communicate(timeout=90)
        assert proc.returncode != 0
        assert (
            f"cannot start: the metrics and health HTTP port 127.0.0.1:{taken} (metrics.port)"
            in err
        )
        assert "stopping the others" in err
    finally:
        blocker.close()
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)


def test_scrape_with_neuron_monitor_shows_every_documented_metric(tmp_path):
    """With a neuron-monitor that prints the recorded sample report, a scrape of a running
    daemon shows every metric docs/metrics.md lists, the Neuron families included."""
    fixture = ROOT / "tests" / "fixtures" / "neuron-monitor-sample.json"
    script = tmp_path / "neuron-monitor"
    script.write_text(
        f"#!{sys.executable}\n"
        "import sys, time\n"
        f"line = open({str(fixture)!r}).read().strip()\n"
        "while True:\n"
        "    sys.stdout.write(line + '\\n'); sys.stdout.flush(); time.sleep(0.2)\n"
    )
    script.chmod(0o755)
    doc = (ROOT / "docs" / "metrics.md").read_text()
    names = set(re.findall(r"^\| `([a-z_]+)`", doc, re.M))
    assert len(names) >= 40
    env = {"METRICS__NEURON_MONITOR": "true", "METRICS__NEURON_MONITOR_PATH": str(script)}
    with Daemon(env) as d:
        deadline = time.monotonic() + 30
        while True:
            text = urllib.request.urlopen(d.metrics_url + "/metrics", timeout=10).read().decode()
            exposed = {f.name for f in text_string_to_metric_families(text)}
            missing = sorted(
                n for n in names if n not in exposed and n.removesuffix("_total") not in exposed
            )
            if not missing or time.monotonic() > deadline:
                break
            time.sleep(0.3)
        assert not missing, missing
