"""The HTTP door: turns HTTP requests into streams of the shared request path, and the path's
callbacks into SSE events or one JSON body.

For each request: route it (routes.py), check its key (``RequestPath.authenticate``), parse its
body into a Request and a Reply (openai.py / anthropic.py), then ``RequestPath.open`` it as one
stream with text deltas. The path validates, tokenizes, runs the hooks and submits to the engine;
its refusals and the engine's outputs come back through this door's ``write_token`` /
``write_done`` / ``write_error`` and, once per delivery batch, ``flush`` (one write per
connection). A streamed response's status line is sent with its first event, so a refusal that
comes before any token is still a plain HTTP error with its status; one after it is the API's
in-stream error event. A client that goes away cancels its stream (``RequestPath.cancel``).
"""

from __future__ import annotations

import logging
import time

from gateway.http import anthropic, openai
from gateway.http.errors import HttpError, stream_error_event
from gateway.http.reply import Ending, Reply
from gateway.http.routes import (
    CHAT,
    COMPLETION,
    COUNT_TOKENS,
    MESSAGES,
    MODEL,
    MODEL_PREFIX,
    MODELS,
    api_key,
    route,
)
from gateway.http.server import HttpConnection, Incoming
from gateway.ops.logging import REQUEST_LOG
from gateway.protocol import ErrorCode

log = logging.getLogger("zerolayer.http")

_perf = time.perf_counter


class Exchange:
    """One API request on its way through the path: where to write, and what was written."""

    __slots__ = ("conn", "request", "reply", "stream", "started", "parts", "ended", "status")

    def __init__(self, conn: HttpConnection, request: Incoming, reply: Reply) -> None:
        self.conn = conn
        self.request = request
        self.reply = reply
        self.stream: object = None  # the path's stream
        self.started = False  # the streamed response's head and first events are written
        self.parts: list[str] = []  # the text so far (non-streaming)
        self.ended = False
        self.status = 200


class HttpDoor:
    """The App of the HTTP listener, and a door of the request path."""

    api_names = ("openai", "anthropic")

    def __init__(self, path, model: str, max_context: int, created: int | None = None) -> None:
        self.path = path
        self.model = model
        self.max_context = max_context
        self.created = created if created is not None else int(time.time())
        self._models = openai.models_body(model, self.created)
        self._model = openai.model_body(model, self.created)
        self._dirty: list[HttpConnection] = []
        self.log_requests = REQUEST_LOG.isEnabledFor(logging.INFO)

    # ------------------------------------------------------------------ App: requests in

    def handle(self, conn: HttpConnection, request: Incoming) -> None:
        endpoint = route(request)
        if endpoint == MODELS:
            conn.respond(200, self._models)
            return
        if endpoint == MODEL:
            name = request.path[len(MODEL_PREFIX) :].rstrip(b"/").decode("utf-8", "replace")
            if name != self.model:
                raise HttpError(404, f"the model {name!r} does not exist", code="model_not_found")
            conn.respond(200, self._model)
            return
        principal = self._authenticate(request)
        body = bytes(request.body)
        if endpoint == COUNT_TOKENS:
            req = anthropic.parse_count_tokens(body, self.model)
            n = self.path.count_prompt_tokens(req)
            conn.respond(200, anthropic.count_tokens_body(n))
            return
        if endpoint == CHAT:
            reply: Reply = openai.parse_chat(body, self.model, self.max_context)
        elif endpoint == COMPLETION:
            reply = openai.parse_completion(body, self.model, self.max_context)
        else:
            assert endpoint == MESSAGES
            reply = anthropic.parse_messages(body, self.model)
        ex = Exchange(conn, request, reply)
        request.state = ex
        ex.stream = self.path.open(self, ex, principal, reply.req, reply.api)

    def _authenticate(self, request: Incoming):
        try:
            return self.path.authenticate(api_key(request))
        except HttpError:
            raise
        except Exception as exc:  # HookError: the same refusal as on the frame port
            code = getattr(exc, "code", None)
            if code is None:
                raise
            raise HttpError.from_code(code, exc.message, exc.retry_after_ms) from None

    def disconnected(self, conn: HttpConnection, request: Incoming) -> None:
        ex = request.state
        if isinstance(ex, Exchange) and not ex.ended:
            ex.ended = True
            self.path.cancel(ex.stream)

    def slow(self, conn: HttpConnection, request: Incoming) -> None:
        ex = request.state
        if isinstance(ex, Exchange) and not ex.ended:
            self._end_with_error(
                ex, ErrorCode.SLOW_CONSUMER, "client is not reading its output", 0
            )
            self.path.cancel(ex.stream)

    # ------------------------------------------------------------------ door: outputs

    def write_token(self, ex: Exchange, token: int, text: str) -> None:
        if ex.ended or not text:
            return
        reply = ex.reply
        if not reply.stream:
            ex.parts.append(text)
            return
        conn = ex.conn
        if not ex.started:
            self._start(ex)
        reply.token(conn.out, text)
        if not conn.dirty:
            conn.dirty = True
            self._dirty.append(conn)

    def _start(self, ex: Exchange) -> None:
        ex.started = True
        ex.conn.start_stream()
        ex.reply.start(ex.conn.out, self.path.prompt_tokens(ex.stream))

    def write_done(self, ex: Exchange, ending: Ending) -> None:
        if ex.ended:
            return
        ex.ended = True
        conn, reply = ex.conn, ex.reply
        if reply.stream:
            if not ex.started:
                self._start(ex)
            reply.end(conn.out, ending)
            conn.end_stream()
        else:
            conn.respond(200, reply.body("".join(ex.parts), ending))
        self._dirtied(conn)
        if self.log_requests:
            self._log(ex, ending=ending)

    def write_error(self, ex: Exchange, code: int, message: str, retry_after_ms: int) -> None:
        if ex.ended:
            return
        self._end_with_error(ex, code, message, retry_after_ms)

    def _end_with_error(self, ex: Exchange, code: int, message: str, retry_after_ms: int) -> None:
        ex.ended = True
        conn = ex.conn
        err = HttpError.from_code(code, message, retry_after_ms)
        if ex.started:
            conn.out += stream_error_event(ex.reply.api, err)
            conn.end_stream()
        else:
            conn.respond_error(err)
        ex.status = err.status
        self._dirtied(conn)
        if self.log_requests or code == ErrorCode.INTERNAL:
            self._log(ex, error=err)

    def _dirtied(self, conn: HttpConnection) -> None:
        if not conn.dirty:
            conn.dirty = True
            self._dirty.append(conn)

    def flush(self) -> None:
        dirty, self._dirty = self._dirty, []
        for conn in dirty:
            conn.dirty = False
            conn.flush()

    def _log(self, ex: Exchange, ending: Ending | None = None, error: HttpError | None = None):
        request = ex.request
        fields = {
            "api": ex.reply.api,
            "method": request.method.decode("latin-1"),
            "path": request.path.decode("utf-8", "replace"),
            "status": ex.status,
            "stream": ex.reply.stream,
            "total_ms": round((_perf() - request.t_recv) * 1000, 3),
        }
        if ending is not None:
            fields["prompt_tokens"] = ending.prompt_tokens
            fields["completion_tokens"] = ending.completion_tokens
            REQUEST_LOG.info("http request", extra=fields)
        elif error is not None:
            fields["detail"] = error.message
            REQUEST_LOG.warning("http request refused", extra=fields)
