"""The output path in process: engine steps → output processor → frame door (a fake
transport; no loop, socket or engine thread).

The frame door's encoder (TokenFrames: prebuilt one-id frames filled per step, text frames for
streams that want text) must write exactly the ids each step gave each stream, and leave the
same counts and response-cache recordings, however steps are grouped into deliveries and
whatever ends a stream between them.
"""

from __future__ import annotations

import numpy as np

from tests.support.inproc import connect, make_server, send
from zerolayer.frames import protocol as p
from zerolayer.frames.protocol import ErrorCode, FrameType
from zerolayer.hooks import Completion


def frames(data: bytes) -> list[tuple[int, int, bytes]]:
    """(type, stream, payload) per frame, with DONE's three timings zeroed (they are clocks)."""
    dec = p.FrameDecoder("client", 1 << 20)
    dec.feed(bytes(data))
    out = []
    while (frame := dec.next_frame()) is not None:
        ftype, _, stream, payload = frame
        body = bytes(payload)
        if ftype == FrameType.DONE:
            body = body[:12] + bytes(12)
        out.append((ftype, stream, body))
    return out


REQUESTS = [
    # (stream, prompt ids, max_tokens, options)
    (1, [5, 6, 7], 40, {}),
    (2, [8] * 20, 25, {}),  # prefills in two chunks
    (3, [9, 10], 60, {}),  # reaches max_context
    (4, [11], 30, {"text_deltas": True}),  # a text row: the engine's per-token path
    (5, [12, 13], 35, {"stop_ids": [ord(" ")]}),
    (6, [14], 30, {"temperature": 0.5}),  # sampled without a seed: not recorded
]


def serve(group: int, script: dict[int, str] | None = None) -> tuple:
    """Run REQUESTS over two connections (odd streams on one, even on the other), delivering
    ``group`` engine steps at a time; ``script`` maps a step number to an event. Returns each
    connection's frames, the completions, and each stream's ids as the engine's steps gave
    them, by (connection, stream id), up to the stream's end."""
    server, completions = make_server()
    (a, ta), (b, tb) = connect(server), connect(server)
    for stream, prompt, max_tokens, opts in REQUESTS:
        send(a if stream % 2 else b, p.encode_request(stream, prompt, max_tokens, **opts))
    engine, steps, deliveries = server.path.engine, [], 0
    deliver = server.path.deliver
    given: dict[tuple[str, int], list[int]] = {}
    seen = []
    for i in range(500):
        event = (script or {}).get(i)
        if event == "cancel 3":
            send(a, p.encode_cancel(3))
        elif event == "late 7":
            send(b, p.encode_request(8, [20, 21], 20))
        elif event == "slow b":
            b.end_all_streams(ErrorCode.SLOW_CONSUMER, "client is not reading its output")
        steps.append(engine.step())
        seen.append(steps[-1])
        if len(steps) == group:
            deliver(steps)
            deliveries += 1
            steps = []
        if engine.idle:
            break
    deliver(steps)
    deliveries += 1
    for step in seen:
        for out in step.outputs():
            st = out.owner
            if out.token >= 0:
                given.setdefault((st.door.label, st.key), []).append(out.token)
    if not script:  # one write per connection per delivery, however many steps it carries
        assert ta.writes <= deliveries and tb.writes <= deliveries
    return frames(ta.data), frames(tb.data), completions, given


def completion_key(c: Completion) -> tuple:
    ids = None if c.token_ids is None else c.token_ids.tolist()
    return (c.finish_reason, c.prompt_tokens, c.completion_tokens, ids, c.text)


def ids_by_stream(conn_frames: list) -> dict[int, list[int]]:
    ids: dict[int, list[int]] = {}
    for ftype, stream, body in conn_frames:
        if ftype == FrameType.TOKEN:
            ids.setdefault(stream, []).extend(p.parse_token(memoryview(body))[0])
    return ids


def by_stream(conn_frames: list) -> dict[int, list[tuple[int, bytes]]]:
    out: dict[int, list[tuple[int, bytes]]] = {}
    for ftype, stream, body in conn_frames:
        out.setdefault(stream, []).append((ftype, body))
    return out


def check_same(script: dict[int, str] | None = None) -> None:
    ref = None
    for group in (1, 3, 8):
        got_a, got_b, got_done, given = serve(group=group, script=script)
        # Each stream got exactly the ids the engine's steps gave it (until it ended) ...
        for label, conn_frames in (("1", got_a), ("2", got_b)):
            ended = {s for t, s, _ in conn_frames if t in (FrameType.DONE, FrameType.ERROR)}
            for stream, ids in ids_by_stream(conn_frames).items():
                want = given[(label, stream)]
                assert ids == want[: len(ids)], f"stream {stream}, group {group}"
                if stream in ended and not script:
                    assert ids == want
        # ... each stream the same frames whatever the grouping into deliveries (the order
        # between streams of one connection is free; a script's events land at different
        # points of the output when deliveries lag the engine by more steps) ...
        key = (by_stream(got_a), by_stream(got_b), sorted(map(completion_key, got_done), key=str))
        if ref is None:
            ref = key
        if not script:
            assert key == ref, f"frames differ, group {group}"
        # ... every stream ended once (DONE or ERROR), and DONE counts its TOKEN frames' ids.
        for conn_frames in (got_a, got_b):
            counts: dict[int, int] = {}
            for ftype, stream, body in conn_frames:
                if ftype == FrameType.TOKEN:
                    ids = p.parse_token(memoryview(body))[0]
                    counts[stream] = counts.get(stream, 0) + len(ids)
                elif ftype == FrameType.DONE:
                    done = p.parse_done(memoryview(body))
                    assert done.completion_tokens == counts.pop(stream, 0)
                elif ftype == FrameType.ERROR:
                    counts.pop(stream, 0)
            assert not counts


def test_frames_carry_each_steps_ids():
    check_same()


def test_frames_with_cancel_late_stream_and_slow_consumer():
    check_same({12: "cancel 3", 15: "late 7", 20: "slow b"})


def test_records_for_the_response_cache():
    _, _, completions, _ = serve(group=4)
    recorded = [c for c in completions if c.token_ids is not None]
    assert len(recorded) == 5  # all but stream 6
    for c in recorded:
        assert len(c.token_ids) == c.completion_tokens
        assert c.text == "".join(chr(i) for i in c.token_ids.tolist())


def test_token1_frames_match_pack_token1_into():
    frames1 = p.token1_frames(np.array([1, 2**32 - 1, 77]))
    frames1[:, p.TOKEN1_ID] = [0, 299, 2**31 - 1]
    buf = bytearray(60)
    off = 0
    for stream, token in ((1, 0), (2**32 - 1, 299), (77, 2**31 - 1)):
        off = p.pack_token1_into(buf, off, stream, token, b"")
    assert frames1.tobytes() == bytes(buf)
