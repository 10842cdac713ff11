"""The scheduler driven step by step (no thread, no server) over small scripted backends."""

from __future__ import annotations

import time

import numpy as np
import pytest

from zerolayer.engine.backend import Backend, ModelInfo
from zerolayer.engine.backends.synthetic import SyntheticBackend
from zerolayer.engine.engine import (
    NO_TOKEN,
    NOT_FINISHED,
    Engine,
    EngineOverloaded,
    EngineStopped,
    Output,
    Sequence,
)
from zerolayer.engine.types import DecodeBatch, PrefillChunk
from zerolayer.frames.protocol import FinishReason
from zerolayer.sampling_params import SamplingParams, sampling_rows
from zerolayer.tokenizer import ByteTokenizer, Detokenizer

TOK = ByteTokenizer()


class Scripted(Backend):
    """Emits a fixed token list per slot, records every call."""

    def __init__(self, script: list[int], num_slots: int = 4, max_context: int = 4096) -> None:
        self.num_slots = num_slots
        self.info = ModelInfo("scripted", 259, 257, max_context)
        self.script = script
        self.pos = [0] * num_slots
        self.prefills: list[list[tuple[int, int, int, bool]]] = []
        self.decodes: list[list[int]] = []
        self.freed: list[int] = []

    def _next(self, slot: int) -> int:
        t = self.script[self.pos[slot] % len(self.script)]
        self.pos[slot] += 1
        return t

    def prefill(self, chunks: list[PrefillChunk]) -> np.ndarray:
        self.prefills.append([(c.slot, c.start, len(c.tokens), c.last) for c in chunks])
        return np.array([self._next(c.slot) if c.last else -1 for c in chunks], np.int32)

    def decode(self, batch: DecodeBatch) -> np.ndarray:
        self.decodes.append(batch.slots.tolist())
        return np.array([self._next(s) for s in batch.slots.tolist()], np.int32)

    def free(self, slot: int) -> None:
        self.freed.append(slot)
        self.pos[slot] = 0


def make_engine(backend: Backend, **kw) -> tuple[Engine, list[Output]]:
    sink: list[Output] = []
    engine = Engine(
        backend,
        kw.get("tokenizer", TOK),
        sink.extend,
        max_queue=kw.get("max_queue", 16),
        max_step_tokens=kw.get("max_step_tokens", 64),
        prefill_chunk=kw.get("prefill_chunk", 32),
    )
    return engine, sink


def seq(owner, prompt=b"hi", max_tokens=10, text=True, stops=(), stop_ids=(), **sampling):
    return Sequence(
        owner,
        np.frombuffer(prompt, np.uint8).astype(np.int32),
        max_tokens,
        SamplingParams(**sampling),
        stop_ids=frozenset(stop_ids),
        stop_sequences=tuple(stops),
        detokenizer=Detokenizer(TOK) if (text or stops) else None,
    )


def run(engine: Engine, sink: list[Output], limit: int = 1000) -> dict:
    for _ in range(limit):
        sink.extend(engine.step().outputs())
        if engine.idle:
            break
    streams: dict = {}
    for owner, token, text, finish in sink:
        s = streams.setdefault(owner, {"ids": [], "text": "", "finish": None, "ends": 0})
        assert s["finish"] is None, "output after the stream ended"
        if token != NO_TOKEN:
            s["ids"].append(token)
        s["text"] += text
        if finish != NOT_FINISHED:
            s["finish"] = finish
            s["ends"] += 1
    return streams


def test_eos_ends_stream_without_sending_it():
    backend = Scripted([ord("a"), ord("b"), 257, ord("c")])
    engine, sink = make_engine(backend)
    engine.submit(seq("s"))
    res = run(engine, sink)["s"]
    assert res == {"ids": [97, 98], "text": "ab", "finish": FinishReason.EOS, "ends": 1}
    assert backend.freed == [0]


def test_ignore_eos_generates_past_it():
    # vLLM's ignore_eos (an HTTP extension): EOS is an ordinary token, sent and counted, with
    # text deltas or without (a plain row leaves the fast path to check it).
    for text in (True, False):
        backend = Scripted([ord("a"), 257, ord("c")])
        engine, sink = make_engine(backend)
        s = seq("s", max_tokens=5, text=text)
        s.ignore_eos = True
        engine.submit(s)
        res = run(engine, sink)["s"]
        assert res["ids"] == [97, 257, 99, 97, 257]
        assert res["finish"] == FinishReason.MAX_TOKENS and res["ends"] == 1
        if text:
            assert res["text"] == "aca"  # EOS has no text in the byte tokenizer


def test_max_tokens_and_stop_ids():
    engine, sink = make_engine(Scripted([ord(c) for c in "abcdefgh"]))
    engine.submit(seq("max", max_tokens=3))
    engine.submit(seq("stop", stop_ids=[ord("e")]))
    res = run(engine, sink)
    assert res["max"]["text"] == "abc" and res["max"]["finish"] == FinishReason.MAX_TOKENS
    assert res["stop"]["ids"] == [97, 98, 99, 100] and res["stop"]["finish"] == FinishReason.STOP


def test_the_stop_sequence_that_matched_is_recorded():
    """The stop string that ended the text is recorded, whatever its place in the list."""
    for stops, prompt_text, want in (
        (("cd", "b"), b"x", "b"),  # "b" comes first in "abcd..."
        (("b", "cd"), b"y", "b"),
        (("\x00", "bc", "zz"), b"z", "bc"),
    ):
        backend = Scripted([ord(c) for c in "abcdef"])
        engine, sink = make_engine(backend)
        s = seq("s", prompt_text, max_tokens=20, stops=stops)
        engine.submit(s)
        result = run(engine, sink)
        assert result["s"]["finish"] == FinishReason.STOP and result["s"]["text"] == "a"
        assert s.matched_stop == want


def test_stop_sequence_held_back_and_cut():
    engine, sink = make_engine(Scripted([ord(c) for c in "hello world!"]))
    engine.submit(seq("s", max_tokens=50, stops=["o w"]))
    res = run(engine, sink)["s"]
    assert res["text"] == "hell"
    assert res["finish"] == FinishReason.STOP
    # A partial match that does not complete is released at the end.
    engine, sink = make_engine(Scripted([ord(c) for c in "abcab"]))
    engine.submit(seq("t", max_tokens=5, stops=["abd"]))
    res = run(engine, sink)["t"]
    assert res["text"] == "abcab" and res["finish"] == FinishReason.MAX_TOKENS


def test_text_deltas_never_split_utf8():
    euro = list("€".encode())  # 3 bytes
    engine, sink = make_engine(Scripted(euro + [ord("x")] + euro[:2]))
    engine.submit(seq("u", max_tokens=6))
    run(engine, sink)
    deltas = [o.text for o in sink]
    for d in deltas:
        d.encode("utf-8")  # each delta is a valid string
    assert "".join(deltas) == "€x\ufffd"  # the unfinished tail is flushed as U+FFFD
    assert deltas[:3] == ["", "", "€"]


def test_chunked_prefill_interleaves_with_decode():
    backend = Scripted([ord("z")], num_slots=2)
    engine, sink = make_engine(backend, max_step_tokens=16, prefill_chunk=8)
    engine.submit(seq("short", prompt=b"ab", max_tokens=30))
    sink.extend(engine.step().outputs())  # short prefilled, first token out
    engine.submit(seq("long", prompt=b"x" * 40, max_tokens=2))
    for _ in range(5):
        sink.extend(engine.step().outputs())
    long_chunks = [c for step in backend.prefills[1:] for c in step]
    assert [c[2] for c in long_chunks] == [8, 8, 8, 8, 8]  # 40 tokens in chunks of 8
    assert [c[1] for c in long_chunks] == [0, 8, 16, 24, 32]
    assert long_chunks[-1][3] and not any(c[3] for c in long_chunks[:-1])
    # The short sequence kept decoding in every one of those steps.
    assert all(0 in d for d in backend.decodes[:5])


def test_step_token_budget_limits_prefill():
    backend = Scripted([ord("z")], num_slots=4)
    engine, sink = make_engine(backend, max_step_tokens=10, prefill_chunk=10)
    for i in range(3):
        engine.submit(seq(i, prompt=b"y" * 7, max_tokens=1))
    sink.extend(engine.step().outputs())
    assert sum(c[2] for c in backend.prefills[0]) == 10


def test_cancel_frees_slot_at_next_step():
    backend = Scripted([ord("a")], num_slots=1)
    engine, sink = make_engine(backend)
    s1, s2 = seq("one", max_tokens=1000), seq("two", max_tokens=2)
    engine.submit(s1)
    engine.submit(s2)
    for _ in range(3):
        sink.extend(engine.step().outputs())
    assert engine.slots_used == 1 and engine.waiting == 1
    engine.cancel(s1)
    res = run(engine, sink)
    assert res["one"]["finish"] == FinishReason.CANCELLED
    assert res["two"]["finish"] == FinishReason.MAX_TOKENS
    assert engine.slots_used == 0


def test_cancel_while_waiting():
    engine, sink = make_engine(Scripted([ord("a")], num_slots=1))
    s1, s2 = seq("one", max_tokens=5), seq("two", max_tokens=5)
    engine.submit(s1)
    engine.submit(s2)
    sink.extend(engine.step().outputs())
    engine.cancel(s2)
    res = run(engine, sink)
    assert res["two"] == {"ids": [], "text": "", "finish": FinishReason.CANCELLED, "ends": 1}
    assert engine.waiting == 0


def test_bounded_queue_refuses_with_retry_hint():
    engine, _ = make_engine(Scripted([1]), max_queue=2)
    for n in (1, 2):  # two clients (fairness keys): one alone may hold only its share
        one = seq(n)
        one.fair_key = n
        engine.submit(one)
    with pytest.raises(EngineOverloaded) as exc:
        engine.submit(seq(3))
    assert exc.value.retry_after_ms > 0
    engine.stop_accepting()
    with pytest.raises(EngineStopped):
        engine.submit(seq(4))


def test_one_client_holds_a_fair_share_of_the_queue_and_a_newcomer_is_admitted():
    """Issue #25 item 5: one client flooding does not lock the others out of the queue."""
    engine, _ = make_engine(Scripted([1]), max_queue=8)
    taken = 0
    with pytest.raises(EngineOverloaded):
        for n in range(8):
            flood = seq(n)
            flood.fair_key = "flood"
            engine.submit(flood)
            taken += 1
    assert taken == 4
    newcomer = seq("new")
    newcomer.fair_key = "newcomer"
    engine.submit(newcomer)  # admitted while the flood is queued


def test_max_context_caps_generation():
    engine, sink = make_engine(Scripted([ord("a")], max_context=8))
    engine.submit(seq("c", prompt=b"12345", max_tokens=100))
    res = run(engine, sink)["c"]
    assert len(res["ids"]) == 3 and res["finish"] == FinishReason.MAX_TOKENS


def test_backend_failure_fails_sequences_not_engine():
    class Broken(Scripted):
        def decode(self, batch):
            raise RuntimeError("device lost")

    outputs: list[Output] = []
    engine = Engine(
        Broken([1]),
        TOK,
        lambda step: outputs.extend(step.outputs()),
        max_queue=4,
        max_step_tokens=64,
        prefill_chunk=32,
    )
    engine.start()
    try:
        engine.submit(seq("x", max_tokens=5))
        for _ in range(200):
            if outputs:
                break
            time.sleep(0.01)
        assert outputs and outputs[-1].finish == -1
        assert engine.alive
        assert engine.slots_used == 0
    finally:
        engine.stop()


def test_synthetic_is_a_function_of_prompt_seed_position():
    backend = SyntheticBackend(num_slots=8, vocab_size=300, max_context=512)
    engine, sink = make_engine(backend)
    engine.submit(seq("a", prompt=b"same", max_tokens=20))
    engine.submit(seq("b", prompt=b"same", max_tokens=20))
    engine.submit(seq("c", prompt=b"other", max_tokens=20))
    engine.submit(seq("d", prompt=b"same", max_tokens=20, seed=5))
    res = run(engine, sink)
    assert res["a"]["ids"] == res["b"]["ids"]
    assert res["a"]["ids"] != res["c"]["ids"]
    assert res["a"]["ids"] != res["d"]["ids"]
    # The same prompt prefilled in two chunks gives the same tokens.
    engine, sink = make_engine(backend, prefill_chunk=2, max_step_tokens=2)
    engine.submit(seq("e", prompt=b"same", max_tokens=20))
    assert run(engine, sink)["e"]["ids"] == res["a"]["ids"]


def test_rows_stay_right_through_prefill_only_steps_and_mixed_rows():
    """A stream ends while another is still prefilling in chunks (steps with no decode row);
    plain rows, text rows and stop-id rows share batches; one is cancelled mid-prefill. Each
    stream's ids are exactly what it gets alone (synthetic ids do not depend on the batch)."""

    def kinds():
        return {
            "a": dict(prompt=b"ab", max_tokens=3, text=False),
            "long": dict(prompt=b"x" * 40, max_tokens=12, text=False),
            "text": dict(prompt=b"cd", max_tokens=15, text=True),
            "stop": dict(prompt=b"ef", max_tokens=40, text=False, stop_ids=[ord(" ")]),
        }

    solo = {}
    for name, kw in kinds().items():
        engine, sink = make_engine(SyntheticBackend(4, 300, 256), max_step_tokens=9)
        engine.submit(seq(name, **kw))
        solo[name] = run(engine, sink)[name]
    engine, sink = make_engine(SyntheticBackend(4, 300, 256), max_step_tokens=9, prefill_chunk=8)
    engine.submit(seq("a", **kinds()["a"]))
    sink.extend(engine.step().outputs())
    engine.submit(seq("long", **kinds()["long"]))  # 5 chunks: "a" ends before they are done
    doomed = seq("doomed", prompt=b"y" * 30, max_tokens=5)
    engine.submit(doomed)
    for _ in range(2):
        sink.extend(engine.step().outputs())
    engine.cancel(doomed)  # while still prefilling
    for _ in range(2):
        sink.extend(engine.step().outputs())
    for name in ("text", "stop"):
        engine.submit(seq(name, **kinds()[name]))
    together = run(engine, sink)
    assert together.pop("doomed")["finish"] == FinishReason.CANCELLED
    assert together == solo
    assert all(r["ends"] == 1 for r in together.values())
    assert engine.slots_used == 0


def test_empty_prompt_is_refused():
    engine, _ = make_engine(Scripted([1]))
    with pytest.raises(ValueError, match="prompt token"):
        engine.submit(seq("e", prompt=b""))


# ---------------------------------------------------------------------- rows and steps


def plain(owner, prompt, max_tokens, stop_ids=()):
    return seq(owner, prompt=prompt, max_tokens=max_tokens, text=False, stop_ids=stop_ids)


def test_rows_with_and_without_stop_ids_and_text_give_the_same_ids():
    """Plain rows, rows given a stop id that never comes and rows with text, alone or mixed
    into the same batches, give the same ids, finishes and counts, with rows ending at
    different steps (max_tokens, max_context) and joining while others decode."""
    prompts = {f"s{i}": (bytes([65 + i]) * (1 + i), 5 + 7 * i) for i in range(6)}
    prompts["ctx"] = (b"c" * 50, 200)  # max_context 64 ends it first

    def drive(stopping: set[str], texts: set[str] = set()):  # noqa: B006
        engine, sink = make_engine(SyntheticBackend(8, 300, 64), max_step_tokens=16)
        names = list(prompts)

        def submit(name):
            # 299: a stop id the synthetic backend never samples
            stop_ids = (299,) if name in stopping else ()
            prompt, max_tokens = prompts[name]
            engine.submit(seq(name, prompt, max_tokens, text=name in texts, stop_ids=stop_ids))

        for name in names[:3]:
            submit(name)
        sink.extend(engine.step().outputs())  # the first three prefill ...
        for name in names[3:]:  # ... and the rest join while they decode
            submit(name)
        res = run(engine, sink)
        assert engine.slots_used == 0
        for r in res.values():
            r["text"] = ""
        return res

    every = drive(set(prompts))
    assert drive(set()) == every
    assert drive({"s1", "s4", "ctx"}) == every
    assert drive(set(), texts={"s0", "s3", "ctx"}) == every
    for name, (_, max_tokens) in prompts.items():
        if name != "ctx":
            assert len(every[name]["ids"]) == max_tokens
            assert every[name]["finish"] == FinishReason.MAX_TOKENS
    assert len(every["ctx"]["ids"]) == 64 - 50 and every["ctx"]["finish"] == 1
    assert all(r["ends"] == 1 for r in every.values())


def test_a_step_output_keeps_its_owners_list_while_the_rows_stay():
    """Consecutive steps with the same rows hand out the same owners list (a consumer keys its
    per-row work on it); a row that ends or joins gives a new one. The step in which prompts
    complete already hands out the row set the next steps decode (built once per join). Counts
    are by row."""
    engine, _ = make_engine(SyntheticBackend(4, 300, 256))
    for name, max_tokens in (("short", 4), ("a", 12), ("b", 12)):
        engine.submit(plain(name, b"x" + name.encode(), max_tokens))
    steps = [engine.step() for _ in range(8)]
    assert steps[0].owners == ["short", "a", "b"] and steps[0].joined == [0, 1, 2]
    assert steps[0].counts.tolist() == [1, 1, 1]
    assert steps[0].owners is steps[1].owners is steps[2].owners is steps[3].owners
    assert steps[3].counts.tolist() == [4, 4, 4]
    assert [f.owner for f in steps[3].finished] == ["short"]  # its 4th token ends it
    assert steps[3].finished[0].n_tokens == 4 and steps[3].tokens[0] != NO_TOKEN
    assert steps[4].owners == ["a", "b"] and steps[4].owners is not steps[3].owners
    assert steps[4].owners is steps[5].owners and steps[4].joined == []


def test_decode_positions_advance_by_one():
    """Every decode step of a long sequence gets the position after the last one, also across
    a change of the rows (a shorter sequence leaves, so the slots stop being a slice)."""
    seen: list[list[int]] = []

    class Recording(SyntheticBackend):
        def decode(self, batch):  # noqa: ANN001, ANN202
            seen.append(batch.positions.tolist())
            return super().decode(batch)

    engine, sink = make_engine(Recording(4, 300, 1024))
    engine.submit(plain("long", b"abc", 200))
    engine.submit(plain("short", b"de", 70))  # leaves mid-way: rows change
    engine.submit(plain("third", b"f", 150))
    run(engine, sink)
    longs = [positions[0] for positions in seen]  # "long" holds slot 0, the first row
    shorts = [positions[1] for positions in seen if len(positions) == 3]
    thirds = [positions[-1] for positions in seen if len(positions) > 1]
    assert longs == list(range(3, 3 + 199))  # every step, one further
    assert shorts == list(range(2, 2 + 69))
    assert thirds == list(range(1, 1 + 149))


def test_eos_in_the_middle_of_steps():
    for eos in (257, 258):  # the tokenizer's only EOS id, or one of two
        backend = Scripted([ord(c) for c in "abcdefgh"] + [eos] + [ord("z")] * 100)
        tokenizer = ByteTokenizer()
        tokenizer.eos_token_ids = frozenset({257, eos})
        engine, sink = make_engine(backend, tokenizer=tokenizer)
        engine.submit(plain("eos", b"x", max_tokens=50))
        engine.submit(plain("short", b"y", max_tokens=4))
        engine.submit(seq("text", b"z", max_tokens=50))  # a text row in the same batches
        res = run(engine, sink)
        assert res["eos"] == {"ids": list(b"abcdefgh"), "text": "", "finish": 0, "ends": 1}
        assert res["short"]["ids"] == list(b"abcd") and res["short"]["finish"] == 1
        assert res["text"] == {"ids": list(b"abcdefgh"), "text": "abcdefgh", "finish": 0, "ends": 1}


def test_cancel_and_new_rows_in_the_middle_of_steps():
    """A cancel and a text row arriving mid-way: the other rows' counters stay exact."""

    def solo(name, **kw):
        engine, sink = make_engine(SyntheticBackend(4, 300, 256))
        engine.submit(seq(name, **kw))
        return run(engine, sink)[name]

    kw_a = dict(prompt=b"aa", max_tokens=30, text=False)
    kw_t = dict(prompt=b"tt", max_tokens=9, text=True)
    engine, sink = make_engine(SyntheticBackend(4, 300, 256))
    doomed = plain("doomed", b"dd", 30)
    engine.submit(seq("a", **kw_a))
    engine.submit(doomed)
    for _ in range(6):
        sink.extend(engine.step().outputs())
    engine.cancel(doomed)
    engine.submit(seq("text", **kw_t))
    res = run(engine, sink)
    assert res["doomed"]["finish"] == FinishReason.CANCELLED and res["doomed"]["ends"] == 1
    assert len(res["doomed"]["ids"]) == 6  # the prefill's token, then 5 decode steps
    assert res["a"] == solo("a", **kw_a)
    assert res["text"] == solo("text", **kw_t)
    assert engine.slots_used == 0


def test_byte_tokenizer_decode_skips_special_ids_from_lists_and_arrays():
    ids = [104, 105, 256, 257, 0xE2, 0x82, 0xAC]  # "hi", BOS, EOS, then "€"
    assert TOK.decode(ids) == "hi€"
    assert TOK.decode(np.array(ids, np.int32)) == "hi€"
    assert TOK.decode([104, 105]) == TOK.decode(np.array([104, 105], np.int32)) == "hi"
    assert TOK.decode([0xE2, 0x82]) == "\ufffd"


def _pages(backend: SyntheticBackend, slot: int, start: int, end: int) -> None:
    """Reserve a slot's pages for a write, as the engine does before a call."""
    assert backend.kv_pages.prepare_write(slot, start, end) == []


def test_synthetic_decode_is_prefill_of_the_ids_through_any_page_mapping():
    """A decode step's token is the one prefilling the same ids samples; the digests live where
    the page tables say, so a page mapped to another row's page gives other tokens."""
    backend = SyntheticBackend(num_slots=3, vocab_size=300, max_context=64)
    prompt = np.array([5, 9, 11], np.int32)
    greedy = sampling_rows([SamplingParams()])

    def decode(slot: int, token: int, position: int) -> int:
        _pages(backend, slot, position, position + 1)
        batch = DecodeBatch(
            np.array([slot], np.int32),
            np.array([token], np.int32),
            np.array([position], np.int32),
            greedy,
        )
        return int(backend.decode(batch)[0])

    _pages(backend, 0, 0, 3)
    ids = list(prompt)
    token = int(backend.prefill([PrefillChunk(0, prompt, 0, True, SamplingParams())])[0])
    for position in range(3, 40):  # across two page boundaries
        ids.append(token)
        token = decode(0, token, position)
        again = np.array(ids, np.int32)  # slot 1: the same ids prefilled
        backend.kv_pages.release(1)
        _pages(backend, 1, 0, len(again))
        chunk = PrefillChunk(1, again, 0, True, SamplingParams())
        assert int(backend.prefill([chunk])[0]) == token, position
    # slot 2 maps slot 0's first page and a page of zeros as its second: other tokens at
    # positions 17..19, while slot 0's own second page gives slot 0's tokens
    pool = backend.kv_pages
    blank = pool.alloc(1)
    assert blank is not None
    backend._kv[int(blank[0]) * 16 : int(blank[0]) * 16 + 16] = 0
    pool.map(2, 0, np.concatenate([pool.pages_of(0)[:1], blank]))
    pool.decref(blank)  # slot 2 alone holds it
    right = [decode(1, ids[p], p) for p in (17, 18, 19)]
    wrong = [decode(2, ids[p], p) for p in (17, 18, 19)]
    assert right == [ids[18], ids[19], ids[20]]
    assert wrong != right


def test_synthetic_rows_decoding_on_keep_prefills_tokens_and_write_through_the_tables():
    """The same rows step after step go on from their running digests (one cache, kept), yet
    every token is the one prefilling the same ids samples (another backend, so nothing here
    touches the rows), and every digest lands where the page tables say: after a copy on write
    in mid-page, in the copy, the shared page left as it was."""
    sizes, seeds = [3, 10, 5], [None, None, 12345]
    backend = SyntheticBackend(num_slots=3, vocab_size=300, max_context=96)
    reference = SyntheticBackend(num_slots=1, vocab_size=300, max_context=96)
    params = [SamplingParams(seed=s) for s in seeds]
    rng = np.random.default_rng(3)
    ids = [list(rng.integers(0, 300, n)) for n in sizes]
    for slot, n in enumerate(sizes):
        _pages(backend, slot, 0, n)
    chunks = [PrefillChunk(i, np.array(ids[i], np.int32), 0, True, params[i]) for i in range(3)]
    tokens = backend.prefill(chunks)
    slots, sampling = np.arange(3, dtype=np.int32), sampling_rows(params)
    pool, cache, held, index = backend.kv_pages, None, None, -1
    for step in range(40):  # every row across two page boundaries, at its own offsets
        for i in range(3):
            ids[i].append(int(tokens[i]))
        positions = np.array([len(row) - 1 for row in ids], np.int32)
        copies = []
        for i in range(3):
            got = pool.prepare_write(i, int(positions[i]), int(positions[i]) + 1)
            assert got is not None
            copies += got
        if copies:
            backend.copy_pages(copies)
        tokens = backend.decode(DecodeBatch(slots, tokens.copy(), positions, sampling))
        for i in range(3):
            reference.kv_pages.release(0)
            _pages(reference, 0, 0, len(ids[i]))
            chunk = PrefillChunk(0, np.array(ids[i], np.int32), 0, True, params[i])
            assert int(reference.prefill([chunk])[0]) == int(tokens[i]), (step, i)
        cache = cache or backend._rows
        assert backend._rows is cache  # the same rows: never read from their pages again
        if step == 20:  # slot 1's page is shared (a saved range): its next write copies it
            at = int(positions[1]) + 1
            assert at % 16, "mid-page"
            index = at // 16
            held = backend.save_kv(1, index * 16, at)
            shared = backend._kv[int(held[0]) * 16 : int(held[0]) * 16 + 16].copy()
    assert held is not None
    assert int(pool.tables[1, index]) != int(held[0])  # slot 1 writes into its copy
    assert backend._kv[int(held[0]) * 16 : int(held[0]) * 16 + 16].tolist() == shared.tolist()
    for i in range(3):  # every position's digest, read through the tables, is the prefill's
        n = len(ids[i])
        reference.kv_pages.release(0)
        _pages(reference, 0, 0, n)
        reference.prefill([PrefillChunk(0, np.array(ids[i], np.int32), 0, True, params[i])])
        where = np.arange(n - 1)  # the last id is an input not yet decoded
        mine = backend._kv[backend._where(np.full(n - 1, i), where)]
        theirs = reference._kv[reference._where(np.zeros(n - 1, np.intp), where)]
        assert mine.tolist() == theirs.tolist(), i


def test_synthetic_prefill_of_many_chunks_equals_one_chunk_at_a_time():
    """Chunks fold side by side; the digests and first tokens are those of folding each chunk
    alone, in order, id by id (the reference below)."""
    from zerolayer.engine.backends.synthetic import _FOLD, synthetic_tokens
    from zerolayer.kernels.splitmix import splitmix64 as _mix

    def reference(digest: np.ndarray, chunk: PrefillChunk) -> int:
        d0 = 0 if chunk.start == 0 else int(digest[chunk.slot])
        for t in chunk.tokens.tolist():  # d = d * _FOLD + mix(id), id by id, in Python ints
            d0 = (d0 * _FOLD + int(_mix(np.array([t], np.uint64))[0])) % 2**64
        d = np.array([d0], np.uint64)
        after = d0
        token = -1
        if chunk.last:
            if chunk.sampling.seed is not None:
                d = _mix(d ^ np.uint64(chunk.sampling.seed))
            end = np.array([chunk.start + len(chunk.tokens)], np.uint64)
            token = int(synthetic_tokens(d, end)[0])
        digest[chunk.slot] = after
        return token

    rng = np.random.default_rng(7)
    backend = SyntheticBackend(num_slots=6, vocab_size=300, max_context=512)
    digest = np.zeros(6, np.uint64)
    starts = [0] * 6
    for _ in range(40):
        slots = rng.choice(6, size=int(rng.integers(1, 7)), replace=bool(rng.integers(0, 2)))
        chunks = []
        for slot in slots.tolist():
            n = int(rng.integers(1, 9))
            last = bool(rng.integers(0, 2))
            seed = int(rng.integers(0, 2**63)) * 2 + 1
            sampling = SamplingParams(seed=seed if rng.integers(0, 2) else None)
            ids = rng.integers(0, 300, n).astype(np.int32)
            chunks.append(PrefillChunk(slot, ids, starts[slot], last, sampling))
            starts[slot] = 0 if last else starts[slot] + n
        want = [reference(digest, chunk) for chunk in chunks]
        for chunk in chunks:
            _pages(backend, chunk.slot, chunk.start, chunk.start + len(chunk.tokens))
        assert backend.prefill(chunks).tolist() == want
        final = {chunk.slot: chunk for chunk in chunks}  # each slot's last chunk of the call
        for slot, chunk in final.items():  # its digest after it, read through its pages
            end = chunk.start + len(chunk.tokens) - 1
            got = backend._kv[backend._where(np.array([slot]), np.array([end]))]
            assert int(got[0]) == int(digest[slot])
            if chunk.last:
                backend.kv_pages.release(slot)


# ---------------------------------------------------------------------- failures stay local


def test_a_sequence_that_cannot_be_admitted_ends_alone():
    """A value the per-slot arrays cannot hold (the input processor refuses it first; this is
    the engine's own guard) ends that sequence with an error; the others run on."""
    engine, sink = make_engine(Scripted([5, 6, 7]))
    engine.submit(seq("bad", max_tokens=3, top_k=2**31))
    engine.submit(seq("good", max_tokens=3))
    got = run(engine, sink)
    finishes = {o.owner: o.finish for o in sink if o.finish != NOT_FINISHED}
    assert finishes == {"bad": FinishReason.ERROR, "good": FinishReason.MAX_TOKENS}
    assert got["good"]["ids"] == [5, 6, 7] and engine.slots_used == 0


def test_a_backend_failure_of_one_row_ends_only_that_sequence():
    class PoisonedSlot(Scripted):
        """Fails every call whose batch includes slot 1 (as a bad row would)."""

        def decode(self, batch):
            if 1 in batch.slots.tolist():
                raise RuntimeError("bad row")
            return super().decode(batch)

        def prefill(self, chunks):
            if any(c.slot == 1 for c in chunks) and len(chunks) > 1:
                raise RuntimeError("batched prefill with the bad row")
            return super().prefill(chunks)

    engine, sink = make_engine(PoisonedSlot([5, 6, 7, 8]))
    for name in ("a", "b", "c"):  # slots 0, 1, 2
        engine.submit(seq(name, max_tokens=6))
    got = run(engine, sink)
    finishes = {o.owner: o.finish for o in sink if o.finish != NOT_FINISHED}
    assert finishes == {
        "a": FinishReason.MAX_TOKENS,
        "b": FinishReason.ERROR,
        "c": FinishReason.MAX_TOKENS,
    }
    assert len(got["a"]["ids"]) == len(got["c"]["ids"]) == 6 and engine.slots_used == 0


def test_stop_closes_the_backend_on_the_engine_thread():
    import threading

    from zerolayer.engine.compute import ComputeThread

    closed_on: list[int] = []

    class Closing(Scripted):
        def close(self) -> None:
            closed_on.append(threading.get_ident())

    compute = ComputeThread("test-close")
    engine = Engine(
        Closing([1]), TOK, lambda step: None, max_queue=4, max_step_tokens=64, prefill_chunk=8
    )
    engine.start(compute)
    engine_thread = compute.thread.ident
    engine.stop()
    assert closed_on == [engine_thread]


def test_admission_is_round_robin_across_fairness_keys():
    """One client queues 12 sequences, another then sends one: it gets the next free slot
    instead of waiting behind all 12 (2 slots, each sequence 4 tokens)."""
    engine, sink = make_engine(
        Scripted([5, 6, 7, 8], num_slots=2), max_queue=32
    )  # A: 12 < its share
    order: list[str] = []
    for i in range(12):
        engine.submit(
            Sequence(f"a{i}", np.array([1, 2], np.int32), 4, SamplingParams(), fair_key="A")
        )
    engine.step()  # a0 and a1 take both slots
    engine.submit(Sequence("b", np.array([1, 2], np.int32), 4, SamplingParams(), fair_key="B"))
    for _ in range(200):
        for out in engine.step().outputs():
            if out.finish != NOT_FINISHED:
                order.append(out.owner)
        if engine.idle:
            break
    assert len(order) == 13
    assert order.index("b") <= 3  # after at most the two running and one more of A's
