"""The request path (zerolayer.request_path.lifecycle) with a recording door, a real engine
(synthetic backend, stepped by the test), a real hook chain and the in-process rate limiter: every
request ends exactly once, and the rate-limit reservation follows one policy however it ends."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from tests.support import gate_hooks
from tests.support.sampling import with_sampling
from zerolayer.codes import ErrorCode, FinishReason, Refusal
from zerolayer.config.hooks import CacheConfig, HooksConfig, RateLimitConfig
from zerolayer.config.settings import AuthConfig
from zerolayer.engine.backends.synthetic import SyntheticBackend
from zerolayer.engine.engine import Engine, StepOutput
from zerolayer.hooks import CachedResponse, Chain, HookError, Principal
from zerolayer.hooks.ratelimit import RateLimiter
from zerolayer.ops.metrics import Metrics
from zerolayer.request_path.inputs import InputProcessor
from zerolayer.request_path.lifecycle import RequestPath, charged_prompt_tokens
from zerolayer.request_path.request import Request
from zerolayer.request_path.stream import Phase, Stream
from zerolayer.request_path.validation import validate
from zerolayer.tokenizer import ByteTokenizer


class Door:
    """Records what the path writes; one entry per ending."""

    def __init__(self) -> None:
        self.open = True
        self.dirty = False
        self.label = "t"
        self.peer_ip = "127.0.0.1"
        self.tokens: dict[int, list[int]] = {}
        self.endings: list[tuple[int, str, object]] = []  # (key, "done"/"error", detail)
        self.refusals: list[Refusal] = []  # each ERROR as the door was given it
        self.ended: list[int] = []

    def write_cached(self, st: Stream, ids: list[int], text: str) -> int:
        self.tokens.setdefault(st.key, []).extend(ids)
        return 1

    def write_done(self, st: Stream, finish: FinishReason, timings: tuple) -> None:
        self.endings.append((st.key, "done", finish))

    def write_error(self, st: Stream, error: Refusal) -> None:
        self.endings.append((st.key, "error", error.code))
        self.refusals.append(error)

    def stream_ended(self, st: Stream) -> None:
        self.ended.append(st.key)

    def flush(self) -> None:
        self.dirty = False


class Writer:
    """The recording door's encoder: each produced id, by stream."""

    def __init__(self, streams: list[Stream], rows: list[int]) -> None:
        self.rows = list(zip(rows, streams, strict=True))
        self.doors = [st.door for st in streams]

    def write(self, step: StepOutput) -> int:
        for i, st in self.rows:
            token = int(step.tokens[i])
            if token >= 0:
                st.door.tokens.setdefault(st.key, []).append(token)  # type: ignore[attr-defined]
        return 0


Door.encoder = Writer  # type: ignore[attr-defined]


def make_path(
    tpm: int | None = 10_000, async_gate: bool = True, modules: list[str] | None = None
) -> RequestPath:
    if modules is None:
        modules = ["tests.support.gate_hooks"] if async_gate else []
    settings = SimpleNamespace(
        hooks=HooksConfig(modules=modules),
        auth=AuthConfig(),
        ratelimit=RateLimitConfig(default_tpm=tpm),
        cache=CacheConfig(enabled=False),
    )
    gate_hooks.reset()
    chain = Chain.build(settings)
    backend = SyntheticBackend(num_slots=2, vocab_size=300, max_context=256)
    engine = Engine(
        backend, ByteTokenizer(), lambda step: None, max_queue=8, max_step_tokens=64,
        prefill_chunk=16,
    )  # fmt: skip
    return RequestPath(engine, InputProcessor(ByteTokenizer(), backend.info), chain, Metrics())


def limiter(path: RequestPath) -> RateLimiter:
    owners = {getattr(fn, "__self__", None) for fn, _ in path.chain._on_request_flagged}
    return next(o for o in owners if isinstance(o, RateLimiter))


def request(**kw) -> Request:
    return Request(max_tokens=kw.pop("max_tokens", 5), prompt_text="hello", **with_sampling(kw))


def run_engine(path: RequestPath, steps: int = 50) -> None:
    for _ in range(steps):
        path.deliver([path.engine.step()])
        if path.engine.idle:
            return


def open_stream(path: RequestPath, door: Door, key: int, req: Request | None = None) -> Stream:
    st = Stream(door, key, "frames")
    path.open(st, Principal("anonymous"), req or request())
    return st


async def settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


def test_a_request_ends_once_and_pays_prompt_and_completion() -> None:
    path, door = make_path(async_gate=False), Door()
    st = open_stream(path, door, 1)
    run_engine(path)
    assert door.endings == [(1, "done", FinishReason.MAX_TOKENS)]
    assert st.phase is Phase.ENDED and len(door.tokens[1]) == 5
    assert charged_prompt_tokens(st) == st.prompt_tokens > 0
    path.cancel(st)  # a second end is dropped
    path.fail(st, Refusal(ErrorCode.INTERNAL, "late"))
    assert len(door.endings) == 1 and door.ended == [1]


def test_cancel_while_async_hooks_run_charges_nothing_and_on_done_comes_after_them() -> None:
    async def main() -> None:
        path, door = make_path(), Door()
        gate_hooks.GATE = asyncio.Event()
        st = open_stream(path, door, 1)
        await settle()
        assert st.phase is Phase.HOOKS and gate_hooks.STARTED == 1
        path.cancel(st)  # CANCEL arrives while the hooks run: DONE now ...
        assert door.endings == [(1, "done", FinishReason.CANCELLED)] and door.ended == [1]
        assert gate_hooks.DONE == []  # ... on_done only after the hooks
        gate_hooks.GATE.set()
        await settle()
        assert [c.finish_reason for c in gate_hooks.DONE] == [FinishReason.CANCELLED]
        assert gate_hooks.DONE[0].prompt_tokens == 0  # nothing ran: nothing charged
        assert "anonymous" not in limiter(path).store._tpm  # the whole reservation is back
        assert path.engine.idle  # never submitted

    asyncio.run(main())


def test_cancel_in_the_queue_charges_no_prompt_but_a_started_prefill_does() -> None:
    path, door = make_path(async_gate=False), Door()
    gate_hooks.reset()
    queued = open_stream(path, door, 1)
    path.cancel(queued)  # before the engine took it
    run_engine(path)
    assert charged_prompt_tokens(queued) == 0
    started = open_stream(path, door, 2, request(max_tokens=50))
    path.engine.step()  # prefilled and first token sampled
    path.cancel(started)
    run_engine(path)
    assert charged_prompt_tokens(started) == started.prompt_tokens
    assert door.endings == [
        (1, "done", FinishReason.CANCELLED),
        (2, "done", FinishReason.CANCELLED),
    ]
    assert path.engine.slots_used == 0


def test_a_failure_after_the_hooks_ends_the_stream_with_internal_and_returns_the_budget() -> None:
    async def main() -> None:
        path, door = make_path(), Door()
        # A "cached answer" whose replay fails (no token_ids array): a bug after the chain.
        gate_hooks.ANSWER = CachedResponse(None, "x", 0, 3)  # type: ignore[arg-type]
        st = open_stream(path, door, 7)
        await settle()
        assert door.endings == [(7, "error", ErrorCode.INTERNAL)] and st.phase is Phase.ENDED
        assert len(gate_hooks.DONE) == 1 and gate_hooks.DONE[0].finish_reason == -1
        assert "anonymous" not in limiter(path).store._tpm

    asyncio.run(main())


def test_a_hook_error_with_an_unknown_code_is_internal_for_that_stream_only() -> None:
    assert HookError(99, "boom").code == ErrorCode.INTERNAL
    assert "unknown error code 99" in HookError(99, "boom").message
    # Synchronous chain: the refusal happens inside open().
    path, door = make_path(modules=["tests.support.refuse_hooks"]), Door()
    st = open_stream(path, door, 2)
    assert door.endings == [(2, "error", ErrorCode.INTERNAL)] and st.phase is Phase.ENDED

    async def main() -> None:  # asynchronous chain: the refusal comes from the hook task
        path, door = make_path(), Door()
        gate_hooks.ANSWER = HookError(99, "custom refusal")
        st = open_stream(path, door, 2)
        await settle()
        assert door.endings == [(2, "error", ErrorCode.INTERNAL)] and st.phase is Phase.ENDED
        gate_hooks.ANSWER = None  # the next request on the same path is served
        ok = open_stream(path, door, 3)
        await settle()
        run_engine(path)
        assert door.endings[-1] == (3, "done", FinishReason.MAX_TOKENS) and ok.ended

    asyncio.run(main())


@pytest.mark.parametrize(
    ("field", "value"),
    [("top_k", 2**31), ("top_k", 2**32 - 1), ("temperature", 1e39), ("seed", 2**64)],
)
def test_values_the_engine_cannot_hold_are_refused_naming_the_field(field, value) -> None:
    # Every door's parser ends in zerolayer.request_path.validation.validate; the door hands its
    # refusal to the path (as the frame server does), and the next request is served.
    path, door = make_path(async_gate=False), Door()
    with pytest.raises(Refusal) as err:
        validate(request(**{field: value}))
    assert err.value.field == field and field in err.value.message
    bad = Stream(door, 1, "frames")
    path.refuse(bad, err.value)
    good = open_stream(path, door, 2)
    run_engine(path)
    assert door.endings[0] == (1, "error", ErrorCode.INVALID_REQUEST)
    assert bad.phase is Phase.ENDED and good.phase is Phase.ENDED
    assert door.endings[1] == (2, "done", FinishReason.MAX_TOKENS)


@pytest.mark.parametrize(
    ("fields", "field"),
    [({"n": 9}, "n"), ({"logit_bias": {300: 1.0}}, "logit_bias")],  # max_n 8, vocabulary 300
)
def test_a_refusal_after_the_parser_reaches_the_door_with_its_field(fields, field) -> None:
    # What the input processor refuses (engine.max_n, the model's vocabulary) is handed to the
    # door as the Refusal itself: OpenAI's error.param comes from its field.
    path, door = make_path(async_gate=False), Door()
    open_stream(path, door, 1, request(**fields))
    good = open_stream(path, door, 2)
    run_engine(path)
    assert door.refusals  # one per choice stream of the refused request, the same Refusal
    for refusal in door.refusals:
        assert refusal.code == ErrorCode.INVALID_REQUEST and refusal.field == field
        assert field in refusal.message
    assert good.phase is Phase.ENDED and door.endings[-1] == (2, "done", FinishReason.MAX_TOKENS)


def test_a_refusal_message_names_its_field() -> None:
    assert Refusal(ErrorCode.INVALID_REQUEST, "too big", field="n").message == "n: too big"
    named = Refusal(ErrorCode.INVALID_REQUEST, "n must be at most 8", field="n")
    assert named.message == "n must be at most 8"  # already named: unchanged


def _sample(path: RequestPath, name: str, **labels: str) -> float:
    value = path.metrics.registry.get_sample_value(name, labels)
    return 0.0 if value is None else value


def test_a_client_disconnect_counts_as_cancelled_with_the_tokens_sent() -> None:
    """#25 item 8: the door is gone, so nothing is written, yet the ending is counted as
    finished_reason="cancelled" and the tokens sent before move generation_tokens_total."""
    path, door = make_path(async_gate=False), Door()
    st = open_stream(path, door, 1, request(max_tokens=50))
    for _ in range(4):
        path.deliver([path.engine.step()])
    sent = len(door.tokens[1])
    assert sent > 0 and st.phase is Phase.ENGINE
    door.open = False  # the connection closed: the door cancels its streams
    path.cancel(st)
    run_engine(path)
    assert door.endings == []  # nothing written on a closed door ...
    labels = {"finished_reason": "cancelled", "api": "frames"}
    assert _sample(path, "zerolayer_request_success_total", **labels) == 1  # ... but counted
    assert _sample(path, "zerolayer_generation_tokens_total", api="frames") == sent
    assert _sample(path, "zerolayer_prompt_tokens_total", api="frames") == st.prompt_tokens


def test_a_large_input_cancelled_while_it_is_tokenized_ends_once(monkeypatch) -> None:
    """#25 item 3: an input above the inline size is prepared on the offload pool (phase
    PREPARING); a CANCEL meanwhile ends the stream once, and the prepared result is dropped."""
    from zerolayer.request_path import offload

    monkeypatch.setattr(offload, "INLINE_BYTES", 8)

    async def main() -> None:
        path, door = make_path(async_gate=False), Door()
        st = Stream(door, 1, "frames")
        path.open(st, Principal("anonymous"), Request(max_tokens=5, prompt_text="x" * 100))
        assert st.phase is Phase.PREPARING and door.endings == []
        path.cancel(st)
        assert door.endings == [(1, "done", FinishReason.CANCELLED)]
        await asyncio.gather(*path.hook_tasks)  # the pool's result arrives: dropped
        assert door.endings == [(1, "done", FinishReason.CANCELLED)] and door.ended == [1]
        assert path.engine.idle and st.seq is None
        served = Stream(door, 2, "frames")  # one not cancelled goes on to the engine
        path.open(served, Principal("anonymous"), Request(max_tokens=5, prompt_text="y" * 100))
        await asyncio.gather(*path.hook_tasks)
        assert served.phase is Phase.ENGINE
        run_engine(path)
        assert door.endings[-1] == (2, "done", FinishReason.MAX_TOKENS)

    asyncio.run(main())


# ---- issue #40: a hostile grammar costs its own request, never the others' -------------------


class SlowGrammars:
    """Grammars whose compile blocks on its worker until ``release`` is set, then refuses the
    constraint naming its field (as a hostile schema is, zerolayer.structured)."""

    def __init__(self) -> None:
        import threading

        self.release = threading.Event()
        self.started = 0

    async def compile(self, constraint):  # noqa: ANN001, ANN201
        from zerolayer.structured import GrammarError

        self.started += 1
        await asyncio.get_running_loop().run_in_executor(None, self.release.wait, 30)
        raise GrammarError(constraint.field, "too complex for structured output: lexer error")


def test_a_canary_ends_while_hostile_grammars_compile_and_each_hostile_request_gets_a_400() -> None:
    from zerolayer.structured import Constraint

    async def run() -> tuple[list, list[Refusal], int]:
        path, door = make_path(async_gate=False), Door()
        grammars = SlowGrammars()
        path.grammars = grammars  # type: ignore[assignment]
        hostile = Constraint.json_schema({"type": "object"})
        for key in range(1, 5):
            req = Request(max_tokens=4, prompt_text="hello", constraint=hostile)
            open_stream(path, door, key, req)
        await settle()
        open_stream(path, door, 9, request(max_tokens=4))  # the canary
        await settle()
        run_engine(path)
        canary_done = list(door.endings)
        grammars.release.set()
        for _ in range(300):
            if len(door.endings) == 5:
                break
            await asyncio.sleep(0.01)
        return canary_done + door.endings[len(canary_done) :], door.refusals, grammars.started

    endings, refusals, started = asyncio.run(run())
    assert started == 4
    assert endings[0] == (9, "done", FinishReason.MAX_TOKENS)  # before any hostile one ends
    assert sorted(endings[1:]) == [(k, "error", ErrorCode.INVALID_REQUEST) for k in range(1, 5)]
    assert [r.field for r in refusals] == ["response_format.json_schema.schema"] * 4


class LimitedGrammar:
    """A compiled grammar whose rows exceed their limits filling the mask of token ``at``."""

    def __init__(self, at: int) -> None:
        from zerolayer.structured import Constraint

        self.constraint = Constraint.regex("[a-z]+")
        self.at = at

    def matcher(self) -> LimitedGrammar.Matcher:
        return LimitedGrammar.Matcher(self.at)

    class Matcher:
        def __init__(self, at: int) -> None:
            self.at, self.taken, self.error, self.finished = at, 0, "", False
            self.budget_closed = False

        raises = False  # the mask raises instead (a grammar engine's failure)

        def fill(self, bitmask, row: int, left: int = 0) -> None:  # noqa: ANN001
            bitmask[row] = -1
            if self.taken == self.at:
                if self.raises:
                    raise RuntimeError("lexer error: too many expressions constructed")
                self.error = "lexer error: too many expressions constructed"

        def accept(self, token: int) -> bool:
            self.taken += 1
            return True


@pytest.mark.parametrize("raises", [False, True])
def test_a_grammar_over_its_limits_mid_stream_is_invalid_request_naming_the_field(
    raises: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(LimitedGrammar.Matcher, "raises", raises)

    async def run() -> tuple[list, list[Refusal]]:
        path, door = make_path(async_gate=False), Door()

        class Ready:
            async def compile(self, constraint):  # noqa: ANN001, ANN201
                return LimitedGrammar(at=2)

        path.grammars = Ready()  # type: ignore[assignment]
        from zerolayer.structured import Constraint

        req = Request(max_tokens=8, prompt_text="hello", constraint=Constraint.regex("[a-z]+"))
        open_stream(path, door, 1, req)
        open_stream(path, door, 2, request(max_tokens=8))  # a plain row beside it
        await settle()
        run_engine(path)
        return door.endings, door.refusals

    endings, refusals = asyncio.run(run())
    assert sorted(endings) == [(1, "error", ErrorCode.INVALID_REQUEST),
                               (2, "done", FinishReason.MAX_TOKENS)]  # fmt: skip
    assert refusals[0].field == "structured_outputs.regex"
    assert refusals[0].message == (  # the same answer whether the mask failed or raised
        "structured_outputs.regex: the grammar exceeded its limits after 2 tokens "
        "(lexer error: too many expressions constructed)"
    )
