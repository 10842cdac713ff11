"""The finish rules (zerolayer.engine.finish): each rule's finish, the precedence between rules
that fire on the same token, whether the token is produced, and the same outcomes through the
engine's steps on scripted backends (what a stream gets: ids, text, finish, its count)."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from tests.unit.test_engine import Scripted, make_engine, seq
from zerolayer.codes import FinishReason
from zerolayer.engine import finish
from zerolayer.engine.backend import ModelInfo
from zerolayer.engine.engine import NO_TOKEN, NOT_FINISHED, Engine
from zerolayer.engine.step import Finished
from zerolayer.tokenizer import ByteTokenizer, Detokenizer

EOS = ByteTokenizer.EOS
A, B, C, X = (ord(c) for c in "abcx")

# The precedence, highest first, written out here so that a change to it shows in this file.
ORDER = [
    (finish.CANCEL, FinishReason.CANCELLED),
    (finish.STOP_STRING, FinishReason.STOP),
    (finish.FAILED, FinishReason.ERROR),
    (finish.GRAMMAR_LIMIT, finish.GRAMMAR_FAILED),
    (finish.EOS, FinishReason.EOS),
    (finish.STOP_ID, FinishReason.STOP),
    (finish.GRAMMAR, FinishReason.STOP),
    (finish.LENGTH, FinishReason.MAX_TOKENS),
]
NOT_PRODUCED = {finish.CANCEL, finish.FAILED, finish.GRAMMAR_LIMIT, finish.EOS, finish.STOP_ID}


# ---------------------------------------------------------------------- decide


def one_row(rules: int) -> finish.Endings:
    """``decide`` for one decoding row (slot 0) with ``rules`` fired."""
    return finish.decide(np.array([rules], np.uint8), slice(0, 1))


def test_each_rule_ends_the_row_with_its_finish() -> None:
    for rule, want in ORDER:
        ends = one_row(rule)
        assert ends.slots == [0] and ends.finishes == [want]
        assert ends.quiet == ([0] if rule in NOT_PRODUCED else [])


def test_no_rule_no_ending() -> None:
    assert finish.decide(np.zeros(4, np.uint8), slice(0, 4)) == ([], [], [])


def test_the_higher_rule_wins_any_combination() -> None:
    """Every set of rules ends the row with the finish of its highest rule; the token is produced
    only when no rule of CANCEL, FAILED, EOS, STOP_ID is in the set."""
    for size in range(2, len(ORDER) + 1):
        for combo in itertools.combinations(ORDER, size):
            rules = sum(rule for rule, _ in combo)
            ends = one_row(rules)
            assert ends.finishes == [combo[0][1]], combo
            assert ends.quiet == ([0] if {r for r, _ in combo} & NOT_PRODUCED else []), combo


def test_named_precedences() -> None:
    # A stop id that is also the last allowed token: STOP, and the stop id is not produced.
    assert one_row(finish.STOP_ID | finish.LENGTH) == ([0], [FinishReason.STOP], [0])
    # EOS on the last allowed token: EOS, not produced (vLLM's check_stop: EOS before length).
    assert one_row(finish.EOS | finish.LENGTH) == ([0], [FinishReason.EOS], [0])
    # A token that is both EOS and a stop id ends by EOS.
    assert one_row(finish.EOS | finish.STOP_ID) == ([0], [FinishReason.EOS], [0])
    # A stop string completed by the last allowed token: STOP, the token produced.
    assert one_row(finish.STOP_STRING | finish.LENGTH) == ([0], [FinishReason.STOP], [])
    # A grammar completed by the last allowed token: STOP (as the wire said before), produced.
    assert one_row(finish.GRAMMAR | finish.LENGTH) == ([0], [FinishReason.STOP], [])
    # A stop string held back from earlier tokens, found when EOS ends the row: STOP.
    assert one_row(finish.STOP_STRING | finish.EOS) == ([0], [FinishReason.STOP], [0])
    # A cancelled row ends CANCELLED whatever its token did.
    assert one_row(finish.CANCEL | finish.EOS | finish.STOP_STRING)[1] == [FinishReason.CANCELLED]


def test_rows_are_slots_and_quiet_rows_are_positions_in_the_step() -> None:
    """Slots 1, 3 and 6 decode (the step's rows 0, 1, 2); slot 4 is a prefilling row that was
    cancelled (it sampled nothing): it ends, and is no row of the step."""
    fired = np.zeros(8, np.uint8)
    fired[3] = finish.EOS
    fired[4] = finish.CANCEL
    fired[6] = finish.LENGTH
    ends = finish.decide(fired, np.array([1, 3, 6]))
    assert ends.slots == [3, 4, 6]
    assert ends.finishes == [FinishReason.EOS, FinishReason.CANCELLED, FinishReason.MAX_TOKENS]
    assert ends.quiet == [1]
    assert finish.decide(fired, None).quiet == []  # no row sampled: none to take back


def test_the_precedence_table_is_the_module_s() -> None:
    assert [rule for rule, _ in finish.PRECEDENCE] == [rule for rule, _ in ORDER]
    assert [f for _, f in finish.PRECEDENCE] == [f for _, f in ORDER]
    assert sum(NOT_PRODUCED) == finish.UNPRODUCED


# ---------------------------------------------------------------------- through the engine


class Pieces(ByteTokenizer):
    """Bytes, plus token 300: "b" and the first byte of "€" (a byte-fallback piece whose last
    character is unfinished, as BPE vocabularies have)."""

    PIECE = 300
    EURO = "€".encode()

    def __init__(self) -> None:
        super().__init__(vocab_size=320)

    def token_bytes(self, token_id: int) -> bytes:
        return b"b" + self.EURO[:1] if token_id == self.PIECE else super().token_bytes(token_id)

    def decode(self, ids) -> str:  # type: ignore[no-untyped-def]
        ids = ids.tolist() if isinstance(ids, np.ndarray) else list(ids)
        return b"".join(self.token_bytes(i) for i in ids).decode("utf-8", errors="replace")


class Wide(Scripted):
    """Scripted, with Pieces' vocabulary."""

    def __init__(self, script: list[int], num_slots: int = 4) -> None:
        super().__init__(script, num_slots)
        self.info = ModelInfo("scripted", 320, EOS, 4096)


class Matcher:
    """A grammar's place: complete after ``length`` accepted tokens; refuses ``refused``;
    exceeds its limits taking ``over`` in (accepting it), or filling its mask after
    ``over_at_fill`` tokens."""

    def __init__(
        self, length: int, refused: frozenset[int], over: int = -1, over_at_fill: int = -1
    ) -> None:
        self.length, self.refused, self.taken = length, refused, 0
        self.over, self.over_at_fill, self.error = over, over_at_fill, ""
        self.budget_closed = False

    def fill(self, bitmask: np.ndarray, row: int, left: int = 0) -> None:
        bitmask[row] = -1  # everything allowed: the scripted backend ignores the mask anyway
        if self.taken == self.over_at_fill:
            self.error = "lexer error: too many expressions constructed"

    def accept(self, token: int) -> bool:
        if token == self.over:
            self.error = "parser error: Too many items"
            return False
        if token in self.refused:
            return False
        self.taken += 1
        return True

    @property
    def finished(self) -> bool:
        return self.taken >= self.length


class Grammar:
    def __init__(self, length: int, refused: frozenset[int] = frozenset(), **over: int) -> None:
        self.length, self.refused, self.over = length, refused, over

    def matcher(self) -> Matcher:
        return Matcher(self.length, self.refused, **self.over)


def drive(engine: Engine, sink: list, limit: int = 200) -> dict:
    """Steps until idle; per owner: ids produced, text, finish, and the ending's count and ids."""
    ended: dict = {}
    for _ in range(limit):
        out = engine.step()
        sink.extend(out.outputs())
        f: Finished
        for f in out.finished:
            ended[f.owner] = (f.n_tokens, None if f.ids is None else f.ids.tolist())
        if engine.idle:
            break
    streams: dict = {}
    for owner, token, text, end in sink:
        s = streams.setdefault(owner, {"ids": [], "text": "", "finish": None})
        assert s["finish"] is None, "output after the stream ended"
        if token != NO_TOKEN:
            s["ids"].append(token)
        s["text"] += text
        if end != NOT_FINISHED:
            s["finish"] = end
    for owner, (n, ids) in ended.items():
        streams[owner]["count"], streams[owner]["recorded"] = n, ids
    return streams


def one(script: list[int], tokenizer=None, **kw) -> dict:  # type: ignore[no-untyped-def]
    """One stream on a scripted backend: what it got."""
    tok = tokenizer or ByteTokenizer()
    grammar = kw.pop("grammar", None)
    engine, sink = make_engine(Wide(script) if tokenizer else Scripted(script), tokenizer=tok)
    s = seq("s", **kw)
    if s.detok is not None:
        s.detok = Detokenizer(tok)
    s.grammar = grammar
    engine.submit(s)
    got = drive(engine, sink)["s"]
    got["matched_stop"] = s.matched_stop
    assert engine.slots_used == 0
    return got


def test_a_stop_id_on_the_last_allowed_token_is_stop_and_not_produced() -> None:
    got = one([A, B, C], max_tokens=3, stop_ids=[C])
    assert got["finish"] == FinishReason.STOP
    assert got["ids"] == [A, B] and got["text"] == "ab" and got["count"] == 2
    assert got["recorded"] == [A, B]


def test_eos_on_the_last_allowed_token_is_eos_and_not_produced() -> None:
    got = one([A, B, EOS], max_tokens=3)
    assert got["finish"] == FinishReason.EOS
    assert got["ids"] == [A, B] and got["count"] == 2


def test_a_token_both_eos_and_a_stop_id_ends_by_eos() -> None:
    got = one([A, EOS], max_tokens=5, stop_ids=[EOS])
    assert got["finish"] == FinishReason.EOS and got["ids"] == [A]


def test_a_stop_string_completed_by_the_last_allowed_token_is_stop() -> None:
    """The token is produced (sent, counted); its text stops before the stop string."""
    got = one([A, B, C], max_tokens=3, stops=["bc"])
    assert got["finish"] == FinishReason.STOP and got["matched_stop"] == "bc"
    assert got["text"] == "a" and got["ids"] == [A, B, C] and got["count"] == 3


def test_a_stop_string_in_text_held_back_is_found_when_the_row_ends() -> None:
    """The "a" is held (it may start "ab"); the piece's "b" waits in the detokenizer behind its
    unfinished "€" byte. The row's end flushes both, the stop scan finds "ab": STOP, whichever
    rule ended the row (EOS here, the last allowed token, a stop id)."""
    tok = Pieces()
    for script, kw, ids in (
        ([A, Pieces.PIECE, EOS], {}, [A, Pieces.PIECE]),
        ([A, Pieces.PIECE], {"max_tokens": 2}, [A, Pieces.PIECE]),
        ([A, Pieces.PIECE, X], {"stop_ids": [X]}, [A, Pieces.PIECE]),
    ):
        got = one(script, tok, **{"max_tokens": 10, **kw}, stops=["ab"])
        assert got["finish"] == FinishReason.STOP and got["matched_stop"] == "ab", kw
        assert got["text"] == "" and got["ids"] == ids, kw
    # Without the stop string, the same row's held text comes out as it is, U+FFFD included.
    got = one([A, Pieces.PIECE, EOS], tok, max_tokens=10, stops=["abz"])
    assert got["finish"] == FinishReason.EOS and got["text"] == "ab\ufffd"


def test_a_stop_id_releases_the_text_held_for_a_partial_stop_string() -> None:
    got = one([A, B, X], max_tokens=10, stops=["abd"], stop_ids=[X])
    assert got["finish"] == FinishReason.STOP and got["text"] == "ab"
    assert got["matched_stop"] is None


def test_a_grammar_completing_on_the_last_allowed_token_is_stop_and_produced() -> None:
    for text in (False, True):  # the text path no longer relabels it
        got = one([A, B, C], max_tokens=3, text=text, grammar=Grammar(3))
        assert got["finish"] == FinishReason.STOP, text
        assert got["ids"] == [A, B, C] and got["count"] == 3, text
        if text:
            assert got["text"] == "abc"


def test_a_grammar_completing_before_the_limit_ends_the_row() -> None:
    got = one([A, B, C], max_tokens=10, grammar=Grammar(2))
    assert got["finish"] == FinishReason.STOP and got["ids"] == [A, B] and got["text"] == "ab"


def test_a_grammar_and_a_stop_string_on_one_token_is_the_stop_string() -> None:
    got = one([A, B, C], max_tokens=10, stops=["b"], grammar=Grammar(2))
    assert got["finish"] == FinishReason.STOP and got["matched_stop"] == "b"
    assert got["text"] == "a" and got["ids"] == [A, B]


def test_eos_is_not_taken_into_the_grammar() -> None:
    """EOS ends the row before the grammar sees it (a matcher refusing EOS would fail it)."""
    got = one([A, EOS], max_tokens=10, grammar=Grammar(5, refused=frozenset({EOS})))
    assert got["finish"] == FinishReason.EOS and got["ids"] == [A]


def test_a_token_the_grammar_refuses_is_an_error_and_not_produced() -> None:
    for kw in ({"max_tokens": 10}, {"max_tokens": 2}):  # also on the last allowed token
        got = one([A, X], **kw, grammar=Grammar(5, refused=frozenset({X})))
        assert got["finish"] == FinishReason.ERROR, kw
        assert got["ids"] == [A] and got["text"] == "a" and got["count"] == 1, kw


def test_a_grammar_over_its_limits_taking_a_token_in_ends_alone_unproduced() -> None:
    for kw in ({"max_tokens": 10}, {"max_tokens": 2}):  # also on the last allowed token
        got = one([A, X], **kw, grammar=Grammar(5, over=X))
        assert got["finish"] == finish.GRAMMAR_FAILED, kw
        assert got["ids"] == [A] and got["count"] == 1, kw


def test_a_grammar_over_its_limits_filling_its_mask_ends_the_row_with_why() -> None:
    engine, sink = make_engine(Scripted([A, B, C, A, B, C]))
    hostile, canary = seq("hostile", max_tokens=6), seq("canary", max_tokens=6)
    hostile.grammar = Grammar(9, over_at_fill=2)  # fails filling the mask of its third token
    canary.grammar = Grammar(9)
    engine.submit(hostile)
    engine.submit(canary)
    got = drive(engine, sink)
    assert got["hostile"]["finish"] == finish.GRAMMAR_FAILED
    assert got["hostile"]["count"] == 2 and len(got["hostile"]["ids"]) == 2
    assert hostile.grammar_error == "lexer error: too many expressions constructed"
    assert got["canary"]["finish"] == FinishReason.MAX_TOKENS and got["canary"]["count"] == 6
    assert engine.slots_used == 0


def test_a_text_failure_is_an_error_and_not_produced() -> None:
    class Failing(Detokenizer):
        def push(self, token_id: int) -> str:
            if token_id == X:
                raise UnicodeError("cannot")
            return super().push(token_id)

    engine, sink = make_engine(Scripted([A, X, B]))
    s = seq("s", max_tokens=10)
    s.detok = Failing(ByteTokenizer())
    engine.submit(s)
    got = drive(engine, sink)["s"]
    assert got["finish"] == FinishReason.ERROR and got["ids"] == [A] and got["count"] == 1


def test_a_cancel_during_a_step_ends_the_row_cancelled_whatever_its_token() -> None:
    """The cancel arrives while the backend computes; the row's token (EOS here, or the last
    allowed one) is not produced, and the row ends CANCELLED in that step."""

    class CancelInDecode(Scripted):
        target = None

        def decode(self, batch):  # type: ignore[no-untyped-def]
            if self.target is not None and len(self.decodes) == 1:
                engine.cancel(self.target)
            return super().decode(batch)

    for script, max_tokens in (([A, B, EOS], 10), ([A, B, C], 3)):
        backend = CancelInDecode(script)
        engine, sink = make_engine(backend)
        s = seq("s", max_tokens=max_tokens, stops=["bc"])
        backend.target = s
        engine.submit(s)
        got = drive(engine, sink)["s"]
        assert got["finish"] == FinishReason.CANCELLED, script
        assert got["ids"] == [A, B] and got["count"] == 2, script
        assert len(backend.decodes) == 2 and engine.slots_used == 0


def test_a_cancelled_prefill_runs_no_more_of_its_prompt() -> None:
    backend = Scripted([A])
    engine, sink = make_engine(backend, prefill_chunk=4, max_step_tokens=4)
    s = seq("s", prompt=b"x" * 16, max_tokens=5)
    engine.submit(s)
    engine.step()  # the first chunk
    engine.cancel(s)
    got = drive(engine, sink)["s"]
    assert got["finish"] == FinishReason.CANCELLED and got["ids"] == [] and got["count"] == 0
    assert [c for step in backend.prefills for c in step] == [(0, 0, 4, False)]
    assert engine.slots_used == 0


@pytest.mark.parametrize("ignore_eos", [False, True])
def test_ignore_eos_makes_eos_an_ordinary_token(ignore_eos: bool) -> None:
    engine, sink = make_engine(Scripted([A, EOS, B]))
    s = seq("s", max_tokens=3, stop_ids=[B] if ignore_eos else [])
    s.ignore_eos = ignore_eos
    engine.submit(s)
    got = drive(engine, sink)["s"]
    if ignore_eos:  # EOS produced; the stop id B then ends the row
        assert got["finish"] == FinishReason.STOP and got["ids"] == [A, EOS]
    else:
        assert got["finish"] == FinishReason.EOS and got["ids"] == [A]
