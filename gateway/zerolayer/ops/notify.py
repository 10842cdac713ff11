"""systemd service notification (sd_notify), written against the protocol, without libsystemd.

The protocol: one datagram of newline-separated ``KEY=VALUE`` lines to the AF_UNIX socket named
by ``$NOTIFY_SOCKET`` (a leading ``@`` means the Linux abstract namespace). With
``Type=notify`` systemd waits for READY=1; with ``WatchdogSec=`` it sets ``$WATCHDOG_USEC`` and
kills the service unless WATCHDOG=1 arrives within that time. We ping at half the interval and
only while the engine is alive, so a wedged engine thread gets the service restarted.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Mapping

__all__ = ["Notifier", "notify", "watchdog_interval"]

log = logging.getLogger("zerolayer.ops.notify")


def _address(path: str) -> str | bytes:
    if path.startswith("@"):
        # Abstract namespace: the name is the bytes after a leading NUL, no terminator.
        return b"\0" + path[1:].encode()
    return path


def _send(sock: socket.socket | None, path: str, state: str) -> bool:
    own = sock is None
    try:
        if own:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
        assert sock is not None
        sock.sendto(state.encode(), _address(path))
        return True
    except OSError as exc:
        log.debug("sd_notify to %s failed: %s", path, exc)
        return False
    finally:
        if own and sock is not None:
            sock.close()


def notify(state: str, env: Mapping[str, str] | None = None) -> bool:
    """Send ``state`` (e.g. "READY=1") to $NOTIFY_SOCKET. False when unset or the send failed."""
    path = (env if env is not None else os.environ).get("NOTIFY_SOCKET", "")
    if not path or path[0] not in "/@":
        return False
    return _send(None, path, state)


def watchdog_interval(env: Mapping[str, str] | None = None) -> float | None:
    """Seconds between pings (half of $WATCHDOG_USEC), or None when the watchdog is off or is
    meant for another process ($WATCHDOG_PID set to a pid that is not ours)."""
    e = env if env is not None else os.environ
    try:
        usec = int(e.get("WATCHDOG_USEC", ""))
    except ValueError:
        return None
    if usec <= 0:
        return None
    pid = e.get("WATCHDOG_PID", "")
    if pid:
        try:
            if int(pid) != os.getpid():
                return None
        except ValueError:
            return None
    return usec / 2_000_000


class Notifier:
    """The daemon's link to systemd; every method is a no-op outside a notify-type unit.

    ``alive`` gates watchdog pings (the daemon passes the engine-thread liveness check). The
    environment is read once at construction; pass ``env`` to test without touching os.environ.
    """

    def __init__(
        self,
        alive: Callable[[], bool] | None = None,
        env: Mapping[str, str] | None = None,
    ) -> None:
        e = dict(env if env is not None else os.environ)
        path = e.get("NOTIFY_SOCKET", "")
        self.path: str | None = path if path and path[0] in "/@" else None
        self.interval: float | None = watchdog_interval(e) if self.path else None
        self._alive = alive if alive is not None else (lambda: True)
        self._sock: socket.socket | None = None
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._withheld = False
        self.pings = 0  # watchdog pings sent
        self.skipped = 0  # watchdog ticks withheld because alive() was false

    @property
    def enabled(self) -> bool:
        return self.path is not None

    def send(self, state: str) -> bool:
        """Send raw ``KEY=VALUE`` lines; thread-safe, reuses one socket."""
        if self.path is None:
            return False
        with self._lock:
            if self._sock is None:
                try:
                    self._sock = socket.socket(
                        socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC
                    )
                except OSError as exc:
                    log.warning("cannot create sd_notify socket: %s", exc)
                    return False
            return _send(self._sock, self.path, state)

    def ready(self, status: str | None = None) -> bool:
        """Model loaded and port bound: systemd marks the unit started."""
        msg = "READY=1" if status is None else f"READY=1\nSTATUS={status}"
        return self.send(msg)

    def stopping(self, status: str | None = None) -> bool:
        """Drain began."""
        msg = "STOPPING=1" if status is None else f"STOPPING=1\nSTATUS={status}"
        return self.send(msg)

    def reloading(self) -> bool:
        """A SIGHUP reload began; call ``ready()`` when it is done."""
        usec = time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000
        return self.send(f"RELOADING=1\nMONOTONIC_USEC={usec}")

    def status(self, text: str) -> bool:
        """Free text shown by ``systemctl status``."""
        return self.send("STATUS=" + text.replace("\n", " "))

    # -- watchdog -------------------------------------------------------------------------

    def tick(self) -> bool:
        """One watchdog period: ping if ``alive()``, else withhold. True when a ping was sent."""
        try:
            ok = bool(self._alive())
        except Exception:
            log.exception("watchdog liveness check raised")
            ok = False
        if not ok:
            self.skipped += 1
            if not self._withheld:
                log.error("engine not alive: withholding systemd watchdog pings")
                self._withheld = True
            return False
        if self._withheld:
            log.warning("engine alive again: resuming systemd watchdog pings")
            self._withheld = False
        sent = self.send("WATCHDOG=1")
        if sent:
            self.pings += 1
        return sent

    def start_watchdog(self) -> bool:
        """Start the ping thread when systemd asked for a watchdog. True if it started."""
        if self.interval is None or self._thread is not None:
            return False
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="zerolayer-sd-watchdog", daemon=True)
        self._thread.start()
        log.info("systemd watchdog: ping every %.3f s", self.interval)
        return True

    def _run(self) -> None:
        assert self.interval is not None
        # Ping once at start so a slow first interval cannot trip the watchdog.
        self.tick()
        while not self._stop.wait(self.interval):
            self.tick()

    def close(self) -> None:
        """Stop the watchdog thread and close the socket."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        with self._lock:
            if self._sock is not None:
                self._sock.close()
                self._sock = None
