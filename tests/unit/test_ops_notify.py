"""sd_notify: a datagram socket we create receives what a notify-type systemd unit would."""

from __future__ import annotations

import os
import socket
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from zerolayer.ops.notify import Notifier, notify, watchdog_interval


@pytest.fixture
def listener(tmp_path: Path) -> Iterator[tuple[socket.socket, str]]:
    path = str(tmp_path / "notify.sock")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(path)
    sock.settimeout(10)
    try:
        yield sock, path
    finally:
        sock.close()


def recv(sock: socket.socket) -> str:
    return sock.recv(4096).decode()


def test_notify_function(listener: tuple[socket.socket, str]) -> None:
    sock, path = listener
    assert notify("READY=1", env={"NOTIFY_SOCKET": path})
    assert recv(sock) == "READY=1"


def test_notify_reads_os_environ(
    listener: tuple[socket.socket, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    sock, path = listener
    monkeypatch.setenv("NOTIFY_SOCKET", path)
    assert notify("STATUS=warming up")
    assert recv(sock) == "STATUS=warming up"


def test_without_socket_is_a_noop(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("NOTIFY_SOCKET", raising=False)
    assert notify("READY=1") is False
    n = Notifier()
    assert not n.enabled
    assert n.ready() is False
    assert n.start_watchdog() is False
    n.close()


def test_abstract_namespace_socket() -> None:
    name = "zerolayer-test-" + uuid.uuid4().hex
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(b"\0" + name.encode())
    sock.settimeout(10)
    try:
        assert notify("READY=1", env={"NOTIFY_SOCKET": "@" + name})
        assert recv(sock) == "READY=1"
    finally:
        sock.close()


def test_ready_watchdog_stopping(
    listener: tuple[socket.socket, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    sock, path = listener
    monkeypatch.setenv("NOTIFY_SOCKET", path)
    monkeypatch.setenv("WATCHDOG_USEC", "40000")  # ping every 20 ms
    monkeypatch.setenv("WATCHDOG_PID", str(os.getpid()))
    n = Notifier(alive=lambda: True)
    assert n.interval == pytest.approx(0.02)
    assert n.ready(status="serving")
    assert recv(sock) == "READY=1\nSTATUS=serving"
    assert n.start_watchdog()
    assert recv(sock) == "WATCHDOG=1"
    assert recv(sock) == "WATCHDOG=1"
    n.close()
    while True:  # drain pings sent before close
        sock.settimeout(0.0)
        try:
            sock.recv(4096)
        except BlockingIOError:
            break
    sock.settimeout(10)
    assert n.stopping()
    assert recv(sock) == "STOPPING=1"


def test_watchdog_withheld_while_engine_dead(listener: tuple[socket.socket, str]) -> None:
    sock, path = listener
    alive = threading.Event()
    alive.set()
    n = Notifier(alive=alive.is_set, env={"NOTIFY_SOCKET": path, "WATCHDOG_USEC": "20000"})
    assert n.tick() is True
    assert recv(sock) == "WATCHDOG=1"
    alive.clear()
    assert n.tick() is False
    # Now in the thread: wait until it has withheld several periods, then check the socket.
    n.start_watchdog()
    ticks_before = n.skipped
    while n.skipped < ticks_before + 3:
        threading.Event().wait(0.005)
    n.close()
    sock.settimeout(0.0)
    with pytest.raises(BlockingIOError):
        sock.recv(4096)
    assert n.pings == 1
    # Alive again: pings resume.
    alive.set()
    sock.settimeout(10)
    assert n.tick() is True
    assert recv(sock) == "WATCHDOG=1"


def test_raising_liveness_withholds(listener: tuple[socket.socket, str]) -> None:
    _, path = listener

    def boom() -> bool:
        raise RuntimeError

    n = Notifier(alive=boom, env={"NOTIFY_SOCKET": path, "WATCHDOG_USEC": "20000"})
    assert n.tick() is False
    n.close()


def test_watchdog_interval_rules() -> None:
    assert watchdog_interval({}) is None
    assert watchdog_interval({"WATCHDOG_USEC": "junk"}) is None
    assert watchdog_interval({"WATCHDOG_USEC": "0"}) is None
    assert watchdog_interval({"WATCHDOG_USEC": "30000000"}) == 15.0
    # Meant for another process (e.g. we are a child of the main PID): not ours to ping.
    other = str(os.getpid() + 1)
    assert watchdog_interval({"WATCHDOG_USEC": "30000000", "WATCHDOG_PID": other}) is None
    mine = str(os.getpid())
    assert watchdog_interval({"WATCHDOG_USEC": "30000000", "WATCHDOG_PID": mine}) == 15.0


def test_reloading_message(listener: tuple[socket.socket, str]) -> None:
    sock, path = listener
    n = Notifier(env={"NOTIFY_SOCKET": path})
    assert n.reloading()
    msg = recv(sock)
    assert msg.startswith("RELOADING=1\nMONOTONIC_USEC=")
    assert int(msg.rsplit("=", 1)[1]) > 0
    n.close()


def test_unreachable_socket_returns_false(tmp_path: Path) -> None:
    n = Notifier(env={"NOTIFY_SOCKET": str(tmp_path / "missing.sock")})
    assert n.ready() is False
    n.close()
