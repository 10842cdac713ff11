"""What /healthz and /readyz answer: the start-up phase, then the checks the daemon registered.

The health endpoint is up before the model loads, so a probe gets "503 starting: loading model"
instead of a refused connection. Once serving, liveness is the engine thread stepping, readiness
adds whatever requests need (not draining, required stores reachable). A check returns None
when fine, else the reason, which becomes the 503 body. ``StorePing`` checks a store off the
request path: a thread PINGs it every second and the check reads the last answer.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

__all__ = ["Check", "Health", "StorePing"]

log = logging.getLogger("zerolayer.ops.health")

Check = Callable[[], "str | None"]  # None = fine, else why not


def _run(check: Check) -> str | None:
    # A check that raises is a failed check, not a crashed health thread.
    try:
        return check()
    except Exception as exc:
        log.exception("health check %r raised", check)
        return f"health check failed: {type(exc).__name__}: {exc}"


class Health:
    """Start-up phase plus named liveness and readiness checks; read from the health thread."""

    def __init__(self) -> None:
        self._phase: str | None = "starting"
        self._live: list[Check] = []
        self._ready: list[Check] = []

    @property
    def phase(self) -> str | None:
        """The start-up step under way, or None once serving."""
        return self._phase

    def starting(self, phase: str) -> None:
        """Name the start-up step under way ("loading model", ...): both probes say it."""
        self._phase = phase

    def serving(self) -> None:
        self._phase = None

    def add_liveness(self, check: Check) -> None:
        """A check /healthz and /readyz both need (the engine thread stepping)."""
        self._live.append(check)

    def add_readiness(self, check: Check) -> None:
        """A check only /readyz needs (not draining, stores reachable)."""
        self._ready.append(check)

    def live(self) -> str | None:
        """None when alive, else the reason."""
        if self._phase is not None:
            return f"starting: {self._phase}"
        return next(filter(None, map(_run, self._live)), None)

    def ready(self) -> str | None:
        """None when ready, else every failing reason, joined."""
        if self._phase is not None:
            return f"starting: {self._phase}"
        reasons = [r for r in map(_run, (*self._live, *self._ready)) if r]
        return "; ".join(reasons) or None


class StorePing:
    """Calls ``ping`` every ``interval_s`` on a daemon thread; ``check`` gives the last failure.

    ``what`` names the store and setting in the reason, e.g. "ratelimit.redis_url redis://...".
    Changes are logged once per transition (unreachable, then reachable again).
    """

    def __init__(self, what: str, ping: Callable[[], object], interval_s: float = 1.0) -> None:
        self.what = what
        self._ping = ping
        self._interval = interval_s
        self._failure: str | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="zerolayer-store-ping", daemon=True)

    def start(self) -> StorePing:
        self._thread.start()
        return self

    def check(self) -> str | None:
        return self._failure

    def probe_once(self) -> None:
        try:
            self._ping()
        except Exception as exc:
            failure = f"{self.what} unreachable: {exc}"
            if self._failure is None:
                log.error("%s; /readyz answers 503 until it is back", failure)
            self._failure = failure
            return
        if self._failure is not None:
            log.warning("%s reachable again", self.what)
        self._failure = None

    def _loop(self) -> None:
        while not self._stop.is_set():
            self.probe_once()
            self._stop.wait(self._interval)

    def close(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)
