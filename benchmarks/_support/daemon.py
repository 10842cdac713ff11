"""Benchmarks and tests: run a real `zerolayer serve` process on loopback and learn its port."""

from __future__ import annotations

import ctypes
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
_LISTENING = re.compile(r"zerolayer: listening frame=([\d.]+):(\d+)")


_PR_SET_PDEATHSIG = 1
try:  # looked up here, not in the forked child (dlopen there could deadlock on another thread)
    _prctl = ctypes.CDLL(None, use_errno=True).prctl
except (OSError, AttributeError):  # not Linux: the parent's own cleanup has to do
    _prctl = None


def die_with_parent() -> None:
    """A ``preexec_fn``: the kernel SIGKILLs the child when the thread that started it exits, so
    a test run or benchmark killed without cleaning up leaves no daemon behind (Linux only).
    Use it from the main thread only (``child_preexec``): another thread may end first."""
    if _prctl is not None:
        _prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


def child_preexec() -> Callable[[], None] | None:
    """``die_with_parent`` when called on the main thread (which lives as long as the process),
    else None: a child started from a short-lived thread must outlive that thread."""
    return die_with_parent if threading.current_thread() is threading.main_thread() else None


def free_port() -> int:
    """A loopback port free right now (another process may take it before we bind it)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def listening_fields(line: str) -> dict[str, str] | None:
    """The fields of the daemon's "listening" line (frame, http, metrics, model, backend, hooks) in
    either log format: plain ``... zerolayer: listening frame=H:P ...`` or a JSON object."""
    if line.startswith("{"):
        try:
            record = json.loads(line)
        except ValueError:
            return None
        if record.get("msg") != "listening" or "frame" not in record:
            return None
        return {k: str(v) for k, v in record.items()}
    if not _LISTENING.search(line):
        return None
    return dict(re.findall(r"(\w+)=(\S+)", line))


class Daemon:
    """A daemon subprocess. ``env`` entries are config overrides like {"SERVER__PORT": "0"}."""

    def __init__(
        self,
        env: dict[str, str] | None = None,
        config: str | None = None,
        raw_env: dict[str, str] | None = None,
        wrapper: list[str] | None = None,
        root: Path = ROOT,
    ) -> None:
        """``wrapper``: a command the daemon runs under (e.g. valgrind and its options);
        ``root``: the source tree it runs (another checkout, e.g. a baseline commit)."""
        full_env = {k: v for k, v in os.environ.items() if not k.startswith("ZEROLAYER_")}
        full_env.update(
            {
                "ZEROLAYER_SERVER__PORT": "0",
                "ZEROLAYER_METRICS__PORT": "0",
                "ZEROLAYER_HTTP__PORT": "0",
                "ZEROLAYER_ENGINE__BACKEND": "synthetic",
                "ZEROLAYER_LOGGING__LEVEL": "warning",
            }
        )
        full_env.update({f"ZEROLAYER_{k}": str(v) for k, v in (env or {}).items()})
        if root != ROOT:
            full_env["PYTHONPATH"] = str(root)
        full_env.update(raw_env or {})
        cmd = [*(wrapper or ()), sys.executable, "-m", "zerolayer.cli.main", "serve"]
        if config:
            cmd += ["--config", config]
        self.proc = subprocess.Popen(
            cmd,
            cwd=root,
            env=full_env,
            stderr=subprocess.PIPE,
            text=True,
            preexec_fn=child_preexec(),
        )
        self.lines: list[str] = []
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            line = self.proc.stderr.readline()
            if not line:
                break
            self.lines.append(line)
            fields = listening_fields(line)
            if fields is not None:
                host, _, port = fields["frame"].rpartition(":")
                self.host, self.port = host, int(port)
                metrics = fields.get("metrics", "off")
                self.metrics_url = None if metrics == "off" else f"http://{metrics}"
                self.endpoint = f"tcp://{self.host}:{self.port}"
                api = fields.get("http", "off")  # the HTTP front end (docs/http.md)
                self.http_url = None if api == "off" else f"http://{api}"
                self.http_port = None if api == "off" else int(api.rpartition(":")[2])
                self.extra = fields
                # Keep draining stderr so a chatty daemon never blocks on a full pipe.
                threading.Thread(target=self._drain, daemon=True).start()
                return
        self.proc.kill()
        raise RuntimeError("daemon did not start:\n" + "".join(self.lines) + self._rest())

    def _drain(self) -> None:
        try:
            for line in self.proc.stderr:
                self.lines.append(line)
        except (ValueError, OSError):  # the pipe was closed by __exit__
            pass

    def rss_mb(self) -> float:
        """The daemon's resident memory (VmRSS), in MiB."""
        with open(f"/proc/{self.proc.pid}/status") as fh:
            for line in fh:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
        raise RuntimeError("no VmRSS line in /proc/PID/status")

    def lines_with(self, text: str, at_least: int = 1, timeout: float = 10.0) -> list[str]:
        """The log lines containing ``text``, once there are ``at_least`` of them (or the
        timeout passed: the caller's assertion then says what is missing). The daemon writes
        its log a moment after a client sees the effect."""
        deadline = time.monotonic() + timeout
        while True:
            found = [line for line in self.lines if text in line]
            if len(found) >= at_least or time.monotonic() > deadline:
                return found
            time.sleep(0.05)

    @property
    def log(self) -> str:
        return "".join(self.lines)

    def _rest(self) -> str:
        try:
            return self.proc.stderr.read() or ""
        except ValueError:
            return ""

    def terminate(self, timeout: float = 60) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            raise

    def __enter__(self) -> Daemon:
        return self

    def __exit__(self, *exc: object) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        if self.proc.stderr:
            self.proc.stderr.close()
