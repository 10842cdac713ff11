"""zerolayer bench against a real daemon (synthetic backend), and benchmark children dying with
their parent."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

from benchmarks._support.daemon import ROOT, Daemon


def _bench(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "zerolayer.cli.main", "bench", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_bench_run_report_plots_and_compare(tmp_path):
    with Daemon({"ENGINE__SYNTHETIC_STEP_MS": "2"}) as d:
        out = _bench(
            "--endpoint",
            d.endpoint,
            "--concurrency",
            "4",
            "--num-requests",
            "12",
            "--warmup",
            "2",
            "--connections",
            "2",
            "--input-len",
            "8:4",
            "--output-len",
            "10",
            "--metrics-url",
            d.metrics_url,
            "--output",
            str(tmp_path / "a.json"),
            "--plot",
            str(tmp_path / "plots"),
        )
        assert out.returncode == 0, out.stderr
        assert "Successful requests" in out.stdout
        assert "\r" not in out.stderr  # no progress line when stderr is not a terminal
        report = json.loads((tmp_path / "a.json").read_text())
        assert report["completed"] == 12 and report["failed"] == 0
        assert report["warmup_requests"] == 2 and report["model_id"] == "synthetic"
        assert report["total_output_tokens"] == 120
        assert report["finish_reasons"] == {"max_tokens": 12}
        assert all(4 <= n <= 12 for n in report["input_lens"])
        server = report["server_metrics"]
        assert server["generation_tokens"] == 120  # the daemon counted what the client got
        assert server["engine_busy_seconds"] > 0
        assert server["busy_seconds_per_1k_output_tokens"] > 0
        assert 0 < report["mean_ttft_ms"] <= report["max_ttft_ms"]
        for name in ("ttft.png", "itl.png", "throughput.png"):
            assert (tmp_path / "plots" / name).read_bytes()[:4] == b"\x89PNG"

        out = _bench(
            "--endpoint",
            d.endpoint,
            "--sweep-concurrency",
            "1,3",
            "--num-requests",
            "3",
            "--output-len",
            "4",
            "--request-format",
            "json",
            "--output",
            str(tmp_path / "sweep.json"),
        )
        assert out.returncode == 0, out.stderr
        sweep = json.loads((tmp_path / "sweep.json").read_text())
        assert [r["max_concurrency"] for r in sweep["sweep"]] == [1, 3]
        assert all(r["completed"] == 3 for r in sweep["sweep"])

    (tmp_path / "b.json").write_text(
        json.dumps({**report, "output_throughput": report["output_throughput"] * 2})
    )
    out = _bench("compare", str(tmp_path / "a.json"), str(tmp_path / "b.json"))
    assert out.returncode == 0, out.stderr
    line = next(ln for ln in out.stdout.splitlines() if ln.startswith("output_throughput"))
    assert line.endswith("2.00x")


def test_bench_errors_are_one_line():
    out = _bench("--endpoint", "http://127.0.0.1:9")
    assert out.returncode == 2 and out.stderr.count("\n") == 1 and "--protocol" in out.stderr
    out = _bench("--endpoint", "tcp://127.0.0.1:9", "--num-requests", "1")
    assert out.returncode == 2 and "cannot connect" in out.stderr
    assert "Traceback" not in out.stderr


def test_daemon_child_dies_with_its_parent():
    """A process that started a daemon (like a benchmark) and is killed outright takes the
    daemon with it (PR_SET_PDEATHSIG), and SIGTERM to a benchmark ends it cleanly."""
    script = (
        "import sys, time\n"
        "sys.path.insert(0, '.')\n"
        "from benchmarks._report import parser\n"
        "from benchmarks._support.daemon import Daemon\n"
        "parser()\n"
        "with Daemon() as d:\n"
        "    print(d.proc.pid, flush=True)\n"
        "    time.sleep(120)\n"
    )
    for sig in (signal.SIGKILL, signal.SIGTERM):
        parent = subprocess.Popen(
            [sys.executable, "-c", script], cwd=ROOT, stdout=subprocess.PIPE, text=True
        )
        child = int(parent.stdout.readline())
        os.kill(parent.pid, sig)
        parent.wait(30)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and _alive(child):
            time.sleep(0.05)
        assert not _alive(child), f"daemon {child} outlived its parent ({sig.name})"
        if sig == signal.SIGTERM:
            assert parent.returncode == 128 + signal.SIGTERM


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _bench_json(tmp_path, name: str, *args: str) -> tuple[subprocess.CompletedProcess, dict]:
    out = _bench(*args, "--output", str(tmp_path / name))
    report = json.loads((tmp_path / name).read_text()) if (tmp_path / name).exists() else {}
    return out, report


def test_a_bench_run_twice_is_not_answered_from_the_response_cache(tmp_path):
    """Both doors: the bench's requests bypass the response cache (frame option bit 3, HTTP
    Cache-Control: no-cache), so a second identical run runs the model again; with
    --response-cache the second run is all hits, and the bench says so."""
    with Daemon({"ENGINE__SYNTHETIC_STEP_MS": "1"}) as d:
        common = ("--concurrency", "2", "--num-requests", "4", "--output-len", "6")
        for target in ((d.endpoint,), (d.http_url, "--protocol", "openai-chat")):
            endpoint = ("--endpoint", *target)
            for run in (1, 2):
                out, report = _bench_json(tmp_path, f"r{run}.json", *endpoint, *common)
                assert out.returncode == 0, out.stderr
                assert report["completed"] == 4 and report["response_cache_hits"] == 0
                assert "response cache" not in out.stderr
            for run in (1, 2):
                out, report = _bench_json(
                    tmp_path, f"c{run}.json", *endpoint, "--response-cache", *common
                )
                assert out.returncode == 0, out.stderr
            assert report["response_cache_hits"] == 4, endpoint  # the second run: all replays
            assert "4 of 4 answers came from the server's response cache" in out.stderr
            assert "Response cache hits" in out.stdout


def test_a_bench_whose_requests_fail_exits_non_zero_with_the_message(tmp_path):
    out, report = _bench_json(
        tmp_path, "f.json", "--endpoint", "http://127.0.0.1:9", "--protocol", "openai-chat",
        "--model", "m", "--num-requests", "3",
    )  # fmt: skip
    assert out.returncode == 1, out.stderr
    assert report["failed"] == 3 and "connect_error: " in out.stderr
    with Daemon() as d:
        out, report = _bench_json(
            tmp_path, "m.json", "--endpoint", d.http_url, "--protocol", "openai-chat",
            "--model", "nonesuch",
            "--num-requests", "2",
        )  # fmt: skip
        assert out.returncode == 1 and report["errors_by_kind"] == {"http_404": 2}
        assert "http_404: " in out.stderr and "nonesuch" in out.stderr  # the server's words


def test_bench_progress_lines_and_ctrl_c_partial_report(tmp_path):
    """stderr not a terminal: a progress line every interval; SIGINT mid-run: exit 130 with
    the report of the requests that ended."""
    with Daemon({"ENGINE__SYNTHETIC_STEP_MS": "20"}) as d:
        path = tmp_path / "partial.json"
        proc = subprocess.Popen(
            [sys.executable, "-m", "zerolayer.cli.main", "bench", "--endpoint", d.endpoint,
             "--concurrency", "2", "--num-requests", "100000", "--output-len", "4",
             "--output", str(path), "--progress-interval", "0.5"],
            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        lines = []
        while len(lines) < 2:  # two progress lines, then Ctrl-C
            line = proc.stderr.readline()
            assert line, "bench ended without progress lines"
            if line.startswith("bench: done"):
                lines.append(line)
        proc.send_signal(signal.SIGINT)
        stdout, stderr = proc.communicate(timeout=60)
        assert proc.returncode == 130, stderr
        assert "Successful requests" in stdout and "interrupted" in stderr
        report = json.loads(path.read_text())
        assert report["interrupted"] is True and 0 < report["completed"] < 100000
