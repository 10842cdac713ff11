"""Socket tuning: options applied, refusals logged once and skipped; SO_REUSEPORT listeners."""

from __future__ import annotations

import logging
import select
import socket
import sys
from dataclasses import dataclass

import pytest

from zerolayer.config.settings import ServerConfig
from zerolayer.ops import sockets
from zerolayer.ops.sockets import apply_socket_options, make_listen_socket

linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux socket options")


@dataclass
class Tuning:
    tcp_nodelay: bool = True
    tcp_quickack: bool = False
    busy_poll_us: int = 0
    reuse_port: bool = False


@pytest.fixture(autouse=True)
def _fresh_refusals() -> None:
    sockets._refused.clear()


def connected_pair() -> tuple[socket.socket, socket.socket, socket.socket]:
    lst = make_listen_socket("127.0.0.1", 0, 16, reuse_port=False)
    cli = socket.create_connection(lst.getsockname()[:2], timeout=10)
    lst.setblocking(True)
    srv, _ = lst.accept()
    return lst, cli, srv


def test_nodelay_applied() -> None:
    lst, cli, srv = connected_pair()
    try:
        srv.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 0)
        assert apply_socket_options(srv, Tuning(tcp_nodelay=True)) == ["TCP_NODELAY"]
        assert srv.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) != 0
        assert apply_socket_options(srv, Tuning(tcp_nodelay=False)) == []
    finally:
        for s in (lst, cli, srv):
            s.close()


def test_accepts_the_real_server_config() -> None:
    lst, cli, srv = connected_pair()
    try:
        cfg = ServerConfig(tcp_nodelay=True, tcp_quickack=True)
        applied = apply_socket_options(srv, cfg)
        assert "TCP_NODELAY" in applied
        if sys.platform.startswith("linux"):
            assert "TCP_QUICKACK" in applied
    finally:
        for s in (lst, cli, srv):
            s.close()


class RefusingSocket:
    """Stands in for a kernel that refuses every option."""

    def __init__(self) -> None:
        self.calls = 0

    def setsockopt(self, *args: object) -> None:
        self.calls += 1
        raise PermissionError(1, "Operation not permitted")


def test_refusal_logged_once_and_skipped(caplog: pytest.LogCaptureFixture) -> None:
    fake = RefusingSocket()
    cfg = Tuning(tcp_nodelay=True, tcp_quickack=True, busy_poll_us=50)
    with caplog.at_level(logging.WARNING, logger="zerolayer.ops.sockets"):
        for _ in range(5):
            assert apply_socket_options(fake, cfg) == []  # type: ignore[arg-type]
    assert fake.calls == 15  # every option was tried every time, none raised
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 3
    assert sum("TCP_NODELAY" in line for line in lines) == 1
    assert sum("SO_BUSY_POLL" in line for line in lines) == 1
    assert sockets.refused_options() == {"TCP_NODELAY", "TCP_QUICKACK", "SO_BUSY_POLL"}


@linux_only
def test_busy_poll_real_kernel(caplog: pytest.LogCaptureFixture) -> None:
    # Unprivileged, the kernel refuses raising SO_BUSY_POLL; privileged, it applies. Either
    # way the call returns normally and reports what it did.
    lst, cli, srv = connected_pair()
    try:
        with caplog.at_level(logging.WARNING, logger="zerolayer.ops.sockets"):
            applied = apply_socket_options(srv, Tuning(tcp_nodelay=False, busy_poll_us=50))
            apply_socket_options(srv, Tuning(tcp_nodelay=False, busy_poll_us=50))
        if applied == ["SO_BUSY_POLL"]:
            assert srv.getsockopt(socket.SOL_SOCKET, 46) == 50
        else:
            assert applied == []
            assert len(caplog.records) == 1
            assert "SO_BUSY_POLL" in caplog.records[0].getMessage()
    finally:
        for s in (lst, cli, srv):
            s.close()


def test_listen_socket_is_listening_and_nonblocking() -> None:
    lst = make_listen_socket("127.0.0.1", 0, 128, reuse_port=False)
    try:
        assert lst.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN) == 1
        assert lst.getblocking() is False
        assert lst.getsockname()[1] > 0
    finally:
        lst.close()


def test_without_reuse_port_second_bind_fails() -> None:
    a = make_listen_socket("127.0.0.1", 0, 16, reuse_port=False)
    try:
        with pytest.raises(OSError):
            make_listen_socket("127.0.0.1", a.getsockname()[1], 16, reuse_port=False)
    finally:
        a.close()


@pytest.mark.skipif(not hasattr(socket, "SO_REUSEPORT"), reason="no SO_REUSEPORT")
def test_reuse_port_two_workers_serve_one_port() -> None:
    a = make_listen_socket("127.0.0.1", 0, 64, reuse_port=True)
    port = a.getsockname()[1]
    b = make_listen_socket("127.0.0.1", port, 64, reuse_port=True)
    clients: list[socket.socket] = []
    accepted = {id(a): 0, id(b): 0}
    served: list[socket.socket] = []
    try:
        assert b.getsockname()[1] == port
        n = 32
        for _ in range(n):
            clients.append(socket.create_connection(("127.0.0.1", port), timeout=10))
        while sum(accepted.values()) < n:
            ready, _, _ = select.select([a, b], [], [], 10)
            assert ready, "connections were not delivered to either listener"
            for lst in ready:
                try:
                    conn, _ = lst.accept()
                except BlockingIOError:
                    continue
                accepted[id(lst)] += 1
                served.append(conn)
        # Each accepted connection is a working stream to the client that opened it.
        by_peer = {s.getpeername(): s for s in served}
        for c in clients:
            by_peer[c.getsockname()].sendall(b"ok")
            assert c.recv(2) == b"ok"
        for s in served:
            s.close()
        # The kernel hashes connections across both listeners: with 32 different source
        # ports, one listener getting none has probability 2**-31.
        assert accepted[id(a)] > 0 and accepted[id(b)] > 0
    finally:
        for s in (*clients, a, b):
            s.close()
