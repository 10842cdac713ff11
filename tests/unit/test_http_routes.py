"""The HTTP endpoints of every API (zerolayer.http.routes): each path's method, API label and
endpoint; which are answered without a key; what an unknown path under each API gets; and
Ollama's error shape (zerolayer.http.errors)."""

from __future__ import annotations

import json

import pytest

from zerolayer.codes import APIS, FINISH_NAMES, FinishReason
from zerolayer.http import routes
from zerolayer.http.door import LOCAL, PARSERS
from zerolayer.http.errors import (
    ANTHROPIC,
    OLLAMA,
    OPENAI,
    HttpError,
    error_body,
    stream_error_event,
)
from zerolayer.http.server import Incoming


def incoming(method: bytes, path: bytes) -> Incoming:
    request = Incoming(0.0)
    request.method, request.path = method, path
    return request


NEW = [
    (b"POST", b"/v1/responses", OPENAI, routes.RESPONSES),
    (b"POST", b"/v1/embeddings", OPENAI, routes.EMBEDDINGS),
    (b"POST", b"/tokenize", OPENAI, routes.TOKENIZE),
    (b"POST", b"/detokenize", OPENAI, routes.DETOKENIZE),
    (b"GET", b"/api/tags", OLLAMA, routes.OLLAMA_TAGS),
    (b"GET", b"/api/ps", OLLAMA, routes.OLLAMA_PS),
    (b"GET", b"/api/version", OLLAMA, routes.OLLAMA_VERSION),
    (b"POST", b"/api/show", OLLAMA, routes.OLLAMA_SHOW),
    (b"POST", b"/api/chat", OLLAMA, routes.OLLAMA_CHAT),
    (b"POST", b"/api/generate", OLLAMA, routes.OLLAMA_GENERATE),
    (b"POST", b"/api/embed", OLLAMA, routes.OLLAMA_EMBED),
    (b"POST", b"/api/embeddings", OLLAMA, routes.OLLAMA_EMBEDDINGS),
    (b"POST", b"/api/pull", OLLAMA, routes.OLLAMA_MANAGE),
    (b"DELETE", b"/api/delete", OLLAMA, routes.OLLAMA_MANAGE),
]


@pytest.mark.parametrize(("method", "path", "api", "endpoint"), NEW)
def test_every_new_endpoint_is_routed_with_its_api(method, path, api, endpoint) -> None:  # noqa: ANN001
    request = incoming(method, path)
    assert routes.route(request) == endpoint
    assert request.api == api
    wrong = incoming(b"GET" if method == b"POST" else b"POST", path)
    with pytest.raises(HttpError) as err:
        routes.route(wrong)
    assert err.value.status == 405 and err.value.allow == method.decode()
    assert wrong.api == api  # the 405 comes in the API's own shape


def test_unknown_paths_get_their_apis_error_shape() -> None:
    for path, api in [(b"/api/blobs/x", OLLAMA), (b"/v1/messages/x", ANTHROPIC), (b"/v2", OPENAI)]:
        request = incoming(b"POST", path)
        with pytest.raises(HttpError) as err:
            routes.route(request)
        assert err.value.status == 404 and request.api == api


@pytest.mark.parametrize("path", [b"/v1/responses/resp_1", b"/v1/responses/resp_1/cancel"])
def test_a_stored_response_is_404_saying_none_are_stored(path: bytes) -> None:
    with pytest.raises(HttpError) as err:
        routes.route(incoming(b"GET", path))
    assert err.value.status == 404 and "not stored" in err.value.message


def test_keyless_endpoints_are_the_listings_and_each_has_one_answer() -> None:
    assert {
        routes.MODELS,
        routes.MODEL,
        routes.OLLAMA_TAGS,
        routes.OLLAMA_VERSION,
    } == routes.KEYLESS
    assert not set(LOCAL) & set(PARSERS)  # an endpoint is answered one way
    assert not routes.OPS & (set(LOCAL) | set(PARSERS))


def test_ollama_label_and_error_shape() -> None:
    assert OLLAMA in APIS
    assert FINISH_NAMES[OLLAMA][FinishReason.MAX_TOKENS] == "length"
    assert FINISH_NAMES[OLLAMA][FinishReason.EOS] == "stop"
    err = HttpError(404, "model 'x' not found", param="model")
    assert json.loads(error_body(OLLAMA, err)) == {"error": "model 'x' not found"}
    line = stream_error_event(OLLAMA, err)
    assert line.endswith(b"\n") and line.count(b"\n") == 1
    assert json.loads(line) == {"error": "model 'x' not found"}
