"""A real ``redis-server`` for benchmarks and tests: started on a free 127.0.0.1 port in a temp
dir without persistence, ready once it answers PING, stopped (and its dir removed) at the end.

``with RedisServer() as srv: srv.url``. A missing binary is an error, never a skip.
tests/conftest.py makes its ``redis_server`` (one per test session) and ``redis_url`` (flushed
before each test) fixtures of it.
"""

from __future__ import annotations

import contextlib
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path

from benchmarks._support.daemon import free_port

INSTALL_HINT = (
    "redis-server not found on PATH or at /usr/bin/redis-server; the hook tests need a real one: "
    "`make test` installs it (tests/support/install-redis.sh)"
)


def find_redis_server() -> str:
    path = shutil.which("redis-server") or "/usr/bin/redis-server"
    if not Path(path).is_file():
        raise RuntimeError(INSTALL_HINT)
    return path


def _pings(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5) as s:
            s.sendall(b"PING\r\n")
            return s.recv(64).startswith(b"+PONG")
    except OSError:
        return False


class RedisServer:
    """One redis-server process; ``url`` is valid between start() and stop()."""

    def __init__(self, binary: str | None = None) -> None:
        self.binary = binary or find_redis_server()
        self.port = 0
        self.url = ""
        self._dir: str | None = None
        self._proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout_s: float = 10.0) -> RedisServer:
        self._dir = tempfile.mkdtemp(prefix="zl-redis-")
        log_path = Path(self._dir) / "redis.log"
        # A free port can be taken between our probe and redis' bind: try a few.
        for _ in range(5):
            self.port = free_port()
            cmd = [
                self.binary, "--port", str(self.port), "--bind", "127.0.0.1",
                "--save", "", "--appendonly", "no", "--dir", self._dir,
                "--logfile", str(log_path), "--daemonize", "no",
            ]  # fmt: skip
            self._proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL)
            deadline = time.monotonic() + timeout_s
            while time.monotonic() < deadline and self._proc.poll() is None:
                if _pings(self.port):
                    self.url = f"redis://127.0.0.1:{self.port}/0"
                    return self
                time.sleep(0.02)
            self._proc.kill()
            self._proc.wait()
            log = log_path.read_text(errors="replace") if log_path.exists() else ""
            if "Address already in use" not in log:
                self.stop()
                raise RuntimeError(f"redis-server did not answer PING on port {self.port}:\n{log}")
        self.stop()
        raise RuntimeError("redis-server could not bind a free port after 5 attempts")

    def stop(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            self._proc.terminate()
            try:
                self._proc.wait(5)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
        self._proc = None
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None

    def flush(self) -> None:
        import redis

        with contextlib.closing(redis.Redis.from_url(self.url)) as client:
            client.flushall()

    def __enter__(self) -> RedisServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
