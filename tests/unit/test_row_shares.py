"""The fair share of the rows running (issue #40 item 2): one principal holding every slot does
not keep another waiting; n choices count as n rows; weights from the keys file."""

from __future__ import annotations

import numpy as np

from zerolayer.engine.admission import RowShares
from zerolayer.engine.backends.synthetic import SyntheticBackend
from zerolayer.engine.engine import Engine
from zerolayer.engine.sequence import Sequence
from zerolayer.ops.metrics import Metrics
from zerolayer.sampling_params import SamplingParams
from zerolayer.tokenizer import ByteTokenizer


def test_equal_shares_among_the_principals_with_work():
    shares = RowShares(32)
    for _ in range(31):
        shares.took("A", 1)
    # A alone waiting: work-conserving, A takes the last slot too
    assert shares.pick([("A", 1, 1)]) == 0
    # B waiting beside A (31 of 32 running): B goes first, A is over its share of 16
    assert shares.pick([("A", 1, 1), ("B", 1, 1)]) == 1
    assert shares.share(1, 2) == 16 and shares.share(1, 3) == 10


def test_weights_divide_the_slots():
    shares = RowShares(32)
    assert shares.share(3, 4) == 24 and shares.share(1, 4) == 8
    for _ in range(8):
        shares.took("B", 1)
    for _ in range(23):
        shares.took("A", 3)
    # A (weight 3) holds 23 of its 24, B (weight 1) 8 of its 8: A's head is admitted
    assert shares.pick([("B", 1, 1), ("A", 1, 3)]) == 1
    shares.took("A", 3)
    # both at their shares: the fewest rows per weight (A 24/3 = 8, B 8/1 = 8: the round's first)
    assert shares.pick([("B", 1, 1), ("A", 1, 3)]) == 0


def test_n_choices_count_as_n_rows_and_an_idle_principal_stops_counting():
    shares = RowShares(32)
    for _ in range(12):
        shares.took("A", 1)
    # B's head asks for 8 rows; B holds none, so it fits whatever its share
    assert shares.pick([("A", 1, 1), ("B", 8, 1)]) == 1
    for _ in range(12):
        shares.gave_back("A")
    assert shares.running == {} and shares._weight == {}


def test_a_fixed_row_share_caps_each_principal():
    shares = RowShares(32, row_share=0.25)
    assert shares.share(1, 1) == 8 and shares.share(5, 6) == 8


def _engine(slots: int = 32) -> Engine:
    backend = SyntheticBackend(slots, 512, 4096)
    return Engine(
        backend, ByteTokenizer(), lambda step: None, max_queue=1024, max_step_tokens=4096,
        prefill_chunk=256,
    )  # fmt: skip


def _seq(owner: str, key: str, max_tokens: int, n: int = 1, **kw: object) -> Sequence:
    def one(name: str) -> Sequence:
        return Sequence(
            name, np.array([1, 2, 3], np.int32), max_tokens, SamplingParams(), ignore_eos=True,
            fair_key=key, **kw,  # type: ignore[arg-type]
        )  # fmt: skip

    first = one(owner)
    for i in range(1, n):
        choice = one(f"{owner}.{i}")
        choice.parent = first
        first.choices.append(choice)
    return first


def _admitted(seqs: list[Sequence]) -> list[str]:
    """Owners in the order they got a slot (t_admit, then submission order)."""
    done = [s for s in seqs if s.t_admit]
    return [s.owner for s in sorted(done, key=lambda s: s.t_admit)]  # type: ignore[misc]


def test_a_second_key_is_admitted_before_the_first_keys_33rd_row():
    engine = _engine()
    a = [_seq(f"a{i}", "A", 3 if i < 4 else 1000) for i in range(40)]
    for s in a:
        engine.submit(s)
    while engine.running < 32:
        engine.step()
    assert engine.running == 32 and sum(1 for s in a if s.t_admit) == 32
    b = _seq("b", "B", 1000)
    engine.submit(b)
    for _ in range(50):
        engine.step()
        if b.t_admit:
            break
    assert b.t_admit
    # at B's admission A had been given exactly 32 rows: B came before A's 33rd
    assert sum(1 for s in a if s.t_admit and s.t_admit < b.t_admit) == 32
    for _ in range(20):
        engine.step()
    order = _admitted([*a, b])
    assert order.index("b") == 32
    # the first A rows to end freed 4 slots: B took one; A, over its share of 16 while B had
    # work, got the others only once B had nothing waiting (work-conserving)
    assert sum(1 for s in a if s.t_admit) == 35


def test_one_key_with_n8_heads_does_not_starve_a_one_row_newcomer():
    """Four n=8 requests hold all 32 rows, a fifth waits at the head of A's queue: B's single
    row is admitted at once (A, over its share, gives up its youngest row), before A's older
    n=8 head."""
    engine = _engine()
    a = [_seq(f"a{i}", "A", 3 if i == 0 else 1000, n=8) for i in range(5)]
    for s in a:
        engine.submit(s)
    while engine.running < 32:
        engine.step()
    b = _seq("b", "B", 1000)
    engine.submit(b)
    for _ in range(50):
        engine.step()
        if b.t_admit:
            break
    assert b.t_admit and not a[4].t_admit
    # 31 A rows + b running; A's n=8 and its preempted row waiting
    assert engine.class_rows["default"] == [32, 9]
    assert engine.class_preempted == {"default": 1}


def test_anonymous_and_classes_are_counted_per_class_without_key_names():
    engine = _engine(4)
    engine.submit(_seq("k", "alice", 1000, principal_class="premium", weight=3))
    engine.submit(_seq("anon", "anonymous@127.0.0.1", 1000, principal_class="anonymous"))
    engine.step()
    assert engine.class_rows == {"premium": [1, 0], "anonymous": [1, 0]}
    metrics = Metrics()
    metrics.set_classes(engine.class_rows)
    text = metrics.render().decode()
    assert 'zerolayer_principal_rows_running{principal_class="premium"} 1.0' in text
    assert 'zerolayer_principal_rows_preempted_total{principal_class="anonymous"} 0.0' in text
    assert "alice" not in text
