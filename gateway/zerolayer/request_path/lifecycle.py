"""The one request path, shared by every door: a stream's life from accepted to ended.

A door (the frame server's Connection, the HTTP front end) parses its own wire format into a
``Request`` (zerolayer.request_path.request) and hands it to ``RequestPath.open``; from there the
path is the same for every door: validate and tokenize (zerolayer.request_path.inputs) → hook chain
(auth, rate limit, response cache; sync or async) → engine, or a replay of a cached answer. A door
only writes: the path calls its ``Door`` methods with the DONE record or the ERROR, and the output
processor writes the engine's tokens through the door's own encoder (``Door.encoder``).

One state per stream, moved only here (``Phase``: NEW [→ PREPARING, a large input tokenized off
the loop] → HOOKS → ENGINE → ENDED), and one function that ends a stream, ``_end``: whatever
ends it (the engine, a refusal, CANCEL, a disconnect, a slow consumer, the drain deadline, a
failure anywhere on the path) goes through it, so each of these holds by construction:
- a stream ends exactly once: a second end, or an engine output for an ended stream, is dropped;
- the door writes exactly one DONE or ERROR (none when the door itself is gone);
- the stream's token count is final before DONE (the output processor's ``ended``), and no
  later engine step writes to it;
- the engine is told to cancel a sequence that is still running;
- the hooks get exactly one of on_refused (from the chain) or on_done; when async hooks are still
  running, on_done comes after them;
- the rate-limit charge follows one policy (``charged_prompt_tokens``);
- metrics and the request log see every ending once.

The path also owns draining, for every door: ``start_draining`` refuses new requests from then
on, and each door reads ``draining`` to say so in its own wire format.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Callable, Coroutine
from typing import Any

import numpy as np

from zerolayer.codes import (
    COMPLETE_REASONS,
    FINISH_BY_VALUE,
    FINISH_LABELS,
    Cached,
    ErrorCode,
    FinishReason,
    Refusal,
)
from zerolayer.engine.engine import Engine, EngineOverloaded, EngineStopped, Sequence
from zerolayer.engine.finish import GRAMMAR_FAILED
from zerolayer.engine.step import FINISH_ERROR, StepOutput
from zerolayer.hooks import CachedResponse, Chain, Completion, HookError, Principal, RequestContext
from zerolayer.kernels.splitmix import child_seed
from zerolayer.ops.logging import REQUEST_LOG
from zerolayer.ops.metrics import Metrics
from zerolayer.request_path import offload
from zerolayer.request_path.inputs import InputProcessor, Prepared, plain
from zerolayer.request_path.outputs import OutputProcessor
from zerolayer.request_path.request import Request
from zerolayer.request_path.stream import (
    ENDED,
    ENGINE,
    HOOKS,
    NEW,
    PREPARING,
    Door,
    Stream,
)
from zerolayer.structured import Grammar, GrammarBusy, GrammarError, Grammars
from zerolayer.tokenizer import Detokenizer

_ERROR = FinishReason.ERROR

log = logging.getLogger("zerolayer.requests")

_perf = time.perf_counter


GRAMMAR_BUSY_RETRY_MS = 1000  # the retry hint when the grammar compiler's queue is full


def _grammar_failed(st: Stream, count: int) -> Refusal:
    """The answer to a row whose grammar exceeded its limits (finish GRAMMAR_FAILED): the
    client's grammar is at fault, so INVALID_REQUEST naming its field, never INTERNAL."""
    seq = st.seq
    grammar = seq.grammar if seq is not None else None
    field = grammar.constraint.field if grammar is not None else "response_format"
    why = seq.grammar_error if seq is not None else ""
    return Refusal(
        ErrorCode.INVALID_REQUEST,
        f"{field}: the grammar exceeded its limits after {count} tokens ({why})",
        0,
        field,
    )


def fair_share(principal: Principal, st: Stream) -> tuple[object, int, str]:
    """Who a request's sequences count against at admission (zerolayer.engine.admission): an
    authenticated client's share one turn and one share of the rows, an anonymous client's those
    of its address, whatever its connections or doors; with the principal's weight and class."""
    key = principal.name if principal.key_id else ("anonymous", st.door.peer_ip)
    return key, principal.weight, principal.principal_class


def charged_prompt_tokens(st: Stream) -> int:
    """The charging policy, in one place: a request pays for its prompt once its prefill started
    in the engine or it was answered from the response cache; refused, or cancelled or
    disconnected before its prefill started (in the hooks or in the queue), it pays nothing for
    its prompt. Completion tokens are paid as sent (``Completion.completion_tokens``)."""
    if st.from_cache:
        return st.prompt_tokens
    seq = st.seq
    if seq is None:
        return 0
    return st.prompt_tokens if seq.prefilled > 0 else 0


class RequestPath:
    """Validation → hooks → engine for every door, and the one place a stream ends."""

    def __init__(
        self,
        engine: Engine,
        inputs: InputProcessor,
        chain: Chain,
        metrics: Metrics,
        tokenizer_decode: Callable[[list[int]], str] | None = None,
        grammars: Grammars | None = None,
    ) -> None:
        self.engine = engine
        self.grammars = grammars  # structured output (None: the model's tokenizer has none)
        self.inputs = inputs
        self.chain = chain
        self.metrics = metrics
        self.model = inputs.info.name
        self._decode = tokenizer_decode or inputs.tokenizer.decode
        self.outputs = OutputProcessor(metrics)
        self.draining = False
        # Async hooks and off-loop preparing in flight.
        self.hook_tasks: set[asyncio.Task[None]] = set()
        self._per_request_hooks = chain.per_request
        self._records = chain.records
        self._log_requests = REQUEST_LOG.isEnabledFor(logging.INFO)

    # ---- doors call these ------------------------------------------------------------------

    def authenticate(self, keys: list[bytes], certificate: Principal | None = None) -> Principal:
        """Every credential a door was given → the one principal; raises HookError
        (UNAUTHENTICATED) for any invalid key, or keys of different principals."""
        return self.chain.on_credentials(keys, certificate)

    def open(self, st: Stream, principal: Principal, req: Request) -> None:
        """Run ``req`` for ``st`` (already known to its door). Never raises for anything the
        request contains: every outcome reaches the door through its methods. With ``req.n`` >
        1, ``st`` is choice 0 of n streams made here (docs/architecture.md, "n choices")."""
        assert st.phase is NEW
        if req.inputs is not None:
            self._open_inputs(st, principal, req)
            return
        if req.n > 1:
            self._make_choices(st, req.n)
        try:
            if self.draining:
                raise Refusal(ErrorCode.SHUTTING_DOWN, "server is draining")
            large = self.inputs.offloaded(req)
            if large or req.constraint is not None:
                st.phase = PREPARING  # the stream is open (its id taken) while it is prepared
                self._track(self._prepare_async(st, principal, req, large))
                return
            prep = self.inputs.prepare(req)
        except Refusal as exc:
            self._fail_all(st, exc)
            return
        self._prepared(st, principal, req, prep, None)

    def _open_inputs(self, st: Stream, principal: Principal, req: Request) -> None:
        """A request of k inputs (``req.inputs``): k streams made as n choices are (``st`` the
        first), each with its own prompt and sequence; the hooks see one request (its prompt
        the inputs' ids together, ``_context``) and each input's prompt is charged once
        (``_hooks_done``)."""
        assert req.inputs is not None
        if len(req.inputs) > 1:
            self._make_choices(st, len(req.inputs))
        try:
            if self.draining:
                raise Refusal(ErrorCode.SHUTTING_DOWN, "server is draining")
            if self.inputs.offloaded(req):
                st.phase = PREPARING  # tokenized on the offload pool, as a large prompt is
                self._track(self._prepare_async(st, principal, req, True))
                return
            preps = self.inputs.prepare_inputs(req)
        except Refusal as exc:
            self._fail_all(st, exc)
            return
        self._inputs_prepared(st, principal, req, preps)

    def _inputs_prepared(
        self, st: Stream, principal: Principal, req: Request, preps: list[Prepared]
    ) -> None:
        """Each input's sequence, then the hooks and the engine as for any request."""
        fair_key, weight, pclass = fair_share(principal, st)
        for member, prep in zip(st.group or (st,), preps, strict=True):
            member.full_ids = prep.prompt
            member.prompt_tokens = len(prep.prompt)
            member.seq = Sequence(
                member, prep.prompt, prep.max_tokens, prep.sampling, fair_key=fair_key,
                weight=weight, principal_class=pclass, pool=req.embed, score=req.prompt_logprobs,
            )  # fmt: skip
        self._after_prepared(st, principal, req)

    def _make_choices(self, st: Stream, n: int) -> None:
        """Choices 1 … n-1 of ``st``'s request: streams of the same door, key and api."""
        group = [st]
        for choice in range(1, n):
            sib = Stream(st.door, st.key, st.api, st.want_text)
            sib.t_recv = st.t_recv
            sib.choice = choice
            group.append(sib)
        for member in group:
            member.group = tuple(group)

    def _fail_all(self, st: Stream, error: Refusal) -> None:
        """End ``st`` and the other choices of its request with the same ERROR."""
        for member in st.group or (st,):
            self.fail(member, error)

    async def _compile(self, req: Request) -> Grammar | None:
        """The request's constraint compiled (off the loop and the engine thread, cached by
        constraint); a Refusal naming the field when it cannot be."""
        constraint = req.constraint
        if constraint is None:
            return None
        if self.grammars is None:
            raise Refusal(
                ErrorCode.INVALID_REQUEST,
                f"{constraint.field}: structured output needs the model's tokenizer.json, "
                "which this model does not have",
                0,
                constraint.field,
            )
        try:
            return await self.grammars.compile(constraint)
        except GrammarError as exc:
            raise Refusal(ErrorCode.INVALID_REQUEST, str(exc), 0, exc.field) from None
        except GrammarBusy:
            raise Refusal(
                ErrorCode.OVERLOADED, "the grammar compiler is busy", GRAMMAR_BUSY_RETRY_MS
            ) from None

    def _prepared(
        self,
        st: Stream,
        principal: Principal,
        req: Request,
        prep: Prepared,
        grammar: Grammar | None,
    ) -> None:
        """After validation and tokenizing: the hooks, then the engine."""
        st.full_ids = prep.prompt
        st.prompt_tokens = len(prep.prompt)
        st.want_text = req.want_text
        # Deterministic requests are recorded when a hook caches responses: their ids, and the
        # text deltas when the engine produces them anyway; otherwise the text is decoded once
        # at the end rather than per token.
        if self._records and prep.deterministic:
            st.record = True
            st.rec_text = [] if prep.detokenizer is not None else None
        fair_key, weight, pclass = fair_share(principal, st)
        st.seq = Sequence(
            st, prep.prompt, prep.max_tokens, prep.sampling, prep.stop_ids, prep.stop_sequences,
            prep.detokenizer, prep.ignore_eos, fair_key, grammar, weight, pclass,
            score=req.prompt_logprobs,
        )  # fmt: skip
        for sib in (st.group or (st,))[1:]:  # the other choices: their own seed stream and text
            sib.full_ids, sib.prompt_tokens = st.full_ids, st.prompt_tokens
            sib.want_text = st.want_text
            sampling = prep.sampling
            if sampling.seed is not None:
                sampling = dataclasses.replace(sampling, seed=child_seed(sampling.seed, sib.choice))
            detok = Detokenizer(self.inputs.tokenizer) if prep.detokenizer is not None else None
            sib.seq = Sequence(
                sib, prep.prompt, prep.max_tokens, sampling, prep.stop_ids, prep.stop_sequences,
                detok, prep.ignore_eos, fair_key, grammar, weight, pclass,
            )  # fmt: skip
            sib.seq.parent = st.seq
            st.seq.choices.append(sib.seq)
        self._after_prepared(st, principal, req)

    def _after_prepared(self, st: Stream, principal: Principal, req: Request) -> None:
        """The request's sequences are made: the hooks, then the engine."""
        if not self._per_request_hooks:
            self._submit(st)
            return
        st.ctx = self._context(st, principal, req)
        if self.chain.is_async:
            # Redis-backed hooks: the stream is open (its id taken) while they run.
            st.phase = HOOKS
            self._track(self._run_hooks_async(st))
            return
        try:
            cached = self.chain.on_request(st.ctx)
        except HookError as exc:
            self._refused(st, exc)
            return
        self._proceed(st, cached)

    def _track(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self.hook_tasks.add(task)  # the loop keeps only weak references to tasks
        task.add_done_callback(self.hook_tasks.discard)

    async def _prepare_async(
        self, st: Stream, principal: Principal, req: Request, large: bool
    ) -> None:
        """A constraint compiled, and a large input (or k inputs) prepared on the offload pool.
        A stream that ended meanwhile (CANCEL, disconnect, drain) has already been answered
        once: the result is dropped."""
        try:
            try:
                grammar = await self._compile(req)
                if st.phase is not PREPARING:
                    return
                prepared: Prepared | list[Prepared]
                if req.inputs is not None:
                    prepared = await offload.run(self.inputs.prepare_inputs, req)
                elif large:
                    prepared = await offload.run(self.inputs.prepare, req)
                else:
                    prepared = self.inputs.prepare(req)
            except Refusal as exc:
                if st.phase is PREPARING:
                    st.phase = NEW
                    self._fail_all(st, exc)
                return
            if st.phase is not PREPARING:
                return
            st.phase = NEW
            if isinstance(prepared, list):
                self._inputs_prepared(st, principal, req, prepared)
            else:
                self._prepared(st, principal, req, prepared, grammar)
        except Exception:  # a bug in preparing or after it: this request alone ends
            log.exception("request path failed preparing a request")
            self._fail_all(st, Refusal(ErrorCode.INTERNAL, "internal server error"))
        finally:
            if st.door.open:
                st.door.flush()

    def refuse(self, st: Stream, error: Refusal) -> None:
        """A door refuses the request before opening it (stream limits, bad payload)."""
        self.fail(st, error)

    def cancel(self, st: Stream) -> None:
        """The client cancelled (or went away): the stream ends CANCELLED now, its sequence
        leaves the engine at the next step. Nothing happens for an ended stream."""
        self._end(st, FinishReason.CANCELLED)

    def fail(self, st: Stream, error: Refusal) -> None:
        """End ``st`` with an ERROR: the Refusal travels whole to the door (code, message,
        field, retry hint), whichever layer refused."""
        self._end(st, _ERROR, error)

    async def aclose(self) -> None:
        """Shutdown, after the doors drained: stop hook tasks still running (their streams have
        ended by now)."""
        tasks = list(self.hook_tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def start_draining(self) -> None:
        """From now on every door refuses new requests (SHUTTING_DOWN); streams in flight go
        on. Each door then closes its connections as their streams end."""
        self.draining = True

    # ---- the engine's steps ----------------------------------------------------------------

    def deliver(self, steps: list[StepOutput]) -> None:
        """A batch of engine steps (the Outbox's consumer): the output processor writes them,
        the streams the engine finished end here, then every door written to is flushed."""
        dirty: list[Door] = []
        for owner, finish, t_admit, count, ids in self.outputs.write(steps, dirty):
            st: Stream = owner  # type: ignore[assignment]  # the engine's owners are Streams
            if st.ended:  # cancelled, disconnected, ...: its engine ending is dropped
                continue
            if st.record:
                st.rec_ids = ids
            if finish == FINISH_ERROR:
                error = Refusal(ErrorCode.INTERNAL, "the model backend failed")
                self._end(st, _ERROR, error, t_admit=t_admit, count=count)
            elif finish == GRAMMAR_FAILED:  # the client's grammar, not the daemon: a 400
                self._end(st, _ERROR, _grammar_failed(st, count), t_admit=t_admit, count=count)
            else:
                self._end(st, FINISH_BY_VALUE[finish], t_admit=t_admit, count=count)
            door = st.door
            if not door.dirty and door.open:
                door.dirty = True
                dirty.append(door)
        for door in dirty:
            door.flush()

    # ---- the path ---------------------------------------------------------------------------

    def _context(self, st: Stream, principal: Principal, req: Request) -> RequestContext:
        seq = st.seq
        assert seq is not None and st.full_ids is not None
        prompt_ids = st.full_ids
        if req.inputs is not None and st.group:  # k inputs: their prompts, one after the other
            prompt_ids = np.concatenate([m.full_ids for m in st.group if m.full_ids is not None])
        return RequestContext(
            principal=principal,
            model=self.model,
            prompt_ids=prompt_ids,
            prompt_id=req.prompt_id,
            max_tokens=seq.max_tokens,  # as prepared (an HTTP request may leave it to the path)
            sampling=req.sampling,
            stop_ids=tuple(sorted(seq.stop_ids)),
            stop_sequences=req.stop_sequences,
            want_text=req.want_text,
            use_cache=req.use_cache and plain(req),  # the cache's key has no #27 field
        )

    async def _run_hooks_async(self, st: Stream) -> None:
        ctx = st.ctx
        assert ctx is not None
        try:
            try:
                cached = await self.chain.on_request_async(ctx)
            except HookError as exc:
                if st.phase is HOOKS:
                    st.phase = NEW
                    self._refused(st, exc)
                else:  # it ended while the hooks ran; the chain ran on_refused: nothing owed
                    st.ctx = None
                return
            if st.phase is not HOOKS:  # ended while the hooks ran: on_done after them
                self._hooks_done(st)
                return
            st.phase = NEW
            self._proceed(st, cached)
        except Exception:  # a bug after the chain (replay, submit): this stream alone ends
            log.exception("request path failed after the hook chain")
            self.fail(st, Refusal(ErrorCode.INTERNAL, "internal server error"))
        finally:
            if st.door.open:
                st.door.flush()

    def _refused(self, st: Stream, exc: HookError) -> None:
        """A hook refused (the chain already ran on_refused: no on_done for this request)."""
        st.ctx = None
        if exc.code == ErrorCode.RATE_LIMITED:
            self.metrics.rate_limited()
        self._fail_all(st, exc)

    def _proceed(self, st: Stream, cached: CachedResponse | None) -> None:
        """After the hooks: the engine, or the response cache's answer."""
        if cached is None:
            self._submit(st)
        else:
            self._replay(st, cached)

    def _submit(self, st: Stream) -> None:
        """Into the engine: each sequence without a parent (choice 0 carries the other choices'
        sequences; each of k inputs is its own). A full queue ends them all (those submitted
        are cancelled by their ending)."""
        assert st.seq is not None
        members = st.group or (st,)
        for member in members:
            member.phase = ENGINE
        try:
            for member in members:
                if member.seq is not None and member.seq.parent is None:
                    self.engine.submit(member.seq)
        except EngineOverloaded as exc:
            full = Refusal(ErrorCode.OVERLOADED, "engine queue is full", exc.retry_after_ms)
            self._fail_all(st, full)
        except EngineStopped:
            self._fail_all(st, Refusal(ErrorCode.SHUTTING_DOWN, "server is shutting down"))

    def _replay(self, st: Stream, cached: CachedResponse) -> None:
        """Answer from the response cache: the stored stream, then DONE with cache bit 0."""
        st.phase = ENGINE
        self.metrics.response_cache_hit()
        self.outputs.replay(st, cached.token_ids.tolist(), cached.text)
        st.from_cache = True
        st.cache_bits = Cached.RESPONSE  # replayed: no precompiled KV was used either
        st.prompt_tokens = cached.prompt_tokens
        st.record, st.rec_text = False, None  # nothing to record: it came from the cache
        self._end(st, FinishReason(cached.finish_reason))

    # ---- the one end of a stream -------------------------------------------------------------

    def _end(
        self,
        st: Stream,
        finish: FinishReason,
        error: Refusal | None = None,
        *,
        t_admit: float = 0.0,
        count: int | None = None,
    ) -> None:
        """End ``st``: ``count`` is its token count when the engine ended it (None: anything
        else ended it, and the engine is told to cancel its sequence)."""
        if st.phase is ENDED:
            return
        hooks_running = st.phase is HOOKS
        # Its sequence, when the engine has it (a replay from the cache has none running).
        engine_seq = st.seq if st.phase is ENGINE and not st.from_cache else None
        st.phase = ENDED
        st.ended = True
        st.finish = finish
        self.outputs.ended(st, count)  # st.n_ids is final from here
        if engine_seq is not None and count is None:
            self.engine.cancel(engine_seq)
        door = st.door
        now = _perf()
        queue_s = max(0.0, t_admit - st.t_recv) if t_admit else 0.0
        ttft_s = (st.t_first - st.t_recv) if st.t_first else 0.0
        total_s = now - st.t_recv
        # Metrics count what was written (docs/metrics.md): an ending whose door is gone (the
        # client disconnected, or an ERROR on stream 0 ended its connection) writes nothing,
        # and counts as a cancelled request with the tokens sent before it (not an error).
        written = door.open
        if not written and error is None:
            self._abandoned(st)
        if error is not None:
            code = error.code
            if written:
                door.write_error(st, error)
                self.metrics.request_error(code.name, st.api)
            if self._log_requests or code == ErrorCode.INTERNAL:
                REQUEST_LOG.warning(
                    "request refused",
                    extra={"request_id": f"{door.label}:{st.key}", "code": code.name,
                           "detail": error.message},
                )  # fmt: skip
        elif written:
            if engine_seq is not None and engine_seq.reused:
                st.cache_bits |= Cached.PROMPT  # the prefix store supplied part of its KV
            door.write_done(st, finish, (queue_s, ttft_s, total_s))
            metrics = self.metrics
            label = FINISH_LABELS[finish]
            metrics.request_finished(
                label, st.prompt_tokens, st.n_ids, queue_s,
                ttft_s if st.t_first else None, total_s, st.api,
            )  # fmt: skip
            if st.n_ids > 1:
                metrics.inter_token(now - st.t_first, st.n_ids - 1)
            if self._log_requests:
                REQUEST_LOG.info(
                    "request finished",
                    extra={
                        "request_id": f"{door.label}:{st.key}",
                        "finish": label,
                        "prompt_tokens": st.prompt_tokens,
                        "completion_tokens": st.n_ids,
                        "cache": st.cache_bits,
                        "reused_tokens": st.seq.reused if st.seq is not None else 0,
                        "ttft_ms": round(ttft_s * 1000, 3),
                        "total_ms": round(total_s * 1000, 3),
                    },
                )
        first = st.group[0] if st.group else st
        last = st.group is None or all(member.ended for member in st.group)
        if first.ctx is not None and not (hooks_running or first.phase is HOOKS) and last:
            self._hooks_done(first)  # one request: on_done once, after its last choice
        door.stream_ended(st)

    def _abandoned(self, st: Stream) -> None:
        """``st`` ended with its door gone (its client disconnected, or its connection ended
        in an error): no DONE can be written; it counts as cancelled, with the tokens its door
        was given, and the request log says so (the chaos soak reads it: a client cannot know
        what the server generated for a stream it abandoned)."""
        self.metrics.request_disconnected(st.prompt_tokens, st.n_ids, st.api)
        if self._log_requests:
            REQUEST_LOG.info(
                "request abandoned",
                extra={
                    "request_id": f"{st.door.label}:{st.key}",
                    "finish": "cancelled",
                    "prompt_tokens": st.prompt_tokens,
                    "completion_tokens": st.n_ids,
                },
            )

    def _hooks_done(self, st: Stream) -> None:
        """Tell the hooks how the request ended: once, after its hooks finished."""
        ctx, st.ctx = st.ctx, None
        if ctx is None:
            return
        ids = text = None
        if st.rec_ids is not None and st.finish in COMPLETE_REASONS:
            ids = st.rec_ids  # read-only, as Completion promises
            text = (
                "".join(st.rec_text)
                if st.rec_text is not None
                else self._decode(st.rec_ids.tolist())
            )
        members = st.group or (st,)
        completion_tokens = sum(member.n_ids for member in members)
        # Each prompt sent is charged once: a choice's sequence shares its parent's prompt.
        prompt_tokens = sum(
            charged_prompt_tokens(m) for m in members if m.seq is None or m.seq.parent is None
        )
        self.chain.on_done(
            ctx,
            Completion(
                int(st.finish), prompt_tokens, completion_tokens, ids, text,
                from_cache=st.from_cache,
            ),
        )  # fmt: skip
