"""The API port's operator endpoints (/health, /metrics, /version), the per-request response
cache bypass (Cache-Control) through the openai SDK, and CORS (off by default, then allowed
origins only, with the OPTIONS preflight) — against real daemons (synthetic backend)."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import openai
import pytest

from benchmarks._support.daemon import Daemon
from zerolayer.http.routes import version

MODEL = "synthetic"
USER = [{"role": "user", "content": "Tell me something."}]


def _get(url: str, method: str = "GET", headers: dict | None = None):
    req = urllib.request.Request(url, method=method, headers=headers or {})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, dict(r.headers.items()), r.read()
    except urllib.error.HTTPError as err:
        return err.code, dict(err.headers.items()), err.read()


@pytest.fixture(scope="module")
def daemon():
    with Daemon() as d:
        yield d


def test_health_metrics_version_on_the_api_port(daemon):
    status, headers, body = _get(daemon.http_url + "/health")
    assert status == 200 and body == b"ok\n"
    status, headers, body = _get(daemon.http_url + "/version")
    info = json.loads(body)
    assert status == 200 and info["version"] == version() and info["started_at"] > 0
    oai = openai.OpenAI(base_url=daemon.http_url + "/v1", api_key="none", max_retries=0)
    oai.chat.completions.create(model=MODEL, messages=USER, max_tokens=3)
    status, headers, body = _get(daemon.http_url + "/metrics")
    assert status == 200 and headers["content-type"].startswith("text/plain")
    api_port = [ln for ln in body.decode().splitlines() if ln.startswith("zerolayer_")]
    assert any(ln.startswith('zerolayer_generation_tokens_total{api="openai"} ') for ln in api_port)
    # the metrics port stays, with the same registry
    _, _, other = _get(daemon.metrics_url + "/metrics")
    assert b"zerolayer_generation_tokens_total" in other
    assert _get(daemon.http_url + "/nonesuch")[0] == 404


def test_cache_control_bypasses_the_response_cache(daemon):
    oai = openai.OpenAI(base_url=daemon.http_url + "/v1", api_key="none", max_retries=0)
    ask = dict(model=MODEL, messages=USER, max_tokens=6, temperature=0)

    def hit(**kw) -> bool:
        raw = oai.chat.completions.with_raw_response.create(**ask, **kw)
        raw.parse()
        return raw.headers.get("x-zerolayer-cache") == "hit"

    bypass = {"extra_headers": {"Cache-Control": "no-cache"}}
    assert not hit(**bypass)  # a bypassing first request stores nothing...
    assert not hit()  # ...so this one runs the model (and is stored)
    assert hit()  # this one is a replay
    assert not hit(**bypass)  # a bypass never reads it
    assert not hit(extra_headers={"Cache-Control": "max-age=0, no-store"})
    with oai.chat.completions.with_streaming_response.create(**ask, stream=True) as raw:
        assert raw.headers.get("x-zerolayer-cache") == "hit"
        assert any(chunk.choices for chunk in raw.parse())


def test_cors_is_off_by_default(daemon):
    origin = {"Origin": "http://127.0.0.1:9999"}
    status, headers, _ = _get(daemon.http_url + "/v1/models", headers=origin)
    assert status == 200 and "access-control-allow-origin" not in {k.lower() for k in headers}
    preflight = {**origin, "Access-Control-Request-Method": "POST"}
    assert _get(daemon.http_url + "/v1/chat/completions", "OPTIONS", preflight)[0] == 405


def test_cors_allows_the_configured_origins_only():
    allowed = "http://127.0.0.1:9999"
    with Daemon({"HTTP__CORS_ORIGINS": json.dumps([allowed])}) as d:
        preflight = {
            "Origin": allowed,
            "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "authorization, content-type",
        }
        status, headers, body = _get(d.http_url + "/v1/chat/completions", "OPTIONS", preflight)
        low = {k.lower(): v for k, v in headers.items()}
        assert status == 204 and body == b""
        assert low["access-control-allow-origin"] == allowed
        assert "POST" in low["access-control-allow-methods"]
        assert "authorization" in low["access-control-allow-headers"]
        oai = openai.OpenAI(
            base_url=d.http_url + "/v1", api_key="none", max_retries=0,
            default_headers={"Origin": allowed},
        )  # fmt: skip
        stream = oai.chat.completions.with_streaming_response.create(
            model=MODEL, messages=USER, max_tokens=3, stream=True
        )
        with stream as raw:
            assert raw.headers.get("access-control-allow-origin") == allowed
            list(raw.parse())
        other = {"Origin": "http://evil.example", "Access-Control-Request-Method": "POST"}
        assert _get(d.http_url + "/v1/chat/completions", "OPTIONS", other)[0] == 405
        status, headers, _ = _get(d.http_url + "/v1/models", headers={"Origin": "http://x.y"})
        assert "access-control-allow-origin" not in {k.lower() for k in headers}
