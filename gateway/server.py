"""The frame-protocol server: one uvloop event loop, one BufferedProtocol per connection.

Owns the rules of docs/protocol.md that need state: HELLO/auth, stream ids, per-connection stream
limits, idle timeout, slow consumers, drain; and the one request path: validate and tokenize →
hook chain (auth, rate limit, response cache; fixed at start-up) → engine. Bytes arrive straight
into each connection's preallocated decoder buffer; the outputs of the engine steps waiting for
the loop are packed into each connection's reusable write buffer and written with one
``transport.write`` per connection. A columnar step (TokenColumn: the plain rows' tokens, one
each) is packed from per-connection arrays of TOKEN frames built once per row list (ColumnPlan).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import threading
import time
from collections.abc import Callable

import numpy as np

from gateway import protocol as p
from gateway.config import Settings
from gateway.engine.engine import (
    FINISH_ERROR,
    NO_TOKEN,
    NOT_FINISHED,
    Engine,
    EngineOverloaded,
    EngineStopped,
    Output,
    Sequence,
    TokenColumn,
)
from gateway.engine.types import SamplingRow
from gateway.hooks import CachedResponse, Chain, Completion, HookError, Principal, RequestContext
from gateway.ops.logging import REQUEST_LOG
from gateway.ops.metrics import Metrics
from gateway.ops.sockets import apply_socket_options
from gateway.prompts import PromptRegistry, split_prompt
from gateway.protocol import ErrorCode, FrameType, ProtocolError
from gateway.tokenizer import Detokenizer, Tokenizer
from gateway.wrong_door import SNIFF_BYTES

log = logging.getLogger("zerolayer.server")

_perf = time.perf_counter
_pack_token1 = p.TOKEN1_FRAME.pack_into  # (buf, offset, 8, TOKEN, 0, 0, stream, 1, 0, id)
_FINISH_NAMES = ("eos", "max_tokens", "stop", "cancelled")
_REPLAY_IDS_PER_FRAME = 256
MAX_PENDING_STEPS = 16  # steps the engine may run ahead of the loop before it waits
_TOKEN1_ID = p.TOKEN1_ID

Step = tuple[list[Output], TokenColumn | None]  # what the engine hands over per step


class StreamError(Exception):
    """A refusal of one stream (the connection goes on)."""

    def __init__(self, code: ErrorCode, message: str, retry_after_ms: int = 0) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.retry_after_ms = retry_after_ms


class Stream:
    """Server-side state of one request in flight."""

    __slots__ = (
        "conn",
        "stream_id",
        "seq",
        "ctx",
        "t_recv",
        "t_first",
        "n_ids",
        "prompt_tokens",
        "cache_bits",
        "want_text",
        "ended",
        "cancel_requested",
        "rec_ids",
        "rec_text",
        "full_ids",
    )

    def __init__(self, conn: Connection, stream_id: int, t_recv: float, want_text: bool) -> None:
        self.conn = conn
        self.stream_id = stream_id
        self.seq: Sequence | None = None
        self.ctx: RequestContext | None = None  # set when hooks run for this request
        self.t_recv = t_recv
        self.t_first = 0.0
        self.n_ids = 0
        self.prompt_tokens = 0
        self.cache_bits = 0
        self.want_text = want_text
        self.ended = False
        self.cancel_requested = False  # CANCEL arrived while async hooks were still running
        self.rec_ids: list[int] | None = None  # the stream, recorded for the response cache
        self.rec_text: list[str] | None = None
        self.full_ids: np.ndarray | None = None  # the whole prompt, precompiled prefix included


class ColumnPlan:
    """Turns the columnar steps of one engine row list into TOKEN frames; built once per list.

    Per connection: the TOKEN frames of its rows as an int32 [n, 5] array whose header words are
    fixed (p.token1_frames), so a step writes only its ids into it and copies its bytes into the
    connection's write buffer. The rows' streams are not touched per step: ``settle`` adds the
    steps to their counters (and recordings) before anything reads them.
    """

    __slots__ = ("owners", "epoch", "groups", "streams", "recording", "held", "steps")

    def __init__(self, owners: list[object], epoch: int) -> None:
        self.owners = owners  # the engine's list: the plan is valid while it is the same object
        self.epoch = epoch  # Server.stream_epoch when built: no stream has ended since
        rows_by_conn: dict[Connection, list[int]] = {}
        self.streams: list[Stream] = []
        self.recording: list[tuple[int, Stream]] = []
        now = _perf()
        for i, st in enumerate(owners):
            assert isinstance(st, Stream)
            if st.ended:
                continue
            rows_by_conn.setdefault(st.conn, []).append(i)
            self.streams.append(st)
            if st.rec_ids is not None:
                self.recording.append((i, st))
            if not st.t_first:  # not reached: a stream's first token comes from its prefill
                st.t_first = now
        self.groups: list[tuple[Connection, np.ndarray | None, np.ndarray]] = []
        for conn, rows in rows_by_conn.items():
            frames = p.token1_frames(np.array([owners[i].stream_id for i in rows]))  # type: ignore[attr-defined]
            index = None if len(rows) == len(owners) else np.array(rows, np.intp)
            self.groups.append((conn, index, frames))
        self.held: list[np.ndarray] = []  # the steps' ids since the last settle, when recording
        self.steps = 0  # steps written since the last settle

    def write(self, tokens: np.ndarray, dirty: list[Connection]) -> int:
        """Pack one step's ids; returns the TOKEN frames written."""
        for conn, index, frames in self.groups:
            frames[:, _TOKEN1_ID] = tokens if index is None else tokens[index]
            off = conn._out_len
            end = off + frames.nbytes
            if end > len(conn._out):
                conn._reserve(frames.nbytes)
            conn._out[off:end] = frames.data
            conn._out_len = end
            if not conn.dirty:
                conn.dirty = True
                dirty.append(conn)
        self.steps += 1
        if self.recording:
            self.held.append(tokens)
        return len(self.streams)

    def settle(self) -> None:
        """Bring the streams' token counts and response-cache recordings up to date."""
        k = self.steps
        if not k:
            return
        self.steps = 0
        for st in self.streams:
            st.n_ids += k
        if self.recording:
            ids = np.stack(self.held)  # [k, rows]
            self.held = []
            for i, st in self.recording:
                st.rec_ids.extend(ids[:, i].tolist())  # type: ignore[union-attr]


class Server:
    """Accepts connections and routes engine outputs to them. Lives on the event loop thread."""

    def __init__(
        self,
        settings: Settings,
        engine: Engine,
        tokenizer: Tokenizer,
        chain: Chain,
        metrics: Metrics,
        prompts: PromptRegistry | None = None,
    ) -> None:
        self.settings = settings
        self.prompts = prompts
        self.cfg = settings.server
        self.engine = engine
        self.tokenizer = tokenizer
        self.chain = chain
        self.metrics = metrics
        self.info = engine.backend.info
        self.vocab_size = self.info.vocab_size
        self.connections: set[Connection] = set()
        self.draining = False
        self.loop: asyncio.AbstractEventLoop | None = None
        self._server: asyncio.AbstractServer | None = None
        self._sweeper: asyncio.Task | None = None
        self._all_closed = asyncio.Event()
        self._handoff = threading.Condition()
        self._pending: list[Step] = []  # engine steps waiting for the loop
        self._plan: ColumnPlan | None = None  # for the engine's current columnar rows
        # Bumped whenever a stream ends (DONE, connection closed, slow consumer, drain deadline):
        # a ColumnPlan built before then may hold an ended stream, and is rebuilt.
        self.stream_epoch = 0
        self._conn_ids = itertools.count(1)
        self.hook_tasks: set[asyncio.Task] = set()  # async on_request hooks in flight
        self.welcome = p.encode_welcome(
            self.cfg.max_frame_bytes,
            self.cfg.max_streams_per_connection,
            self.info.vocab_size,
            self.info.eos_token_id,
            self.info.max_context,
            self.info.name,
        )
        self.per_request_hooks = chain.per_request
        self.hooks_async = chain.is_async
        self.records = chain.records
        # first bytes -> the reply to a client at the wrong door (gateway.wrong_door), or None
        self.wrong_door: Callable[[bytes], bytes | None] | None = None
        self.log_requests = REQUEST_LOG.isEnabledFor(logging.INFO)
        m = metrics
        self._m_tokens_out = m.frames_out_token
        self._m_done_out = m.frames_out_done
        self._m_bytes_out = m.bytes_out
        self._m_bytes_in = m.bytes_in

    # ------------------------------------------------------------------ lifecycle

    async def start(self, sock=None) -> None:
        self.loop = asyncio.get_running_loop()
        if sock is None:
            self._server = await self.loop.create_server(
                lambda: Connection(self),
                self.cfg.host,
                self.cfg.port,
                backlog=self.cfg.backlog,
                reuse_address=True,
                reuse_port=self.cfg.reuse_port or None,
            )
        else:
            self._server = await self.loop.create_server(
                lambda: Connection(self), sock=sock, backlog=self.cfg.backlog
            )
        self._sweeper = self.loop.create_task(self._sweep_idle())

    @property
    def port(self) -> int:
        assert self._server is not None
        return self._server.sockets[0].getsockname()[1]

    def next_conn_id(self) -> int:
        return next(self._conn_ids)

    def deliver_threadsafe(self, outputs: list[Output], column: TokenColumn | None) -> None:
        """The engine's deliver callback, on the engine thread: at most one hand-off to the loop
        per step. Steps that finish while a hand-off is still waiting for the loop join it
        instead of waking the loop again, so the engine never waits for the loop unless more
        than MAX_PENDING_STEPS steps are waiting (then it is slowed to the loop's pace rather
        than queueing outputs without bound)."""
        assert self.loop is not None
        with self._handoff:
            self._pending.append((outputs, column))
            wake = len(self._pending) == 1
            if len(self._pending) > MAX_PENDING_STEPS:
                self._handoff.wait(timeout=5.0)
        if wake:
            try:
                self.loop.call_soon_threadsafe(self._deliver_pending)
            except RuntimeError:  # the loop is closed: shutting down, nobody to deliver to
                with self._handoff:
                    self._pending.clear()

    def _deliver_pending(self) -> None:
        with self._handoff:
            steps, self._pending = self._pending, []
            self._handoff.notify_all()
        self.deliver(steps)

    async def drain(self) -> None:
        """Stop accepting, GOAWAY everyone, finish streams in flight up to drain_timeout_s."""
        if self.draining:
            return
        self.draining = True
        log.info("draining: %d connections", len(self.connections))
        if self._server is not None:
            self._server.close()
        for conn in list(self.connections):
            conn.goaway("server is draining")
        if self.connections:
            self._all_closed.clear()
            try:
                await asyncio.wait_for(self._all_closed.wait(), self.cfg.drain_timeout_s)
            except asyncio.TimeoutError:
                log.warning("drain deadline passed; ending %d connections", len(self.connections))
        for conn in list(self.connections):
            conn.end_all_streams(ErrorCode.SHUTTING_DOWN, "drain deadline passed")
            conn.close()
        if self._sweeper is not None:
            self._sweeper.cancel()

    def connection_gone(self, conn: Connection) -> None:
        if conn in self.connections:
            self.connections.discard(conn)
            self.metrics.connection_closed()
        if not self.connections:
            self._all_closed.set()

    async def _sweep_idle(self) -> None:
        timeout = self.cfg.idle_timeout_s
        interval = min(1.0, timeout / 4)
        engine, metrics = self.engine, self.metrics
        slots = engine.backend.num_slots
        while True:
            await asyncio.sleep(interval)
            metrics.set_queue(engine.running, engine.waiting, engine.slots_used, slots)
            now = time.monotonic()
            for conn in list(self.connections):
                if not conn.streams and now - conn.last_activity > timeout:
                    conn.connection_error(
                        ErrorCode.IDLE_TIMEOUT, f"no frame for {timeout:g} s with no stream open"
                    )

    # ------------------------------------------------------------------ engine outputs

    def deliver(self, steps: list[Step]) -> None:
        """Write engine steps' outputs, in order: TOKEN/DONE frames, one write per connection."""
        dirty: list[Connection] = []
        n_frames = 0
        for outputs, column in steps:
            if outputs:
                n_frames += self._deliver_outputs(outputs, dirty)
            if column is not None:
                plan = self._plan
                if (
                    plan is None
                    or plan.owners is not column.owners
                    or plan.epoch != self.stream_epoch
                ):
                    if plan is not None:
                        plan.settle()
                    self._plan = plan = ColumnPlan(column.owners, self.stream_epoch)
                n_frames += plan.write(column.tokens, dirty)
        for conn in dirty:
            conn.flush()
        if n_frames:
            self._m_tokens_out.inc(n_frames)

    def settle_columns(self) -> None:
        """Make every stream's n_ids and rec_ids complete (columnar steps count lazily)."""
        if self._plan is not None:
            self._plan.settle()

    def _deliver_outputs(self, outputs: list[Output], dirty: list[Connection]) -> int:
        """Pack one step's Outputs; returns the TOKEN frames packed."""
        if self._plan is not None:
            self._plan.settle()  # earlier columnar ids go first in recordings; DONE counts them
        pack1 = _pack_token1
        n_tokens = 0
        for st, token, text, finish, t_admit in outputs:
            if st.ended:  # type: ignore[attr-defined]
                continue
            conn = st.conn  # type: ignore[attr-defined]
            if st.rec_ids is not None:  # type: ignore[attr-defined]
                if token != NO_TOKEN:
                    st.rec_ids.append(token)  # type: ignore[attr-defined]
                if st.rec_text is not None:  # type: ignore[attr-defined]
                    st.rec_text.append(text)  # type: ignore[attr-defined]
            if token != NO_TOKEN and not (text and st.want_text):  # type: ignore[attr-defined]
                # The common case, inlined: one id, no text, straight into the write buffer.
                off = conn._out_len
                if off + 20 > len(conn._out):
                    conn._reserve(20)
                pack1(conn._out, off, 8, 2, 0, 0, st.stream_id, 1, 0, token)  # type: ignore[attr-defined]
                conn._out_len = off + 20
                st.n_ids += 1  # type: ignore[attr-defined]
                n_tokens += 1
                if not st.t_first:  # type: ignore[attr-defined]
                    st.t_first = _perf()  # type: ignore[attr-defined]
            elif token != NO_TOKEN or text:
                n_tokens += conn.queue_token(st, token, text)  # type: ignore[arg-type]
            if finish != NOT_FINISHED:
                conn.finish_stream(st, finish, t_admit)  # type: ignore[arg-type]
            if not conn.dirty:
                conn.dirty = True
                dirty.append(conn)
        return n_tokens

    # ------------------------------------------------------------------ requests

    def build_sequence(self, st: Stream, req: p.Request) -> Sequence:
        """Validate and tokenize a request into an engine Sequence; raises StreamError."""
        tok = self.tokenizer
        compiled = None
        system = req.system
        if req.prompt_id:
            compiled = self.prompts.by_id(req.prompt_id) if self.prompts is not None else None
            if compiled is None:
                self.metrics.prefix_query(False)
                raise StreamError(
                    ErrorCode.UNKNOWN_PROMPT, f"no precompiled prompt {req.prompt_id}"
                )
            if system is not None and system != compiled.text:
                raise StreamError(
                    ErrorCode.INVALID_REQUEST,
                    f"system differs from the text of prompt {req.prompt_id}; send one of them",
                )
            system = compiled.text
        elif system and self.prompts is not None:
            compiled = self.prompts.by_system(system)  # O(1), by a digest of the exact text
        # The full prompt ids, exactly as without the registry; the prefix is split off below.
        if req.prompt_ids is not None:
            ids = req.prompt_ids
            if len(ids) and (int(ids.min()) < 0 or int(ids.max()) >= self.vocab_size):
                raise StreamError(
                    ErrorCode.INVALID_REQUEST,
                    f"prompt token id outside the vocabulary [0, {self.vocab_size})",
                )
            if compiled is not None:
                ids = np.concatenate((compiled.ids, ids))
        else:
            if req.messages is not None:
                text = tok.render_chat(req.messages, system)
            elif system:
                text = tok.render_system(system) + (req.prompt_text or "")
            else:
                text = req.prompt_text or ""
            ids = tok.encode_prompt(text)
        st.full_ids = ids
        prompt, prefix, prefix_len = ids, None, 0
        if compiled is not None:
            # Reuse the prefix only when the ids extend it token for token; else prefill inline.
            rest = split_prompt(compiled, ids)
            if rest is not None:
                prompt, prefix, prefix_len = rest, compiled.prefix, compiled.prefix_len
                st.cache_bits |= p.CACHE_PROMPT
            self.metrics.prefix_query(rest is not None)
        if len(req.stop_ids) and (
            int(req.stop_ids.min()) < 0 or int(req.stop_ids.max()) >= self.vocab_size
        ):
            raise StreamError(
                ErrorCode.INVALID_REQUEST,
                f"stop token id outside the vocabulary [0, {self.vocab_size})",
            )
        total = len(ids) + req.max_tokens
        if total > self.info.max_context:
            raise StreamError(
                ErrorCode.PROMPT_TOO_LONG,
                f"prompt ({len(ids)} tokens) + max_tokens ({req.max_tokens}) exceeds "
                f"max_context {self.info.max_context}",
            )
        st.prompt_tokens = len(ids)
        sampling = SamplingRow(
            temperature=req.temperature,
            top_p=req.top_p,
            top_k=req.top_k,
            seed=req.seed or 0,
            seeded=req.seed is not None,
        )
        # Deterministic requests are recorded when a hook caches responses: their ids, and the
        # text deltas when the engine produces them anyway; otherwise the text is decoded once
        # at DONE rather than per token.
        detok = Detokenizer(tok) if (req.want_text or req.stop_sequences) else None
        if self.records and (req.temperature == 0 or req.seed is not None):
            st.rec_ids = []
            st.rec_text = [] if detok is not None else None
        return Sequence(
            owner=st,
            prompt=np.ascontiguousarray(prompt, dtype=np.int32),
            max_tokens=req.max_tokens,
            sampling=sampling,
            stop_ids=frozenset(req.stop_ids.tolist()),
            stop_sequences=req.stop_sequences,
            detokenizer=detok,
            prefix=prefix,
            prefix_len=prefix_len,
        )

    def context(self, principal: Principal, req: p.Request, seq: Sequence) -> RequestContext:
        return RequestContext(
            principal=principal,
            model=self.info.name,
            prompt_ids=seq.owner.full_ids,  # type: ignore[attr-defined]  # with the prefix
            prompt_id=req.prompt_id,
            max_tokens=req.max_tokens,
            temperature=req.temperature,
            top_p=req.top_p,
            top_k=req.top_k,
            seed=req.seed,
            stop_ids=tuple(sorted(seq.stop_ids)),
            stop_sequences=req.stop_sequences,
            want_text=req.want_text,
        )


class Connection(asyncio.BufferedProtocol):
    """One client connection: decodes frames in place, writes one buffer per step."""

    def __init__(self, server: Server) -> None:
        self.server = server
        cfg = server.cfg
        self.cfg = cfg
        self.conn_id = server.next_conn_id()
        self.decoder = p.FrameDecoder("server", cfg.max_frame_bytes, cfg.read_buffer_bytes)
        self.streams: dict[int, Stream] = {}
        self.transport: asyncio.Transport | None = None
        self.first_frame = True
        self.principal: Principal | None = (
            None if server.chain.auth_required else (server.chain.anonymous())
        )
        self.closing = False
        self.slow = False
        self.dirty = False
        self.last_activity = time.monotonic()
        self._out = bytearray(16384)
        self._out_len = 0

    # ------------------------------------------------------------------ transport callbacks

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        server = self.server
        server.connections.add(self)
        server.metrics.connection_opened()
        sock = transport.get_extra_info("socket")
        if sock is not None:
            apply_socket_options(sock, self.cfg)
        transport.set_write_buffer_limits(high=self.cfg.write_buffer_limit_bytes)  # type: ignore[attr-defined]
        if len(server.connections) > self.cfg.max_connections:
            self.connection_error(ErrorCode.OVERLOADED, "too many connections", retry_after_ms=1000)
        elif server.draining:
            self.goaway("server is draining")

    def get_buffer(self, sizehint: int) -> memoryview:
        return self.decoder.get_buffer(sizehint)

    def buffer_updated(self, nbytes: int) -> None:
        if self.closing:
            return
        if self.first_frame and not self.decoder.buffered and self.server.wrong_door is not None:
            # The connection's first bytes, at the buffer's start: HTTP or TLS gets its answer.
            reply = self.server.wrong_door(
                bytes(self.decoder.get_buffer()[: min(nbytes, SNIFF_BYTES)])
            )
            if reply is not None and self.transport is not None:
                self.transport.write(reply)
                self.close()
                return
        self.decoder.advance(nbytes)
        self.server._m_bytes_in.inc(nbytes)
        self.last_activity = time.monotonic()
        try:
            while (frame := self.decoder.next_frame()) is not None:
                self._on_frame(*frame)
                if self.closing:
                    break
        except ProtocolError as exc:
            self.connection_error(exc.code, exc.message)
        except Exception:
            log.exception("internal error handling a frame")
            self.connection_error(ErrorCode.INTERNAL, "internal server error")
        self.flush()

    def eof_received(self) -> bool:
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        self.closing = True
        self.server.stream_epoch += 1
        for st in list(self.streams.values()):
            if not st.ended:
                st.ended = True
                if st.seq is not None:  # else its async hooks are running; their task ends it
                    self.server.engine.cancel(st.seq)
                    self._hooks_done(st, p.FinishReason.CANCELLED)
        self.streams.clear()
        self.server.connection_gone(self)

    def pause_writing(self) -> None:
        # The kernel stopped taking our bytes and the transport holds more than the limit.
        self.slow = True
        if self.streams:
            log.info("slow consumer: ending %d streams", len(self.streams))
            self.end_all_streams(ErrorCode.SLOW_CONSUMER, "client is not reading its output")

    def resume_writing(self) -> None:
        self.slow = False

    # ------------------------------------------------------------------ frames in

    def _on_frame(self, ftype: int, flags: int, stream: int, payload: memoryview) -> None:
        first = self.first_frame
        self.first_frame = False
        self.server.metrics.frames("in", ftype)
        if self.principal is None and ftype != FrameType.HELLO:
            # Auth is on and the first frame was not HELLO.
            self._unauthenticated("HELLO with a valid API key must be the first frame")
            return
        if ftype == FrameType.REQUEST:
            self._on_request(stream, flags, payload)
        elif ftype == FrameType.CANCEL:
            p.check_cancel(payload)
            st = self.streams.get(stream)
            if st is not None:
                if st.seq is not None:
                    self.server.engine.cancel(st.seq)
                else:
                    st.cancel_requested = True
        elif ftype == FrameType.PING:
            p.check_ping(payload)
            self._queue_frame(p.encode_pong(bytes(payload)), "PONG")
        elif ftype == FrameType.PONG:
            pass
        elif ftype == FrameType.HELLO:
            if not first:
                raise ProtocolError(ErrorCode.MALFORMED_FRAME, "HELLO is only allowed first")
            self._on_hello(payload)

    def _unauthenticated(self, message: str) -> None:
        self.connection_error(ErrorCode.UNAUTHENTICATED, message)

    def _on_hello(self, payload: memoryview) -> None:
        version, key = p.parse_hello(payload)
        if version != p.VERSION:
            raise ProtocolError(
                ErrorCode.UNSUPPORTED_VERSION,
                f"protocol version {version} not supported (this server speaks {p.VERSION})",
            )
        try:
            self.principal = self.server.chain.on_hello(key)
        except HookError as exc:
            self.connection_error(ErrorCode(exc.code), exc.message, exc.retry_after_ms)
            return
        self._queue_frame(self.server.welcome, "WELCOME")

    def _on_request(self, stream: int, flags: int, payload: memoryview) -> None:
        if stream in self.streams:
            raise ProtocolError(ErrorCode.STREAM_IN_USE, f"stream {stream} is already in flight")
        t_recv = _perf()
        server = self.server
        try:
            if server.draining:
                raise StreamError(ErrorCode.SHUTTING_DOWN, "server is draining")
            if len(self.streams) >= self.cfg.max_streams_per_connection:
                raise StreamError(
                    ErrorCode.TOO_MANY_STREAMS,
                    f"at most {self.cfg.max_streams_per_connection} streams per connection",
                )
            if self.slow:
                raise StreamError(ErrorCode.SLOW_CONSUMER, "client is not reading its output")
            try:
                req = p.parse_request(stream, flags, payload)
            except ProtocolError as exc:
                raise StreamError(exc.code, exc.message) from None
            st = Stream(self, stream, t_recv, req.want_text)
            seq = server.build_sequence(st, req)
        except StreamError as exc:
            self._stream_error(stream, exc.code, exc.message, exc.retry_after_ms)
            return
        st.seq = seq
        if not server.per_request_hooks:
            self._submit(st)
            return
        assert self.principal is not None
        st.ctx = ctx = server.context(self.principal, req, seq)
        if server.hooks_async:
            # Redis-backed hooks: the stream is in flight (its id taken) while they run.
            self.streams[stream] = st
            st.seq = None  # not cancellable in the engine until submitted
            assert server.loop is not None
            task = server.loop.create_task(self._run_hooks_async(st, seq))
            server.hook_tasks.add(task)  # the loop keeps only weak references to tasks
            task.add_done_callback(server.hook_tasks.discard)
            return
        try:
            cached = server.chain.on_request(ctx)
        except HookError as exc:
            self._hook_refused(st, exc)
            return
        st.seq = seq
        if cached is not None:
            self._replay(st, cached)
        else:
            self._submit(st)

    async def _run_hooks_async(self, st: Stream, seq: Sequence) -> None:
        assert st.ctx is not None
        try:
            cached = await self.server.chain.on_request_async(st.ctx)
        except HookError as exc:
            if not st.ended:
                self.streams.pop(st.stream_id, None)
                self._hook_refused(st, exc)
                self.flush()
            return
        if st.ended:  # the connection went away while the hooks ran: on_done comes after them
            st.prompt_tokens = 0  # nothing ran: the whole reservation goes back
            self._hooks_done(st, p.FinishReason.CANCELLED)
            return
        if st.cancel_requested:
            self.streams.pop(st.stream_id, None)
            st.ended = True
            self._queue_done(st, p.FinishReason.CANCELLED, 0.0)
            self._hooks_done(st, p.FinishReason.CANCELLED)
        elif cached is not None:
            self.streams.pop(st.stream_id, None)
            st.seq = seq
            self._replay(st, cached)
        else:
            self.streams.pop(st.stream_id, None)
            st.seq = seq
            self._submit(st)
        self.flush()

    def _hook_refused(self, st: Stream, exc: HookError) -> None:
        if exc.code == ErrorCode.RATE_LIMITED:
            self.server.metrics.rate_limited()
        if exc.code == ErrorCode.UNAUTHENTICATED:  # the key was revoked by a reload
            self.connection_error(ErrorCode.UNAUTHENTICATED, exc.message)
            return
        self._stream_error(st.stream_id, ErrorCode(exc.code), exc.message, exc.retry_after_ms)

    def _submit(self, st: Stream) -> None:
        assert st.seq is not None
        try:
            self.server.engine.submit(st.seq)
        except EngineOverloaded as exc:
            self._stream_error(
                st.stream_id, ErrorCode.OVERLOADED, "engine queue is full", exc.retry_after_ms
            )
            st.prompt_tokens = 0  # nothing ran: the whole reservation goes back
            self._hooks_done(st, FINISH_ERROR)
            return
        except EngineStopped:
            self._stream_error(st.stream_id, ErrorCode.SHUTTING_DOWN, "server is shutting down")
            st.prompt_tokens = 0
            self._hooks_done(st, FINISH_ERROR)
            return
        self.streams[st.stream_id] = st

    def _replay(self, st: Stream, cached: CachedResponse) -> None:
        """Answer from the response cache: the stored stream, then DONE with cache bit 0."""
        self.server.metrics.response_cache_hit()
        ids = cached.token_ids.tolist()
        text = cached.text.encode("utf-8") if st.want_text else b""
        # Ids in frames of at most _REPLAY_IDS_PER_FRAME; the whole text rides on the last one.
        chunks = [
            ids[i : i + _REPLAY_IDS_PER_FRAME] for i in range(0, len(ids), _REPLAY_IDS_PER_FRAME)
        ] or [[]]
        frames = 0
        for i, chunk in enumerate(chunks):
            data = text if i == len(chunks) - 1 else b""
            if chunk or data:
                self._reserve(p.token_frame_size(len(chunk), len(data)))
                self._out_len = p.pack_token_into(
                    self._out, self._out_len, st.stream_id, chunk, data
                )
                frames += 1
        st.n_ids = len(ids)
        st.t_first = _perf()
        st.cache_bits = p.CACHE_RESPONSE  # replayed: no precompiled KV was used either
        st.prompt_tokens = cached.prompt_tokens
        st.ended = True
        self.server._m_tokens_out.inc(frames)
        self._queue_done(st, cached.finish_reason, 0.0)
        if st.ctx is not None:
            self.server.chain.on_done(
                st.ctx,
                Completion(
                    cached.finish_reason, st.prompt_tokens, st.n_ids, None, None, from_cache=True
                ),
            )

    # ------------------------------------------------------------------ frames out

    def _reserve(self, n: int) -> None:
        need = self._out_len + n
        if need > len(self._out):
            size = len(self._out)
            while size < need:
                size *= 2
            self._out.extend(bytes(size - len(self._out)))

    def _queue_bytes(self, data: bytes) -> None:
        self._reserve(len(data))
        end = self._out_len + len(data)
        self._out[self._out_len : end] = data
        self._out_len = end

    def _queue_frame(self, data: bytes, type_name: str) -> None:
        self._queue_bytes(data)
        self.server.metrics.frames("out", type_name)

    def _stream_error(self, stream: int, code: ErrorCode, message: str, retry_ms: int = 0) -> None:
        self._queue_frame(p.encode_error(stream, code, message, retry_ms), "ERROR")
        self.server.metrics.request_error(code.name)
        if self.server.log_requests or code == ErrorCode.INTERNAL:
            REQUEST_LOG.warning(
                "request refused",
                extra={
                    "request_id": f"{self.conn_id}:{stream}",
                    "code": code.name,
                    "detail": message,
                },
            )

    def queue_token(self, st: Stream, token: int, text: str) -> int:
        """Pack one TOKEN frame (one id, or only text when token is NO_TOKEN); returns frames."""
        data = text.encode("utf-8") if (text and st.want_text) else b""
        if token == NO_TOKEN:
            if not data:
                return 0
            self._reserve(p.token_frame_size(0, len(data)))
            self._out_len = p.pack_token_into(self._out, self._out_len, st.stream_id, (), data)
            return 1
        end = self._out_len + p.TOKEN1_FRAME_SIZE + len(data)
        if end > len(self._out):
            self._reserve(end - self._out_len)
        self._out_len = p.pack_token1_into(self._out, self._out_len, st.stream_id, token, data)
        st.n_ids += 1
        if not st.t_first:
            st.t_first = _perf()
        return 1

    def _queue_done(self, st: Stream, finish: int, t_admit: float) -> None:
        self.server.settle_columns()
        now = _perf()
        self._reserve(p.DONE_FRAME_SIZE)
        queue_s = max(0.0, t_admit - st.t_recv) if t_admit else 0.0
        ttft_s = (st.t_first - st.t_recv) if st.t_first else 0.0
        total_s = now - st.t_recv
        self._out_len = p.pack_done_into(
            self._out,
            self._out_len,
            st.stream_id,
            finish,
            st.cache_bits,
            st.prompt_tokens,
            st.n_ids,
            int(queue_s * 1e6),
            int(ttft_s * 1e6),
            int(total_s * 1e6),
        )
        server = self.server
        server._m_done_out.inc()
        server.metrics.request_finished(
            _FINISH_NAMES[finish],
            st.prompt_tokens,
            st.n_ids,
            queue_s,
            ttft_s if st.t_first else None,
            total_s,
        )
        if st.n_ids > 1:
            server.metrics.inter_token(now - st.t_first, st.n_ids - 1)
        if server.log_requests:
            REQUEST_LOG.info(
                "request finished",
                extra={
                    "request_id": f"{self.conn_id}:{st.stream_id}",
                    "finish": _FINISH_NAMES[finish],
                    "prompt_tokens": st.prompt_tokens,
                    "completion_tokens": st.n_ids,
                    "cache": st.cache_bits,
                    "ttft_ms": round(ttft_s * 1000, 3),
                    "total_ms": round(total_s * 1000, 3),
                },
            )

    def finish_stream(self, st: Stream, finish: int, t_admit: float) -> None:
        """Write DONE (or ERROR INTERNAL for an engine failure) and forget the stream."""
        st.ended = True
        self.server.stream_epoch += 1
        self.streams.pop(st.stream_id, None)
        if not self.streams:
            self.last_activity = time.monotonic()
        if finish == FINISH_ERROR:
            self._stream_error(st.stream_id, ErrorCode.INTERNAL, "the model backend failed")
        else:
            self._queue_done(st, finish, t_admit)
        self._hooks_done(st, finish)
        if self.server.draining and not self.streams:
            self.flush()
            self.close()

    def _hooks_done(self, st: Stream, finish: int) -> None:
        if st.ctx is None:
            return
        self.server.settle_columns()
        ctx, st.ctx = st.ctx, None  # exactly once per request
        ids = text = None
        if st.rec_ids is not None and finish in (0, 1, 2):
            ids = np.asarray(st.rec_ids, dtype=np.int32)
            if st.rec_text is not None:
                text = "".join(st.rec_text)
            else:
                text = self.server.tokenizer.decode(st.rec_ids)
        self.server.chain.on_done(
            ctx, Completion(finish, st.prompt_tokens, st.n_ids, ids, text, from_cache=False)
        )

    def flush(self) -> None:
        self.dirty = False
        n, self._out_len = self._out_len, 0  # reset first: write() may re-enter via pause_writing
        if n and self.transport is not None and not self.transport.is_closing():
            self.transport.write(self._out[:n])
            self.server._m_bytes_out.inc(n)

    def end_all_streams(self, code: ErrorCode, message: str) -> None:
        self.server.stream_epoch += 1
        for st in list(self.streams.values()):
            st.ended = True
            self._stream_error(st.stream_id, code, message)
            if st.seq is not None:  # else its async hooks are running; their task ends it
                self.server.engine.cancel(st.seq)
                self._hooks_done(st, FINISH_ERROR)
        self.streams.clear()
        self.last_activity = time.monotonic()
        self.flush()

    def goaway(self, reason: str) -> None:
        self._queue_frame(p.encode_goaway(len(self.streams), reason), "GOAWAY")
        self.flush()
        if not self.streams:
            self.close()

    def connection_error(self, code: ErrorCode, message: str, retry_after_ms: int = 0) -> None:
        """ERROR on stream 0, then close; the stream-0 ERROR stands for every stream."""
        if self.closing:
            return
        self._queue_frame(p.encode_error(0, code, message, retry_after_ms), "ERROR")
        self.server.metrics.request_error(code.name)
        self.flush()
        self.close()

    def close(self) -> None:
        if self.closing:
            return
        self.closing = True
        self.server.stream_epoch += 1
        for st in self.streams.values():
            if not st.ended:
                st.ended = True
                if st.seq is not None:  # else its async hooks are running; their task ends it
                    self.server.engine.cancel(st.seq)
                    self._hooks_done(st, FINISH_ERROR)
        if self.transport is not None:
            self.transport.close()
