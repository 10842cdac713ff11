"""A request of k inputs on the request path (an embeddings batch): k streams of the door, each
its own engine sequence; the hooks see ONE request (on_request and on_done once, its prompt the
inputs' ids together, each input's prompt charged once); a refusal of one input, or a full
queue, ends every input's stream with the same error."""

from __future__ import annotations

import numpy as np

from tests.unit.test_lifecycle import make_path, run_engine
from tests.unit.test_lifecycle_choices import ChoiceDoor, recording
from zerolayer.codes import ErrorCode, FinishReason
from zerolayer.hooks import Principal
from zerolayer.request_path.request import Request
from zerolayer.request_path.stream import Stream

INPUTS: list[str | np.ndarray] = ["hello", "a longer input", np.array([1, 2, 3], np.int32)]


def embed_request(inputs: list[str | np.ndarray] = INPUTS) -> Request:
    return Request(max_tokens=0, embed=True, inputs=list(inputs))


def test_three_inputs_are_one_request_for_the_hooks_and_three_sequences() -> None:
    path, door = make_path(async_gate=False), ChoiceDoor()
    done = recording(path)
    seen = []
    on_request = path.chain.on_request

    def count(ctx):  # noqa: ANN001, ANN202
        seen.append(len(ctx.prompt_ids))
        return on_request(ctx)

    path.chain.on_request = count  # type: ignore[method-assign]
    st = Stream(door, 5, "openai")
    path.open(st, Principal("anonymous"), embed_request())
    assert st.group is not None and [m.choice for m in st.group] == [0, 1, 2]
    run_engine(path)
    assert sorted(door.endings) == [(5, i, "done", FinishReason.MAX_TOKENS) for i in range(3)]
    lengths = [m.prompt_tokens for m in st.group]
    assert lengths == [1 + len("hello"), 1 + len("a longer input"), 3]  # BOS + bytes; ids as given
    for member in st.group:
        assert member.seq is not None and member.seq.pooled is not None and member.n_ids == 0
        assert abs(float(np.linalg.norm(member.seq.pooled)) - 1.0) < 1e-5
    assert seen == [sum(lengths)]  # one request, all the inputs' ids
    assert len(done) == 1
    assert (done[0].prompt_tokens, done[0].completion_tokens) == (sum(lengths), 0)
    assert path.engine.idle and path.engine.slots_used == 0


def test_one_bad_input_refuses_the_request_naming_it() -> None:
    path, door = make_path(async_gate=False), ChoiceDoor()
    st = Stream(door, 6, "openai")
    path.open(st, Principal("anonymous"), embed_request(["ok", np.array([1, 999], np.int32)]))
    assert sorted(door.endings) == [(6, i, "error", ErrorCode.INVALID_REQUEST) for i in range(2)]
    assert all(m.startswith("input[1]") for m in door.messages)
    assert path.engine.idle


def test_a_full_queue_refuses_every_input_and_leaves_nothing_running() -> None:
    path, door = make_path(async_gate=False), ChoiceDoor()
    path.engine._max_queue = 2  # room for two of the three inputs
    st = Stream(door, 8, "openai")
    path.open(st, Principal("anonymous"), embed_request())
    assert sorted(door.endings) == [(8, i, "error", ErrorCode.OVERLOADED) for i in range(3)]
    run_engine(path)  # the two submitted leave the engine, cancelled
    assert path.engine.idle and path.engine.slots_used == 0 and path.engine.waiting == 0
    assert len(door.endings) == 3  # and end nothing a second time


def test_large_inputs_are_prepared_off_the_loop_and_refused_naming_the_input() -> None:
    """Over 16 KiB of input text is tokenized on the offload pool (phase PREPARING); a refusal
    from there ends every input's stream, naming the input."""
    import asyncio

    from zerolayer.request_path.stream import PREPARING

    async def main() -> None:
        path, door = make_path(async_gate=False), ChoiceDoor()
        st = Stream(door, 9, "openai")
        path.open(st, Principal("anonymous"), embed_request(["x" * 9000, "y" * 9000]))
        assert st.phase is PREPARING and door.endings == []
        await asyncio.gather(*path.hook_tasks)
        assert sorted(door.endings) == [(9, i, "error", ErrorCode.PROMPT_TOO_LONG) for i in (0, 1)]
        assert all(m.startswith("input[0]") for m in door.messages)

    asyncio.run(main())
