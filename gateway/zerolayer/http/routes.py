"""The HTTP endpoints: which path is which API call, with its method and content type checked,
where a request's API key is, and the operator's pages on the API port.

``route`` names the endpoint of a request and sets the API whose error shape it gets (paths
under ``/v1/messages`` are Anthropic's, under ``/api/`` Ollama's, the rest OpenAI's — the
Responses API, ``/tokenize`` and ``/v1/embeddings`` included), or raises 404 (unknown path;
any path under ``/v1/responses/``: responses are not stored), 405 (wrong method, with
``Allow``) or 415 (a body that is not JSON). ``KEYLESS`` are the API endpoints answered without
a key (the model listings, as ``/v1/models``).

``OpsPages`` answers the endpoints that are not an API call (``/health``, ``/metrics``,
``/version``, the status page at ``/``) and the CORS rules: off unless ``http.cors_origins``
names the browser origins allowed (``*`` for any), then an allowed origin's request gets
``access-control-allow-origin`` and its ``OPTIONS`` preflight a 204.
"""

from __future__ import annotations

import json
import time
from importlib import metadata, resources
from typing import TYPE_CHECKING

from zerolayer.http.errors import ANTHROPIC, OLLAMA, OPENAI, HttpError
from zerolayer.http.server import Incoming

if TYPE_CHECKING:
    from zerolayer.ops.metrics import Metrics
    from zerolayer.ops.readiness import Health

CHAT, COMPLETION, MODELS, MODEL, MESSAGES, COUNT_TOKENS = (
    "chat",
    "completion",
    "models",
    "model",
    "messages",
    "count_tokens",
)
RESPONSES, TOKENIZE, DETOKENIZE, EMBEDDINGS = "responses", "tokenize", "detokenize", "embeddings"
# Ollama's API (paths under /api/)
OLLAMA_TAGS, OLLAMA_SHOW, OLLAMA_VERSION, OLLAMA_PS = (
    "api_tags",
    "api_show",
    "api_version",
    "api_ps",
)
OLLAMA_CHAT, OLLAMA_GENERATE, OLLAMA_EMBED, OLLAMA_EMBEDDINGS = (
    "api_chat",
    "api_generate",
    "api_embed",
    "api_embeddings",
)
# Ollama's model management (pull, push, create, copy, delete): one served model, fixed at start
OLLAMA_MANAGE = "api_manage"
HEALTH, METRICS, VERSION, STATUS_PAGE = "health", "metrics", "version", "status_page"
OPS = frozenset({HEALTH, METRICS, VERSION, STATUS_PAGE})  # answered by OpsPages, no key needed
# API endpoints answered without an API key: which model is served (as vLLM's /v1/models)
KEYLESS = frozenset({MODELS, MODEL, OLLAMA_TAGS, OLLAMA_VERSION})

# path → (method, API, endpoint)
ROUTES: dict[bytes, tuple[bytes, str, str]] = {
    b"/v1/chat/completions": (b"POST", OPENAI, CHAT),
    b"/v1/completions": (b"POST", OPENAI, COMPLETION),
    b"/v1/models": (b"GET", OPENAI, MODELS),
    b"/v1/messages": (b"POST", ANTHROPIC, MESSAGES),
    b"/v1/messages/count_tokens": (b"POST", ANTHROPIC, COUNT_TOKENS),
    b"/v1/responses": (b"POST", OPENAI, RESPONSES),
    b"/v1/embeddings": (b"POST", OPENAI, EMBEDDINGS),
    b"/tokenize": (b"POST", OPENAI, TOKENIZE),
    b"/detokenize": (b"POST", OPENAI, DETOKENIZE),
    b"/api/tags": (b"GET", OLLAMA, OLLAMA_TAGS),
    b"/api/ps": (b"GET", OLLAMA, OLLAMA_PS),
    b"/api/version": (b"GET", OLLAMA, OLLAMA_VERSION),
    b"/api/show": (b"POST", OLLAMA, OLLAMA_SHOW),
    b"/api/chat": (b"POST", OLLAMA, OLLAMA_CHAT),
    b"/api/generate": (b"POST", OLLAMA, OLLAMA_GENERATE),
    b"/api/embed": (b"POST", OLLAMA, OLLAMA_EMBED),
    b"/api/embeddings": (b"POST", OLLAMA, OLLAMA_EMBEDDINGS),
    b"/api/pull": (b"POST", OLLAMA, OLLAMA_MANAGE),
    b"/api/push": (b"POST", OLLAMA, OLLAMA_MANAGE),
    b"/api/create": (b"POST", OLLAMA, OLLAMA_MANAGE),
    b"/api/copy": (b"POST", OLLAMA, OLLAMA_MANAGE),
    b"/api/delete": (b"DELETE", OLLAMA, OLLAMA_MANAGE),
    b"/health": (b"GET", OPENAI, HEALTH),
    b"/metrics": (b"GET", OPENAI, METRICS),
    b"/version": (b"GET", OPENAI, VERSION),
    b"/": (b"GET", OPENAI, STATUS_PAGE),
}
MODEL_PREFIX = b"/v1/models/"
RESPONSE_PREFIX = b"/v1/responses/"  # a stored response's paths: we store none
# Sent on an answer replayed from the response cache (the frame protocol's DONE cache bit 0).
CACHE_HIT_HEADER = b"x-zerolayer-cache: hit\r\n"
_NO_CACHE = (b"no-cache", b"no-store")


def api_of(path: bytes) -> str:
    """Paths under /v1/messages are Anthropic's, under /api/ Ollama's, the rest OpenAI's (for
    error shapes)."""
    if path.startswith(b"/v1/messages"):
        return ANTHROPIC
    return OLLAMA if path.startswith(b"/api/") else OPENAI


def route(request: Incoming) -> str:
    """The endpoint of ``request``; sets ``request.api``. Raises HttpError 404/405/415."""
    path = request.path.rstrip(b"/") or b"/"
    request.api = api_of(path)
    found = ROUTES.get(path)
    if found is None:
        if path.startswith(MODEL_PREFIX) and len(path) > len(MODEL_PREFIX):
            found = (b"GET", OPENAI, MODEL)
        elif path.startswith(RESPONSE_PREFIX):
            raise HttpError(
                404,
                "responses are not stored (store: false): send the whole conversation as input",
                code="not_found",
            )
        else:
            shown = path.decode("utf-8", "replace")[:200]
            raise HttpError(404, f"no such endpoint: {shown}", code="unknown_url")
    method, api, endpoint = found
    request.api = api
    if request.method != method:
        raise HttpError(
            405,
            f"{request.method.decode('latin-1')} is not allowed here; use {method.decode()}",
            code="method_not_allowed",
            allow=method.decode(),
        )
    if method == b"POST":
        kind = request.headers.get(b"content-type")
        if kind is not None:
            media = kind.split(b";", 1)[0].strip().lower()
            if media != b"application/json" and not media.endswith(b"+json"):
                raise HttpError(
                    415,
                    f"content-type must be application/json, got {kind.decode('latin-1')!r}",
                    code="unsupported_media_type",
                )
    return endpoint


MAX_CREDENTIALS = 4  # x-api-key and Authorization headers one request may carry


def credentials(request: Incoming) -> list[bytes]:
    """Every key the request presents: each ``x-api-key`` and ``Authorization: Bearer`` header
    (a repeated one included), empty when there is none; the caller checks each of them. An
    Authorization header of another scheme is a 401, and so are more than
    ``MAX_CREDENTIALS`` headers (each one costs a comparison with every stored key)."""
    found: list[bytes] = []
    presented = request.credential_headers()
    if len(presented) > MAX_CREDENTIALS:
        raise HttpError(401, "too many credential headers", code="invalid_api_key")
    for name, value in presented:
        if name == b"authorization":
            scheme, _, value = value.strip().partition(b" ")
            if scheme.lower() != b"bearer":
                raise HttpError(
                    401, "Authorization must use the Bearer scheme", code="invalid_api_key"
                )
        found.append(value.strip())
    return found


def wants_cache(request: Incoming) -> bool:
    """False when ``Cache-Control`` carries ``no-cache`` or ``no-store``: the request bypasses
    the response cache (neither looked up nor stored)."""
    value = request.headers.get(b"cache-control")
    if value is None:
        return True
    directives = {d.split(b"=", 1)[0].strip().lower() for d in value.split(b",")}
    return not any(d in directives for d in _NO_CACHE)


_TEXT = b"text/plain; charset=utf-8"
_NO_STORE = b"cache-control: no-store\r\n"
_ALLOW_METHODS = b"GET, POST, OPTIONS"
_ALLOW_HEADERS = (
    b"authorization, content-type, x-api-key, anthropic-version, cache-control, "
    b"x-stainless-arch, x-stainless-lang, x-stainless-os, x-stainless-package-version, "
    b"x-stainless-retry-count, x-stainless-runtime, x-stainless-runtime-version, "
    b"x-stainless-timeout, anthropic-dangerous-direct-browser-access"
)


def version() -> str:
    try:
        return metadata.version("zerolayer")
    except metadata.PackageNotFoundError:
        return "0+unknown"


class OpsPages:
    """The operator's endpoints on the API port and the CORS rules (module docstring).

    ``health`` is the daemon's ``zerolayer.ops.readiness.Health`` (``ready()``: None or why not;
    None: always ready), ``metrics`` its ``zerolayer.ops.metrics.Metrics`` (``render()``:
    Prometheus text; None: /metrics is 404)."""

    def __init__(
        self,
        health: Health | None,
        metrics: Metrics | None,
        cors_origins: tuple[str, ...] | list[str] = (),
    ) -> None:
        self.health = health
        self.metrics = metrics
        self._any_origin = "*" in cors_origins
        self._origins = frozenset(o.rstrip("/").encode() for o in cors_origins if o != "*")
        # started_at: when the daemon began serving (the status page's uptime)
        self._version = json.dumps({"version": version(), "started_at": time.time()}).encode()
        page = resources.files("zerolayer.http") / "static" / "index.html"
        self._page = page.read_bytes()

    def answer(self, endpoint: str) -> tuple[int, bytes, bytes, bytes]:
        """(status, body, content type, extra headers) of an OPS endpoint."""
        if endpoint == HEALTH:
            reason = self.health.ready() if self.health is not None else None
            if reason is None:
                return 200, b"ok\n", _TEXT, _NO_STORE
            return 503, (reason + "\n").encode(), _TEXT, _NO_STORE
        if endpoint == METRICS:
            if self.metrics is None:
                raise HttpError(404, "no metrics here", code="unknown_url")
            from zerolayer.ops.metrics import CONTENT_TYPE_LATEST

            return 200, self.metrics.render(), CONTENT_TYPE_LATEST.encode(), _NO_STORE
        if endpoint == VERSION:
            return 200, self._version, b"application/json", b""
        assert endpoint == STATUS_PAGE
        return 200, self._page, b"text/html; charset=utf-8", _NO_STORE

    def cors(self, request: Incoming) -> bytes:
        """The CORS headers for ``request``'s response: none unless its Origin is allowed."""
        origin = request.headers.get(b"origin")
        if origin is None or not (self._any_origin or origin.rstrip(b"/") in self._origins):
            return b""
        allowed = b"*" if self._any_origin else origin
        vary = b"" if self._any_origin else b"vary: origin\r\n"
        return b"access-control-allow-origin: %s\r\n%s" % (allowed, vary)

    def preflight(self, request: Incoming) -> tuple[int, bytes, bytes, bytes]:
        """The answer to an OPTIONS request: 204 with the allowed methods and headers for an
        allowed origin, else 405 (CORS is off, or this origin is not allowed)."""
        cors = self.cors(request)
        if not cors:
            raise HttpError(
                405,
                "OPTIONS is answered only for the origins in http.cors_origins",
                code="method_not_allowed",
                allow="GET, POST",
            )
        extra = cors + b"access-control-allow-methods: %s\r\n" % _ALLOW_METHODS
        extra += b"access-control-allow-headers: %s\r\n" % _ALLOW_HEADERS
        extra += b"access-control-max-age: 600\r\n"
        return 204, b"", _TEXT, extra
