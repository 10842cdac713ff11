"""Process logging: plain text or JSON lines on stderr (journald and container runtimes collect it).

JSON lines carry ``ts``, ``level``, ``logger``, ``msg`` and every ``extra=`` field the caller
passed (``request_id``, ``stream``, ``code``, ...), one object per line. Per-request lines go to
the ``zerolayer.requests`` logger, which is silenced unless ``logging.requests`` is on, so the hot
path can check ``REQUEST_LOG.isEnabledFor(logging.INFO)`` once and skip formatting entirely.
Everything the process writes to stderr goes through the one handler, so in JSON mode every line
is JSON: ``announce`` (the "listening" line, written whatever the level), Python warnings, and
uncaught exceptions of any thread.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import threading
import time
from types import TracebackType
from typing import IO, Any

from zerolayer.ops.escape import client_text

__all__ = [
    "REQUEST_LOG",
    "JsonFormatter",
    "LogThrottle",
    "announce",
    "installed_handler",
    "setup_logging",
]

REQUEST_LOG = logging.getLogger("zerolayer.requests")

# Attributes every LogRecord has; anything else on a record came from ``extra=``.
_STANDARD = frozenset(vars(logging.LogRecord("x", logging.INFO, "x", 0, "x", None, None))) | {
    "message",
    "asctime",
    "taskName",
}

_PLAIN_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def _timestamp(created: float) -> str:
    # RFC 3339 UTC with milliseconds: sortable and parsed by every log pipeline.
    secs = int(created)
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(secs)) + (
        f".{int((created - secs) * 1000):03d}Z"
    )


class JsonFormatter(logging.Formatter):
    """One JSON object per record; extra fields are copied as they are (non-JSON via str)."""

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "ts": _timestamp(record.created),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        for key, value in record.__dict__.items():
            if key not in _STANDARD and not key.startswith("_"):
                out[key] = value
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        if record.stack_info:
            out["stack"] = record.stack_info
        # A client's lone surrogate becomes its JSON escape (the line stays valid UTF-8).
        return client_text(json.dumps(out, ensure_ascii=False, default=str))


class _PlainFormatter(logging.Formatter):
    """Text lines; extra fields appended as key=value so they are not lost without JSON."""

    def format(self, record: logging.LogRecord) -> str:
        line = super().format(record)
        extras = [
            f"{k}={client_text(str(v))}"
            for k, v in record.__dict__.items()
            if k not in _STANDARD and not k.startswith("_")
        ]
        if extras:
            first, sep, rest = line.partition("\n")
            line = first + " " + " ".join(extras) + sep + rest
        return _surrogates_escaped(line)


def _surrogates_escaped(line: str) -> str:
    """``line`` encodable as UTF-8: a client's lone surrogate as its backslash escape."""
    return line.encode("utf-8", "backslashreplace").decode("utf-8")


# The ignore below: StreamHandler is generic in typeshed only; Python 3.10 cannot subscript it.
class _OurHandler(logging.StreamHandler):  # type: ignore[type-arg]
    """Marks the handler setup_logging installed, so a second call replaces it."""


def setup_logging(
    level: str = "info",
    json_lines: bool = False,
    requests: bool = False,
    stream: IO[str] | None = None,
) -> logging.Handler:
    """Configure the root logger once for the process; calling again reconfigures.

    ``level`` is one of debug/info/warning/error; ``requests`` enables the one-line-per-request
    log at info level. Returns the installed handler.
    """
    root = logging.getLogger()
    for h in list(root.handlers):
        if isinstance(h, _OurHandler):
            root.removeHandler(h)
            h.close()
    handler = _OurHandler(stream if stream is not None else sys.stderr)
    handler.setFormatter(JsonFormatter() if json_lines else _PlainFormatter(_PLAIN_FORMAT))
    root.addHandler(handler)
    root.setLevel(level.upper())
    # Errors always reach the log; per-request info lines only when asked for.
    REQUEST_LOG.setLevel(logging.INFO if requests else logging.WARNING)
    logging.captureWarnings(True)  # warnings.warn (torch, ...) as log records, not raw stderr
    sys.excepthook = _log_uncaught
    threading.excepthook = lambda a: _log_uncaught(a.exc_type, a.exc_value, a.exc_traceback)
    return handler


def _log_uncaught(
    exc_type: type[BaseException], exc: BaseException | None, tb: TracebackType | None
) -> None:
    # A thread's hook may carry no exception object (threading.ExceptHookArgs.exc_value).
    info = (exc_type, exc, tb) if exc is not None else (None, None, None)
    logging.getLogger("zerolayer").critical("uncaught exception", exc_info=info)


def installed_handler() -> logging.Handler | None:
    """The handler setup_logging installed, or None before it ran."""
    return next((h for h in logging.getLogger().handlers if isinstance(h, _OurHandler)), None)


def announce(logger: str, msg: str, **fields: object) -> None:
    """Write one info line whatever the configured level, in the process's format (plain:
    ``... logger: msg k=v ...``; JSON: an object with the fields as keys). One write() with its
    newline, so lines of workers sharing the stream never interleave. For start-up facts that
    scripts wait for, like the bound ports."""
    record = logging.LogRecord(logger, logging.INFO, __file__, 0, msg, None, None)
    record.__dict__.update(fields)
    handler = installed_handler()
    formatter = handler.formatter if handler is not None and handler.formatter else None
    line = (formatter or _PlainFormatter(_PLAIN_FORMAT)).format(record)
    stream = getattr(handler, "stream", None) or sys.stderr
    stream.flush()
    try:
        fd = stream.fileno()
    except (AttributeError, OSError, ValueError):  # an in-memory stream (tests)
        stream.write(line + "\n")
        return
    os.write(fd, (line + "\n").encode())


class LogThrottle:
    """At most one line per ``interval_s`` per key: for events a client can cause at will
    (refused handshakes, descriptor exhaustion), so an attacker cannot flood the log. A line
    says how many of its kind were held back since the last one."""

    def __init__(self, interval_s: float = 60.0) -> None:
        self.interval_s = interval_s
        self._next: dict[str, float] = {}
        self._held: dict[str, int] = {}

    def warning(self, logger: logging.Logger, key: str, msg: str, *args: object) -> bool:
        """Log ``msg % args`` at warning unless ``key`` was logged less than interval_s ago;
        True when the line was written."""
        now = time.monotonic()
        if now < self._next.get(key, 0.0):
            self._held[key] = self._held.get(key, 0) + 1
            return False
        self._next[key] = now + self.interval_s
        held = self._held.pop(key, 0)
        logger.warning(
            msg + (" (%d more since the last such line)" if held else ""),
            *args,
            *((held,) if held else ()),
        )
        return True
