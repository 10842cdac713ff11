"""Protocol version 2 on the frame door, in process (synthetic engine, fake transport): LOGPROBS
frames beside the TOKEN frames, the processing block reaching the engine, a version 1
connection refused the new fields (naming them) while its plain requests work as before, and
bad #27 input refused on its own stream with the connection and its other streams unaffected."""

from __future__ import annotations

import math

from tests.support.inproc import connect, make_server, send
from zerolayer.frames import protocol as p
from zerolayer.frames.protocol import ErrorCode, FrameType


def run(server) -> None:  # noqa: ANN001
    engine = server.path.engine
    for _ in range(300):
        server.path.deliver([engine.step()])
        if engine.idle:
            break


def frames(data: bytes) -> list[tuple[int, int, memoryview]]:
    dec = p.FrameDecoder("client", 1 << 20)
    dec.feed(bytes(data))
    out = []
    while (frame := dec.next_frame()) is not None:
        ftype, _, stream, payload = frame
        out.append((ftype, stream, memoryview(bytes(payload))))
    return out


def test_logprobs_frames_follow_each_token_frame_on_version_2() -> None:
    server, _ = make_server()
    conn, t = connect(server)
    send(conn, p.encode_hello(b"", 2))
    send(conn, p.encode_request(1, [5, 6, 7], 6, logprobs=True, top_logprobs=3))
    send(conn, p.encode_request(2, [5, 6, 7], 6))  # the same prompt, no logprobs
    run(server)
    got = frames(t.data)
    assert p.parse_welcome(got[0][2]).version == 2
    one = [(f, b) for f, s, b in got if s == 1]
    kinds = [f for f, _ in one]
    assert kinds == [FrameType.TOKEN, FrameType.LOGPROBS] * 6 + [FrameType.DONE]
    for (_, token), (_, lps) in zip(one[0:-1:2], one[1:-1:2], strict=True):
        ids, _ = p.parse_token(token)
        lp, top_ids, top = p.parse_logprobs(lps)
        assert lp.shape == (1,) and top_ids.shape == (1, 3)
        # The synthetic backend's made-up distribution: its token is the argmax, and the
        # logprobs are those of a softmax (they sum to at most 1, descending).
        assert top_ids[0, 0] == ids[0] and lp[0] == top[0, 0]
        assert top[0, 0] >= top[0, 1] >= top[0, 2] and math.exp(top[0, 0]) <= 1.0
    assert {f for f, s, _ in got if s == 2} == {FrameType.TOKEN, FrameType.DONE}
    ids1 = [int(p.parse_token(b)[0][0]) for f, b in one if f == FrameType.TOKEN]
    ids2 = [int(p.parse_token(b)[0][0]) for f, s, b in got if s == 2 and f == FrameType.TOKEN]
    assert ids1 == ids2  # asking for logprobs does not change the tokens


def test_logit_bias_from_the_processing_block_reaches_the_engine() -> None:
    server, _ = make_server()
    conn, t = connect(server)
    send(conn, p.encode_hello(b"", 2))
    send(conn, p.encode_request(1, [5, 6], 5, logit_bias={42: 100.0}))
    send(conn, p.encode_request(2, [5, 6], 5))
    run(server)
    by = {1: [], 2: []}
    for f, s, b in frames(t.data):
        if f == FrameType.TOKEN:
            by[s] += p.parse_token(b)[0].tolist()
    assert by[1] == [42] * 5 and by[2] != by[1]


def test_a_version_1_connection_is_refused_the_new_fields_by_name() -> None:
    server, _ = make_server()
    conn, t = connect(server)  # no HELLO: version 1
    send(conn, p.encode_request(1, [5, 6], 3, logprobs=True))
    send(conn, p.encode_request(2, [5, 6], 3, presence_penalty=0.5))
    send(conn, p.encode_json_request(3, {"max_tokens": 3, "prompt": "hi", "min_tokens": 2}))
    send(conn, p.encode_request(4, [5, 6], 3))  # a version 1 request: served as before
    send(conn, p.encode_json_request(5, {"max_tokens": 3, "prompt": "hi", "min_p": 0.1}))
    run(server)
    got = frames(t.data)
    errors = {s: p.parse_error(b) for f, s, b in got if f == FrameType.ERROR}
    assert {s: e[0] for s, e in errors.items()} == {1: 7, 2: 7, 3: 7, 5: 7}
    assert "min_p" in errors[5][2] and "version 2" in errors[5][2]
    assert "logprobs" in errors[1][2] and "presence_penalty" in errors[2][2]
    assert "min_tokens" in errors[3][2] and "version 2" in errors[1][2]
    assert [f for f, s, _ in got if s == 4][-1] == FrameType.DONE
    assert not any(f == FrameType.LOGPROBS for f, _, _ in got)
    assert not t.closed


def test_bad_input_is_refused_on_its_stream_naming_the_field() -> None:
    server, _ = make_server()
    conn, t = connect(server)
    send(conn, p.encode_hello(b"", 2))
    send(conn, p.encode_request(9, [5, 6], 8))  # in flight meanwhile
    bad = {
        1: p.encode_json_request(1, {"max_tokens": 3, "prompt": "hi", "n": 2}),
        2: p.encode_json_request(
            2, {"max_tokens": 3, "prompt": "hi", "logprobs": True, "top_logprobs": 21}
        ),
        3: p.encode_request(3, [5, 6], 3, logit_bias={300: 1.0}),  # vocabulary is 300
        4: p.encode_json_request(4, {"max_tokens": 3, "prompt": "hi", "top_logprobs": 2}),
        5: p.encode_json_request(5, {"max_tokens": 3, "prompt": "hi", "logit_bias": {"x": 1}}),
        6: p.encode_request(6, [5, 6], 3, repetition_penalty=0.0),
        7: p.encode_json_request(7, {"max_tokens": 3, "prompt": "hi", "presence_penalty": 2.5}),
        8: p.encode_request(8, [5, 6], 3, logit_bias={5: 101.0}),
    }
    names = {1: "n", 2: "top_logprobs", 3: "logit_bias", 4: "top_logprobs", 5: "logit_bias",
             6: "repetition_penalty", 7: "presence_penalty", 8: "logit_bias"}  # fmt: skip
    for frame in bad.values():
        send(conn, frame)
    run(server)
    got = frames(t.data)
    errors = {s: p.parse_error(b) for f, s, b in got if f == FrameType.ERROR}
    assert sorted(errors) == sorted(bad)
    for s, (code, _, message) in errors.items():
        assert code == ErrorCode.INVALID_REQUEST and names[s] in message, (s, message)
    assert [f for f, s, _ in got if s == 9][-1] == FrameType.DONE
    assert sum(1 for f, s, _ in got if s == 9 and f == FrameType.TOKEN) == 8
    assert not t.closed


def test_hello_with_an_unknown_version_names_both_it_speaks() -> None:
    server, _ = make_server()
    conn, t = connect(server)
    send(conn, p.encode_hello(b"", 3))
    (ftype, stream, body), *_ = frames(t.data)
    code, _, message = p.parse_error(body)
    assert (ftype, stream, code) == (FrameType.ERROR, 0, ErrorCode.UNSUPPORTED_VERSION)
    assert "1 and 2" in message
