"""Client strings on their way out (issue #25 item 1): escaped, always UTF-8, one line; and the
log throttle for events a client can cause at will."""

from __future__ import annotations

import io
import json
import logging

from zerolayer.frames.protocol import encode_error
from zerolayer.http.errors import ANTHROPIC, OPENAI, HttpError, error_body
from zerolayer.ops.escape import client_text
from zerolayer.ops.logging import LogThrottle, setup_logging


def test_client_text_escapes_surrogates_and_controls_only():
    assert client_text("héllo\tok") == "héllo\tok"
    out = client_text("a\ud800b\nc\x00")
    assert out == "a\\ud800b\\x0ac\\x00"
    out.encode("utf-8")


def test_error_body_and_frame_survive_a_lone_surrogate():
    err = HttpError(400, "unknown field '\ud800'", param="\udfff")
    for api in (OPENAI, ANTHROPIC):
        body = json.loads(error_body(api, err))
        assert "\\ud800" in json.dumps(body) or "ud800" in str(body)
    assert b"\\ud800" in encode_error(1, 8, "unknown JSON keys: \ud800")


def test_log_lines_stay_utf8_with_a_client_surrogate():
    for json_lines in (False, True):
        buf = io.StringIO()
        setup_logging("info", json_lines=json_lines, stream=buf)
        logging.getLogger("zerolayer.t").warning("bad %s", "\ud800", extra={"path": "x\ny"})
        line = buf.getvalue()
        line.encode("utf-8")
        assert "ud800" in line and line.count("\n") == 1
    setup_logging("warning")


def test_throttle_writes_one_line_per_interval_and_counts_the_rest(caplog):
    t = LogThrottle(interval_s=3600)
    log = logging.getLogger("zerolayer.t2")
    with caplog.at_level(logging.WARNING, "zerolayer.t2"):
        assert t.warning(log, "k", "refused %s", "x")
        assert not t.warning(log, "k", "refused %s", "y")
        assert t.warning(log, "other", "other")
    assert [r.getMessage() for r in caplog.records] == ["refused x", "other"]


def test_a_prompt_token_id_of_2_63_is_reported_as_out_of_range():
    """Issue #25 item 8: not "must be >= 0" for a number that is positive."""
    import pytest

    from zerolayer.http import openai

    with pytest.raises(
        Exception
    ) as exc:  # the door's refusal type (zerolayer.request_path.validation)
        openai.parse_completion(b'{"model":"m","prompt":[9223372036854775808]}', "m")
    assert "must be in [0, 2147483647]" in str(exc.value)
