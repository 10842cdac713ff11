"""Logging: JSON lines carry the standard and extra fields; plain text keeps extras too."""

from __future__ import annotations

import io
import json
import logging
import subprocess
import sys
from collections.abc import Iterator

import pytest

from zerolayer.ops.logging import REQUEST_LOG, setup_logging


@pytest.fixture(autouse=True)
def _restore_root() -> Iterator[None]:
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield
    for h in list(root.handlers):
        if h not in handlers:
            root.removeHandler(h)
    root.setLevel(level)
    REQUEST_LOG.setLevel(logging.NOTSET)


def test_json_lines_fields() -> None:
    buf = io.StringIO()
    setup_logging("info", json_lines=True, stream=buf)
    log = logging.getLogger("zerolayer.server")
    log.info("stream %d done", 7, extra={"request_id": "r-1", "stream": 7, "code": "OVERLOADED"})
    log.debug("hidden at info level")
    lines = buf.getvalue().splitlines()
    assert len(lines) == 1
    obj = json.loads(lines[0])
    assert obj["level"] == "info"
    assert obj["logger"] == "zerolayer.server"
    assert obj["msg"] == "stream 7 done"
    assert obj["request_id"] == "r-1"
    assert obj["stream"] == 7
    assert obj["code"] == "OVERLOADED"
    assert obj["ts"].endswith("Z") and "T" in obj["ts"]
    assert "args" not in obj and "levelno" not in obj


def test_json_exception_and_odd_values_one_line() -> None:
    buf = io.StringIO()
    setup_logging("debug", json_lines=True, stream=buf)
    try:
        raise ValueError("bad\nthing")
    except ValueError:
        logging.getLogger("x").exception("failed", extra={"obj": object()})
    lines = buf.getvalue().splitlines()
    assert len(lines) == 1  # multi-line tracebacks stay inside one JSON object
    obj = json.loads(lines[0])
    assert obj["level"] == "error"
    assert "ValueError" in obj["exc"]
    assert obj["obj"].startswith("<object")


def test_plain_text_with_extras() -> None:
    buf = io.StringIO()
    setup_logging("warning", json_lines=False, stream=buf)
    logging.getLogger("zerolayer.server").warning("slow consumer", extra={"request_id": "r-9"})
    logging.getLogger("zerolayer.server").info("not shown")
    out = buf.getvalue()
    assert "WARNING zerolayer.server: slow consumer request_id=r-9" in out
    assert "not shown" not in out
    with pytest.raises(json.JSONDecodeError):
        json.loads(out.splitlines()[0])


def test_request_log_off_by_default_errors_always() -> None:
    buf = io.StringIO()
    setup_logging("info", json_lines=True, stream=buf)
    assert not REQUEST_LOG.isEnabledFor(logging.INFO)
    REQUEST_LOG.info("finished", extra={"request_id": "a"})
    REQUEST_LOG.error("failed", extra={"request_id": "b"})
    setup_logging("info", json_lines=True, requests=True, stream=buf)
    assert REQUEST_LOG.isEnabledFor(logging.INFO)
    REQUEST_LOG.info("finished", extra={"request_id": "c"})
    ids = [json.loads(line)["request_id"] for line in buf.getvalue().splitlines()]
    assert ids == ["b", "c"]


def test_setup_twice_replaces_handler() -> None:
    a, b = io.StringIO(), io.StringIO()
    setup_logging("info", json_lines=True, stream=a)
    setup_logging("info", json_lines=True, stream=b)
    logging.getLogger("y").info("once")
    assert a.getvalue() == ""
    assert len(b.getvalue().splitlines()) == 1


FIELDS = {"frame": "127.0.0.1:7070", "metrics": "127.0.0.1:9464", "model": "m", "hooks": "a,b"}


def test_announce_is_written_whatever_the_level_in_both_formats() -> None:
    from benchmarks._support.daemon import listening_fields
    from zerolayer.ops.logging import announce

    for json_lines in (False, True):
        out = io.StringIO()
        setup_logging("error", json_lines=json_lines, stream=out)
        announce("zerolayer", "listening", **FIELDS)
        (line,) = out.getvalue().splitlines()
        if json_lines:
            record = json.loads(line)
            assert (record["level"], record["logger"], record["msg"]) == (
                "info",
                "zerolayer",
                "listening",
            )
        else:
            assert line.endswith(
                " INFO zerolayer: listening frame=127.0.0.1:7070 metrics=127.0.0.1:9464 "
                "model=m hooks=a,b"
            )
        # The test helper that waits for daemons reads both.
        fields = listening_fields(line)
        assert fields is not None and {k: fields[k] for k in FIELDS} == FIELDS


def test_warnings_and_uncaught_thread_errors_are_json_lines() -> None:
    # In a fresh interpreter: pytest replaces warning and thread-exception hooks of its own.
    script = """
import threading, warnings
from zerolayer.ops.logging import setup_logging
setup_logging("info", json_lines=True)
warnings.warn("old knob", UserWarning)
t = threading.Thread(target=lambda: 1 / 0)
t.start()
t.join()
"""
    proc = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60
    )
    assert proc.stdout == ""
    records = [json.loads(line) for line in proc.stderr.splitlines()]
    assert any("UserWarning: old knob" in r["msg"] for r in records)
    (crash,) = [r for r in records if r["msg"] == "uncaught exception"]
    assert "ZeroDivisionError: division by zero" in crash["exc"]
