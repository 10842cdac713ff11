"""n > 1 on the request path (zerolayer.request_path.lifecycle): one request, n choice streams of
the door, each written separately; the hooks see one request (on_done once, after the last choice,
with the choices' tokens summed; the prompt charged once); a refusal ends every choice."""

from __future__ import annotations

from tests.unit.test_lifecycle import make_path, run_engine
from zerolayer.codes import ErrorCode, FinishReason, Refusal
from zerolayer.engine.engine import StepOutput
from zerolayer.hooks import Completion, Principal
from zerolayer.request_path.lifecycle import RequestPath
from zerolayer.request_path.request import Request
from zerolayer.request_path.stream import Stream
from zerolayer.sampling_params import SamplingParams


class ChoiceDoor:
    """Records what the path writes, by (key, choice)."""

    def __init__(self) -> None:
        self.open = True
        self.dirty = False
        self.label = "c"
        self.peer_ip = "127.0.0.1"
        self.tokens: dict[tuple[int, int], list[int]] = {}
        self.endings: list[tuple[int, int, str, object]] = []
        self.ended: list[Stream] = []
        self.messages: list[str] = []

    def write_cached(self, st: Stream, ids: list[int], text: str) -> int:
        raise AssertionError("an n > 1 request is never answered from the cache")

    def write_done(self, st: Stream, finish: FinishReason, timings: tuple) -> None:
        self.endings.append((st.key, st.choice, "done", finish))

    def write_error(self, st: Stream, error: Refusal) -> None:
        self.endings.append((st.key, st.choice, "error", error.code))
        self.messages.append(error.message)

    def stream_ended(self, st: Stream) -> None:
        self.ended.append(st)

    def flush(self) -> None:
        self.dirty = False


class Writer:
    def __init__(self, streams: list[Stream], rows: list[int]) -> None:
        self.rows = list(zip(rows, streams, strict=True))
        self.doors = [st.door for st in streams]

    def write(self, step: StepOutput) -> int:
        for i, st in self.rows:
            token = int(step.tokens[i])
            if token >= 0:
                st.door.tokens.setdefault((st.key, st.choice), []).append(token)  # type: ignore[attr-defined]
        return 0


ChoiceDoor.encoder = Writer  # type: ignore[attr-defined]


def recording(path: RequestPath) -> list[Completion]:
    done: list[Completion] = []
    on_done = path.chain.on_done

    def record(ctx, completion: Completion) -> None:  # noqa: ANN001
        done.append(completion)
        on_done(ctx, completion)

    path.chain.on_done = record  # type: ignore[method-assign]
    return done


def test_three_choices_one_request_for_the_hooks() -> None:
    path, door = make_path(async_gate=False), ChoiceDoor()
    done = recording(path)
    st = Stream(door, 7, "openai")
    req = Request(
        max_tokens=4, prompt_text="hello", n=2, sampling=SamplingParams(seed=11, temperature=1.0)
    )
    path.open(st, Principal("anonymous"), req)
    assert st.group is not None and [m.choice for m in st.group] == [0, 1]
    run_engine(path)
    assert sorted(door.endings) == [(7, 0, "done", FinishReason.MAX_TOKENS),
                                    (7, 1, "done", FinishReason.MAX_TOKENS)]  # fmt: skip
    assert len(door.tokens[(7, 0)]) == len(door.tokens[(7, 1)]) == 4
    assert door.tokens[(7, 0)] != door.tokens[(7, 1)]  # their own seed streams
    assert len(done) == 1  # one request
    assert done[0].completion_tokens == 8 and done[0].prompt_tokens == st.prompt_tokens > 0
    assert all(m.n_ids == 4 for m in st.group)


def test_a_refusal_ends_every_choice() -> None:
    path, door = make_path(async_gate=False), ChoiceDoor()
    st = Stream(door, 3, "openai")
    req = Request(
        max_tokens=4, prompt_text="hello", n=2, sampling=SamplingParams(logit_bias={999: 1.0})
    )
    path.open(st, Principal("anonymous"), req)
    assert sorted(door.endings) == [(3, 0, "error", ErrorCode.INVALID_REQUEST),
                                    (3, 1, "error", ErrorCode.INVALID_REQUEST)]  # fmt: skip
    assert len(door.ended) == 2


def test_n_above_the_maximum_is_refused_naming_n() -> None:
    path, door = make_path(async_gate=False), ChoiceDoor()
    path.inputs.max_n = 2
    st = Stream(door, 4, "openai")
    path.open(st, Principal("anonymous"), Request(max_tokens=4, prompt_text="hi", n=3))
    assert [e[2:] for e in door.endings] == [("error", ErrorCode.INVALID_REQUEST)] * 3
    assert all(m.startswith("n must be at most 2") for m in door.messages)
