"""Process logging: plain text or JSON lines on stderr (journald and container runtimes collect it).

JSON lines carry ``ts``, ``level``, ``logger``, ``msg`` and every ``extra=`` field the caller
passed (``request_id``, ``stream``, ``code``, ...), one object per line. Per-request lines go to
the ``zerolayer.requests`` logger, which is silenced unless ``logging.requests`` is on, so the hot
path can check ``REQUEST_LOG.isEnabledFor(logging.INFO)`` once and skip formatting entirely.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from typing import IO, Any

__all__ = ["REQUEST_LOG", "JsonFormatter", "setup_logging"]

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
        return json.dumps(out, ensure_ascii=False, default=str)


class _PlainFormatter(logging.Formatter):
    """Text lines; extra fields appended as key=value so they are not lost without JSON."""

    def format(self, record: logging.LogRecord) -> str:
        line = super().format(record)
        extras = [
            f"{k}={v}"
            for k, v in record.__dict__.items()
            if k not in _STANDARD and not k.startswith("_")
        ]
        if extras:
            first, sep, rest = line.partition("\n")
            line = first + " " + " ".join(extras) + sep + rest
        return line


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
    return handler
