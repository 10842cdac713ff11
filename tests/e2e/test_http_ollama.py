"""Ollama's API on the HTTP port through the official ``ollama`` client, against a real daemon
(synthetic backend): the model listings (version, tags, ps, show), an unknown model's 404, the
key on ``/api/show`` (the listings are keyless), chat and generate streamed (NDJSON) and not,
``options`` mapped or refused by name, and ``/api/embed`` (501: Ollama's embedding shapes are
not written yet) in Ollama's error shape."""

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


def test_embed_is_not_available_yet_in_ollamas_error_shape(client):
    with pytest.raises(ollama.ResponseError) as err:
        client.embed(MODEL, "hello")
    assert err.value.status_code == 501 and "not available yet" in err.value.error


HI = [{"role": "user", "content": "Hi"}]
GREEDY = {"temperature": 0, "seed": 1, "num_predict": 8}


def test_chat_streamed_equals_not_streamed_and_num_predict_ends_in_length(client):
    whole = client.chat(MODEL, HI, stream=False, options=GREEDY)
    assert whole.done and whole.done_reason == "length" and whole.eval_count == 8
    assert whole.message.role == "assistant" and whole.message.content
    parts = list(client.chat(MODEL, HI, stream=True, options=GREEDY))
    assert [p.done for p in parts] == [False] * (len(parts) - 1) + [True]
    assert "".join(p.message.content or "" for p in parts) == whole.message.content
    assert parts[-1].done_reason == "length" and parts[-1].eval_count == 8


def test_generate_chat_templated_and_raw(client):
    templated = client.generate(MODEL, "Hi", options=GREEDY)
    raw = client.generate(MODEL, "Hi", raw=True, options=GREEDY)
    assert templated.done_reason == raw.done_reason == "length"
    assert templated.prompt_eval_count > raw.prompt_eval_count  # the template's tokens
    parts = list(client.generate(MODEL, "Hi", raw=True, stream=True, options=GREEDY))
    assert "".join(p.response for p in parts) == raw.response


@pytest.mark.parametrize(
    ("options", "field"),
    [({"mirostat": 2}, "options.mirostat"), ({"bogus": 1}, "options.bogus")],
)
def test_options_we_cannot_honour_are_400_naming_them(client, options, field):
    with pytest.raises(ollama.ResponseError) as err:
        client.chat(MODEL, HI, stream=False, options=options)
    assert err.value.status_code == 400 and err.value.error.startswith(field)


def test_ignored_and_no_op_options_are_accepted(client):
    options = {**GREEDY, "num_ctx": 4096, "mirostat": 0, "typical_p": 1, "num_thread": 2}
    assert client.chat(MODEL, HI, stream=False, options=options).eval_count == 8


def test_format_and_options_are_checked_by_the_openai_rules_and_named_as_ollamas(client):
    """The synthetic model has no tokenizer.json: a schema reaches the grammar path and is
    refused there, naming ``format``; a bad num_predict is refused naming its option."""
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    for fmt in (schema, "json"):  # (the client itself refuses other strings)
        with pytest.raises(ollama.ResponseError) as err:
            client.chat(MODEL, HI, stream=False, format=fmt)
        assert err.value.status_code == 400 and err.value.error.startswith("format")
    with pytest.raises(ollama.ResponseError) as err:
        client.chat(MODEL, HI, stream=False, options={"num_predict": 0})
    assert err.value.status_code == 400 and err.value.error.startswith("options.num_predict")
