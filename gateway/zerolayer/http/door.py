"""The HTTP door: each HTTP connection is a door of the shared request path
(zerolayer.request_path.lifecycle).

For each request: route it (routes.py), check its key (``RequestPath.authenticate``; not for
the ``KEYLESS`` listings), then dispatch on its endpoint through two tables: ``LOCAL`` answers
without the engine (the model listings, counting tokens; a large input's work off the loop,
zerolayer.request_path.offload), ``PARSERS`` parse the body into a Request and a Reply
(openai.py / anthropic.py, one row per endpoint), opened as one Stream with text deltas, or
into the answer itself when the body asks for nothing the engine does (Ollama's load request,
an empty embed). A
routed endpoint in neither table is not served yet: 404. The path validates, tokenizes, runs
the hooks and submits to the engine; its refusals come back through this door's
``write_done`` / ``write_error``, the engine's text through its encoder (``TextDeltas``), and
each connection is flushed once per delivery. A streamed response's status line goes out with
its first event, so a refusal that comes before any token is a plain HTTP error with its own
status (what the SDKs turn into their exception types); one after it is the API's in-stream
error event. A client that goes away cancels its stream (``RequestPath.cancel``): its slot is
freed at the next engine step.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import TypeAlias

from zerolayer.codes import Cached, ErrorCode, FinishReason, Refusal
from zerolayer.engine.backend import ModelInfo
from zerolayer.engine.step import StepOutput
from zerolayer.hooks import Principal
from zerolayer.http import anthropic, embeddings, ollama, openai, responses, tokenize
from zerolayer.http.errors import HttpError, http_error, stream_error_event
from zerolayer.http.logprobs import TokenLogprobs, TokenStrings
from zerolayer.http.reply import Ending, Reply
from zerolayer.http.routes import (
    CACHE_HIT_HEADER,
    CHAT,
    COMPLETION,
    COUNT_TOKENS,
    DETOKENIZE,
    EMBEDDINGS,
    KEYLESS,
    MESSAGES,
    MODEL,
    MODEL_PREFIX,
    MODELS,
    OLLAMA_CHAT,
    OLLAMA_EMBED,
    OLLAMA_EMBEDDINGS,
    OLLAMA_GENERATE,
    OLLAMA_MANAGE,
    OLLAMA_PS,
    OLLAMA_SHOW,
    OLLAMA_TAGS,
    OLLAMA_VERSION,
    OPS,
    RESPONSES,
    TOKENIZE,
    OpsPages,
    api_of,
    credentials,
    route,
    version,
    wants_cache,
)
from zerolayer.http.server import HttpConnection, HttpServer, Incoming
from zerolayer.ops.logging import REQUEST_LOG
from zerolayer.request_path import offload
from zerolayer.request_path.lifecycle import RequestPath
from zerolayer.request_path.stream import Stream

log = logging.getLogger("zerolayer.http")

_perf = time.perf_counter


class HttpApi:
    """What every HTTP connection shares: the request path, the model, prebuilt bodies."""

    def __init__(self, path: RequestPath, info: ModelInfo, ops: OpsPages | None = None) -> None:
        self.path = path
        # /health, /metrics, /version, the status page, CORS (routes.py)
        self.ops = ops or OpsPages(None, None)
        self.model = info.name
        self.strings = TokenStrings(path.inputs.tokenizer)  # logprobs' token texts
        created = int(time.time())
        self.models_body = openai.models_body(self.model, created)
        self.model_body = openai.model_body(self.model, created)
        self.ollama = ollama.OllamaModel(
            self.model, info.max_context, version(), embeds=info.hidden_size > 0
        )
        self.log_requests = REQUEST_LOG.isEnabledFor(logging.INFO)

    def connection(self, server: HttpServer) -> ApiConnection:
        return ApiConnection(server, self)


class Exchange:
    """The door's per-request data (``Stream.state``, the same object for the n choice streams
    of a request)."""

    __slots__ = ("request", "reply", "stream", "started", "cached", "answered", "live")

    def __init__(self, request: Incoming, reply: Reply) -> None:
        self.request = request
        self.reply = reply
        self.stream = reply.stream
        self.started = False  # the streamed response's head and first events are written
        self.cached = False  # replayed from the response cache (write_cached)
        self.answered = False  # the response ended (every choice done, or an error)
        self.live = reply.req.n  # choice streams not ended yet


def _choices(st: Stream) -> tuple[Stream, ...]:
    """The request's choice streams (``st`` alone when n == 1)."""
    return st.group or (st,)


def _exchange(st: Stream) -> Exchange:
    """The request's Exchange, whichever of its choice streams ``st`` is (the door sets it on
    choice 0, the stream it opens; the path makes the others)."""
    # Stream.state is each door's own; this door sets only Exchanges.
    return (st.group[0] if st.group else st).state  # type: ignore[return-value]


class ApiConnection(HttpConnection):
    """One HTTP connection: the OpenAI / Anthropic endpoints, and a Door of the request path."""

    encoder: Callable[[list[Stream], list[int]], TextDeltas]  # Door.encoder (set below)

    def __init__(self, server: HttpServer, api: HttpApi) -> None:
        super().__init__(server)
        self.api = api
        self.path = api.path
        self.label = f"http{self.conn_id}"
        self.st: Stream | None = None  # the stream of the active request, while it runs
        self._keys = 0

    @property
    def open(self) -> bool:  # Door: False once the peer is gone
        return self.transport is not None

    # ------------------------------------------------------------------ requests in

    def api_of(self, path: bytes) -> str:
        return api_of(path)

    def handle(self, request: Incoming) -> None:
        try:
            try:
                self._handle(request)
            except Refusal as refusal:  # validation, a hook: through the one table
                raise http_error(refusal) from None
        except HttpError as err:  # refused before the request path: answered by the shell
            if self.api.log_requests:
                self._log(request, request.api, err.status, detail=err.message)
            raise

    def _handle(self, request: Incoming) -> None:
        api = self.api
        ops = api.ops
        self.extra_head = ops.cors(request)
        if request.method == b"OPTIONS":
            self.respond(*ops.preflight(request))
            return
        endpoint = route(request)
        if endpoint in OPS:
            self.respond(*ops.answer(endpoint))
            return
        if endpoint in KEYLESS:
            self._answer(request, endpoint)
            return
        if self.path.draining:
            self.close_after = True
            raise HttpError.from_code(ErrorCode.SHUTTING_DOWN, "server is draining")
        principal = self._authenticate(request)
        if endpoint in LOCAL:
            self._answer(request, endpoint)
            return
        parser = PARSERS.get(endpoint)
        if parser is None:
            raise _not_served(request)
        reply = parser(bytes(request.body), api)
        if isinstance(reply, bytes):  # nothing for the engine to do: the answer
            self.respond(200, reply)
            return
        reply.req.use_cache = wants_cache(request)
        self._keys += 1
        st = Stream(self, self._keys, reply.api, want_text=True)
        st.state = Exchange(request, reply)
        self.st = st
        self.path.open(st, principal, reply.req)

    def _authenticate(self, request: Incoming) -> Principal:
        return self.path.authenticate(credentials(request))  # a Refusal: handle maps it

    def _answer(self, request: Incoming, endpoint: str) -> None:
        """Answer a LOCAL endpoint: its body now, or the body its deferred work makes off the
        loop (the request stays the active one until then)."""
        local = LOCAL.get(endpoint)
        if local is None:
            raise _not_served(request)
        answer = local(self.api, request)
        if isinstance(answer, bytes):
            self.respond(200, answer)
            return
        done = offload.run(answer)
        done.add_done_callback(lambda fut: self._answered(request, fut))

    def _answered(self, request: Incoming, fut: asyncio.Future[bytes]) -> None:
        """The deferred answer of ``request`` is ready: send it, unless its client left."""
        if not self.open or self.active is not request or fut.cancelled():
            return
        exc = fut.exception()
        if exc is None:
            self.respond(200, fut.result())
        elif isinstance(exc, Refusal):
            self.respond_error(http_error(refusal=exc))
        elif isinstance(exc, HttpError):
            self.respond_error(exc)
        else:
            log.error("answering %r failed", request.path, exc_info=exc)
            self.respond_error(HttpError.from_code(ErrorCode.INTERNAL, "answering failed"))
        self.flush()

    def disconnected(self, request: Incoming) -> None:
        st = self.st
        if st is not None and st.state is not None and _exchange(st).request is request:
            for choice in _choices(st):
                self.path.cancel(choice)  # nothing is written: the door is closed

    def slow_stream(self, request: Incoming) -> None:
        st = self.st
        if st is not None:
            for choice in _choices(st):
                slow = Refusal(ErrorCode.SLOW_CONSUMER, "client is not reading its output")
                self.path.fail(choice, slow)

    def abort_active(self) -> None:
        st = self.st
        if st is not None:
            for choice in _choices(st):
                self.path.fail(choice, Refusal(ErrorCode.SHUTTING_DOWN, "drain deadline passed"))
            self.flush()

    # ------------------------------------------------------------------ Door: outputs

    def write_text(self, st: Stream, text: str, lp: TokenLogprobs | None = None) -> None:
        """A text delta of choice ``st`` (and its token's logprobs when asked): an event, or a
        part of the whole body."""
        ex = _exchange(st)
        if ex.answered:
            return
        if not ex.stream:
            ex.reply.collect(st.choice, text, lp)
            return
        if not ex.started:
            self._start(st, ex)
        ex.reply.write(self.out, st.choice, text, lp)

    def write_cached(self, st: Stream, ids: list[int], text: str) -> int:
        _exchange(st).cached = True
        if text:
            self.write_text(st, text)
        return 0  # TOKEN frames written (for the frame metrics): none

    def _start(self, st: Stream, ex: Exchange) -> None:
        ex.started = True
        extra = CACHE_HIT_HEADER if ex.cached else b""
        self.start_stream(ex.reply.stream_type, extra=extra)
        _prompt_outputs(st, ex.reply)
        ex.reply.start(self.out, st.prompt_tokens)

    def write_done(
        self, st: Stream, finish: FinishReason, timings: tuple[float, float, float]
    ) -> None:
        ex = _exchange(st)
        if ex.answered:  # a sibling choice failed: the response already ended
            return
        matched = st.seq.matched_stop if st.seq is not None and not st.from_cache else None
        cached = bool(st.cache_bits & Cached.PROMPT)
        ending = Ending(int(finish), st.prompt_tokens, st.n_ids, cached, matched, timings)
        reply = ex.reply
        _prompt_outputs(st, reply)
        last = reply.finish(st.choice, ending)
        if ex.stream:
            if not ex.started:
                self._start(st, ex)
            reply.end(self.out, st.choice)
            if not last:
                return
            reply.tail(self.out)
            self.end_stream(advance=False)
        else:
            if not last:
                return
            extra = CACHE_HIT_HEADER if ex.cached else b""
            self.respond(200, reply.body(), extra=extra, advance=False)
        ex.answered = True
        if self.api.log_requests:
            self._log(ex.request, st.api, 200, st, reply.total(), timings)

    def write_error(self, st: Stream, error: Refusal) -> None:
        ex = _exchange(st)
        if ex.answered:
            return
        ex.answered = True
        err = ex.reply.named(http_error(error))  # the field the Refusal names, as the API says
        if ex.started:
            event = ex.reply.error_event(err)
            self.out += event if event is not None else stream_error_event(ex.reply.api, err)
            self.end_stream(advance=False)
        else:
            self.respond_error(err, advance=False, counted=True)
        if self.api.log_requests:
            self._log(ex.request, st.api, err.status, st, detail=error.message)
        for other in _choices(st):  # the answer is this error: the other choices stop
            if other is not st:
                self.path.cancel(other)

    def stream_ended(self, st: Stream) -> None:
        ex = _exchange(st)
        ex.live -= 1
        if ex.live == 0 and self.st is not None and self.st.state is ex:
            self.st = None
            self.advance()  # the next pipelined request, if any
            if not self.closing:
                self.flush()  # the ending's bytes (the output processor may not flush us)

    # ------------------------------------------------------------------ access log

    def _log(
        self,
        request: Incoming,
        api: str,
        status: int,
        st: Stream | None = None,
        ending: Ending | None = None,
        timings: tuple[float, float, float] | None = None,
        detail: str = "",
    ) -> None:
        """The access log line of one request (governed by ``logging.requests``)."""
        fields: dict[str, object] = {
            "request_id": f"{self.label}:{st.key if st is not None else 0}",
            "api": api,
            "method": request.method.decode("latin-1"),
            "path": request.path.decode("utf-8", "replace"),
            "status": status,
        }
        if st is not None:
            fields["stream"] = _exchange(st).stream
        if ending is not None and timings is not None:
            fields.update(
                finish=FinishReason(ending.finish).label,
                prompt_tokens=ending.prompt_tokens,
                completion_tokens=ending.completion_tokens,
                ttft_ms=round(timings[1] * 1000, 3),
                total_ms=round(timings[2] * 1000, 3),
            )
            REQUEST_LOG.info("http request", extra=fields)
        else:
            fields["detail"] = detail
            REQUEST_LOG.info("http request refused", extra=fields)


class TextDeltas:
    """The HTTP door's encoder (``ApiConnection.encoder``) for its streams in one engine row
    set: their text deltas, with each token's logprobs for the streams that asked. (A token
    whose bytes end mid-character has no text yet: it comes with a later one.)"""

    __slots__ = ("rows", "doors")

    def __init__(self, streams: list[Stream], rows: list[int]) -> None:
        self.rows = list(zip(rows, streams, strict=True))
        self.doors = [st.door for st in streams]

    def write(self, step: StepOutput) -> int:
        text = step.text
        logprobs = step.logprobs
        for i, st in self.rows:
            delta = text.get(i)
            lp = logprobs.get(i) if logprobs else None
            if lp is not None:
                item = TokenLogprobs(int(step.tokens[i]), lp)
                # Ignored (here, below): TextDeltas' streams are on ApiConnections (its encoder).
                st.door.write_text(st, delta or "", item)  # type: ignore[attr-defined]
            elif delta:
                st.door.write_text(st, delta)  # type: ignore[attr-defined]
        return 0  # TOKEN frames written: none


ApiConnection.encoder = TextDeltas

# The body of a LOCAL endpoint's answer made off the event loop (a large input's tokens).
Deferred: TypeAlias = Callable[[], bytes]


def _prompt_outputs(st: Stream, reply: Reply) -> None:
    """Give ``st``'s choice of ``reply`` its prompt's outputs when the request asked (read on the
    loop after the engine's step that completed the prompt was delivered; the other choices'
    were computed by choice 0's sequence)."""
    seq = st.seq
    if seq is None or st.from_cache or not (reply.req.echo or reply.req.embed):
        return
    prompted = seq.parent or seq
    out = reply.choices[st.choice]
    out.prompt_ids = prompted.prompt
    out.pooled = prompted.pooled
    out.prompt_logprobs = prompted.prompt_logprobs


def _not_served(request: Incoming) -> HttpError:
    """A routed endpoint whose answer is not in LOCAL or PARSERS (not served yet)."""
    shown = request.path.decode("utf-8", "replace")[:200]
    return HttpError(404, f"{shown} is not served yet", code="unknown_url")


def _models(api: HttpApi, request: Incoming) -> bytes:
    return api.models_body


def _model(api: HttpApi, request: Incoming) -> bytes:
    name = request.path[len(MODEL_PREFIX) :].rstrip(b"/").decode("utf-8", "replace")
    if name != api.model:
        raise HttpError(
            404, f"the model {name!r} does not exist", param="model", code="model_not_found"
        )
    return api.model_body


def _count_tokens(api: HttpApi, request: Incoming) -> bytes | Deferred:
    req = anthropic.parse_count_tokens(bytes(request.body), api.model)
    inputs = api.path.inputs
    if not inputs.offloaded(req):  # a Refusal: handle maps it
        return anthropic.count_tokens_body(inputs.count_prompt_tokens(req))
    # A large conversation is templated and tokenized off the loop, as a request's is.
    return lambda: anthropic.count_tokens_body(inputs.count_prompt_tokens(req))


def _tokenize(api: HttpApi, request: Incoming) -> bytes | Deferred:
    return tokenize.tokenize(bytes(request.body), api.model, api.path.inputs, api.strings)


def _detokenize(api: HttpApi, request: Incoming) -> bytes:
    return tokenize.detokenize(bytes(request.body), api.model, api.path.inputs)


# endpoint → its answer without the engine: the body, or the work that makes it off the loop
LOCAL: dict[str, Callable[[HttpApi, Incoming], bytes | Deferred]] = {
    MODELS: _models,
    MODEL: _model,
    COUNT_TOKENS: _count_tokens,
    TOKENIZE: _tokenize,
    DETOKENIZE: _detokenize,
    OLLAMA_VERSION: lambda api, request: api.ollama.version_body,
    OLLAMA_TAGS: lambda api, request: api.ollama.tags_body,
    OLLAMA_PS: lambda api, request: api.ollama.ps_body,
    OLLAMA_SHOW: lambda api, request: api.ollama.show(bytes(request.body)),
    OLLAMA_MANAGE: lambda api, request: api.ollama.manage(
        bytes(request.body), request.path.decode("utf-8", "replace")[:200]
    ),
}

# endpoint → the parser of its body into a Request and the Reply that answers it (or, when
# the request needs no engine, the answer's body)
PARSERS: dict[str, Callable[[bytes, HttpApi], Reply | bytes]] = {
    CHAT: lambda body, api: openai.parse_chat(body, api.model, api.strings),
    COMPLETION: lambda body, api: openai.parse_completion(body, api.model, api.strings),
    MESSAGES: lambda body, api: anthropic.parse_messages(body, api.model),
    EMBEDDINGS: lambda body, api: embeddings.parse_embeddings(
        body, api.model, api.path.inputs.info.hidden_size
    ),
    RESPONSES: lambda body, api: responses.parse_responses(body, api.model, api.strings),
    OLLAMA_CHAT: lambda body, api: ollama.parse_chat(body, api.ollama, api.strings),
    OLLAMA_GENERATE: lambda body, api: ollama.parse_generate(body, api.ollama, api.strings),
    OLLAMA_EMBED: lambda body, api: ollama.parse_embed(
        body, api.ollama, api.path.inputs.info.hidden_size
    ),
    OLLAMA_EMBEDDINGS: lambda body, api: ollama.parse_embeddings(body, api.ollama),
}
