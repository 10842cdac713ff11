"""The HTTP endpoints: which path is which API call, with its method and content type checked,
and where a request's API key is.

``route`` names the endpoint of a request and sets the API whose error shape it gets (paths
under ``/v1/messages`` are Anthropic's, the rest OpenAI's), or raises 404 (unknown path), 405
(wrong method, with ``Allow``) or 415 (a body that is not JSON).
"""

from __future__ import annotations

from gateway.http.errors import ANTHROPIC, OPENAI, HttpError
from gateway.http.server import Incoming

CHAT, COMPLETION, MODELS, MODEL, MESSAGES, COUNT_TOKENS = (
    "chat",
    "completion",
    "models",
    "model",
    "messages",
    "count_tokens",
)

# path → (method, API, endpoint)
ROUTES: dict[bytes, tuple[bytes, str, str]] = {
    b"/v1/chat/completions": (b"POST", OPENAI, CHAT),
    b"/v1/completions": (b"POST", OPENAI, COMPLETION),
    b"/v1/models": (b"GET", OPENAI, MODELS),
    b"/v1/messages": (b"POST", ANTHROPIC, MESSAGES),
    b"/v1/messages/count_tokens": (b"POST", ANTHROPIC, COUNT_TOKENS),
}
MODEL_PREFIX = b"/v1/models/"
# Sent on an answer replayed from the response cache (the frame protocol's DONE cache bit 0).
CACHE_HIT_HEADER = b"x-zerolayer-cache: hit\r\n"
_NO_CACHE = (b"no-cache", b"no-store")


def api_of(path: bytes) -> str:
    """Paths under /v1/messages are Anthropic's, the rest OpenAI's (for error shapes)."""
    return ANTHROPIC if path.startswith(b"/v1/messages") else OPENAI


def route(request: Incoming) -> str:
    """The endpoint of ``request``; sets ``request.api``. Raises HttpError 404/405/415."""
    path = request.path.rstrip(b"/") or b"/"
    request.api = api_of(path)
    found = ROUTES.get(path)
    if found is None:
        if path.startswith(MODEL_PREFIX) and len(path) > len(MODEL_PREFIX):
            found = (b"GET", OPENAI, MODEL)
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


def api_key(request: Incoming) -> bytes:
    """The key from ``x-api-key`` or ``Authorization: Bearer``; empty when there is none. An
    Authorization header of another scheme is a 401."""
    key = request.headers.get(b"x-api-key")
    if key is not None:
        return key.strip()
    auth = request.headers.get(b"authorization")
    if auth is None:
        return b""
    scheme, _, value = auth.strip().partition(b" ")
    if scheme.lower() != b"bearer":
        raise HttpError(401, "Authorization must use the Bearer scheme", code="invalid_api_key")
    return value.strip()


def wants_cache(request: Incoming) -> bool:
    """False when ``Cache-Control`` carries ``no-cache`` or ``no-store``: the request bypasses
    the response cache (neither looked up nor stored)."""
    value = request.headers.get(b"cache-control")
    if value is None:
        return True
    directives = {d.split(b"=", 1)[0].strip().lower() for d in value.split(b",")}
    return not any(d in directives for d in _NO_CACHE)
