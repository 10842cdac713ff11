"""Ollama's API on the HTTP port through the official ``ollama`` client, against a real daemon
(synthetic backend): the model listings (version, tags, ps, show), an unknown model's 404, the
key on ``/api/show`` (the listings are keyless), and the endpoints not served yet in Ollama's
error shape (``/api/embed`` 501, ``/api/chat`` 404)."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import ollama
import pytest

from benchmarks._support.daemon import Daemon
from zerolayer.http.ollama import OLLAMA_API_VERSION
from zerolayer.http.routes import version

MODEL = "synthetic"
KEY = "k-ollama"


def _call(url: str, body: dict | None = None) -> tuple[int, dict]:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"content-type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


@pytest.fixture(scope="module")
def daemon():
    with Daemon({"AUTH__ENABLED": "true", "AUTH__API_KEYS": json.dumps([KEY])}) as d:
        yield d


@pytest.fixture(scope="module")
def client(daemon):
    return ollama.Client(host=daemon.http_url, headers={"Authorization": f"Bearer {KEY}"})


def test_version_and_tags_need_no_key(daemon):
    assert _call(daemon.http_url + "/api/version") == (
        200,
        {"version": OLLAMA_API_VERSION, "zerolayer": version()},
    )
    status, tags = _call(daemon.http_url + "/api/tags")
    assert status == 200 and [m["name"] for m in tags["models"]] == [MODEL + ":latest"]


def test_list_ps_and_show_through_the_client(client):
    (listed,) = client.list().models
    assert listed.model == MODEL + ":latest"
    (running,) = client.ps().models
    assert running.model == MODEL + ":latest" and running.size_vram == 0
    for name in (MODEL, MODEL + ":latest"):
        shown = client.show(name)
        assert shown.modelinfo is not None and shown.modelinfo["general.name"] == MODEL
        assert shown.modelinfo["general.context_length"] > 0


def test_an_unknown_model_is_404_naming_it(client):
    with pytest.raises(ollama.ResponseError) as err:
        client.show("llama3:8b")
    assert err.value.status_code == 404 and err.value.error == "model 'llama3:8b' not found"


def test_show_needs_the_key_and_answers_in_ollamas_shape(daemon):
    status, body = _call(daemon.http_url + "/api/show", {"model": MODEL})
    assert status == 401 and isinstance(body["error"], str)


def test_not_served_yet_in_ollamas_error_shape(client):
    with pytest.raises(ollama.ResponseError) as err:
        client.embed(MODEL, "hello")
    assert err.value.status_code == 501 and "not available yet" in err.value.error
    with pytest.raises(ollama.ResponseError) as err:
        client.chat(MODEL, [{"role": "user", "content": "Hi"}], stream=False)
    assert err.value.status_code == 404 and "/api/chat is not served yet" in err.value.error
