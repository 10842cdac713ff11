"""Socket tuning from ``[server]`` config and the listening socket for ``server.workers`` processes.

Every option is best effort: an option the kernel (or platform) refuses is logged once per
option per process and skipped, and the daemon goes on. ``make_listen_socket`` sets
SO_REUSEPORT when asked, so N worker processes can each bind the same port and the kernel
spreads new connections across them.
"""

from __future__ import annotations

import logging
import resource
import socket
import sys
import threading
from typing import Protocol

from zerolayer.ops.logging import LogThrottle

__all__ = [
    "SocketTuning",
    "apply_socket_options",
    "descriptors_low",
    "make_listen_socket",
    "out_of_descriptors",
    "refused_options",
]

log = logging.getLogger("zerolayer.ops.sockets")

# Linux values, used where the Python build does not export the constant.
_TCP_QUICKACK = getattr(socket, "TCP_QUICKACK", 12 if sys.platform.startswith("linux") else None)
_SO_BUSY_POLL = getattr(socket, "SO_BUSY_POLL", 46 if sys.platform.startswith("linux") else None)
_SO_REUSEPORT = getattr(socket, "SO_REUSEPORT", None)

_refused: set[str] = set()
_refused_lock = threading.Lock()


class SocketTuning(Protocol):
    """The fields of zerolayer.config.settings.ServerConfig this module reads."""

    tcp_nodelay: bool
    tcp_quickack: bool
    busy_poll_us: int
    reuse_port: bool


def refused_options() -> frozenset[str]:
    """Options refused so far in this process (each was logged once)."""
    with _refused_lock:
        return frozenset(_refused)


def _refuse(name: str, reason: object) -> None:
    with _refused_lock:
        if name in _refused:
            return
        _refused.add(name)
    log.warning("socket option %s refused (%s); continuing without it", name, reason)


def _set(sock: socket.socket, name: str, level: int, opt: int | None, value: int) -> bool:
    if opt is None:
        _refuse(name, "not supported on this platform")
        return False
    try:
        sock.setsockopt(level, opt, value)
        return True
    except OSError as exc:
        _refuse(name, exc.strerror or exc)
        return False


def apply_socket_options(sock: socket.socket, cfg: SocketTuning) -> list[str]:
    """Apply the per-connection options to an accepted TCP socket; returns the names applied.

    TCP_QUICKACK is not sticky in Linux (the kernel may fall back to delayed ACKs), so it
    helps the first exchanges of a connection; set it again after reads if that matters.
    """
    applied: list[str] = []
    if cfg.tcp_nodelay and _set(sock, "TCP_NODELAY", socket.IPPROTO_TCP, socket.TCP_NODELAY, 1):
        applied.append("TCP_NODELAY")
    if cfg.tcp_quickack and _set(sock, "TCP_QUICKACK", socket.IPPROTO_TCP, _TCP_QUICKACK, 1):
        applied.append("TCP_QUICKACK")
    # Raising SO_BUSY_POLL above net.core.busy_read needs CAP_NET_ADMIN: the usual refusal.
    if cfg.busy_poll_us > 0 and _set(
        sock, "SO_BUSY_POLL", socket.SOL_SOCKET, _SO_BUSY_POLL, cfg.busy_poll_us
    ):
        applied.append("SO_BUSY_POLL")
    return applied


def make_listen_socket(host: str, port: int, backlog: int, reuse_port: bool) -> socket.socket:
    """A bound, listening, non-blocking TCP socket for ``loop.create_server(sock=...)``.

    With ``reuse_port`` every worker process calls this for the same port. Errors binding
    (address in use, permission) propagate: the daemon cannot serve without its port.
    """
    infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    family, socktype, proto, _, addr = infos[0]
    sock = socket.socket(family, socktype, proto)
    try:
        if sys.platform != "win32":
            # Restart without waiting out TIME_WAIT connections of the previous process.
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if reuse_port:
            _set(sock, "SO_REUSEPORT", socket.SOL_SOCKET, _SO_REUSEPORT, 1)
        sock.bind(addr)
        sock.listen(backlog)
        sock.setblocking(False)
    except BaseException:
        sock.close()
        raise
    return sock


_FD_RESERVE = 64  # descriptors kept free for the other doors, metrics, logs and files


def descriptors_low(sock: object) -> bool:
    """True when an accepted socket's descriptor is within _FD_RESERVE of the process's soft
    RLIMIT_NOFILE. The kernel hands out the lowest free number, so the number is a cheap proxy
    for descriptors in use; refusing there keeps the other doors and /readyz alive."""
    fileno = getattr(sock, "fileno", None)
    if fileno is None:
        return False
    try:
        fd = int(fileno())
    except OSError:
        return False
    return fd >= _nofile() - _FD_RESERVE


_fd_lines = LogThrottle()  # a client can open connections at will: one line a minute per door


def out_of_descriptors(sock: object, door: str) -> bool:
    """``descriptors_low(sock)``, and when it is, a line saying the ``door`` refuses
    connections for it (rate-limited): the one check and message of every door."""
    if not descriptors_low(sock):
        return False
    _fd_lines.warning(
        log, f"fds:{door}", "file descriptors nearly exhausted: the %s door refuses connections",
        door,
    )  # fmt: skip
    return True


def _nofile() -> int:
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    return soft if soft != resource.RLIM_INFINITY else 1 << 30
