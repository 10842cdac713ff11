"""KV pages (zerolayer.engine.kv_pages): random sequences of the scheduler's operations keep the
pool's invariants, allocation is all or nothing, a shared page is copied before a write."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from zerolayer.engine.kv_pages import PagePool, pages_for

SLOTS, PAGES, ROW = 4, 12, 6


def _check(pool: PagePool, held: list[np.ndarray]) -> None:
    """No page both free and referenced; every reference is a table entry or a held handle;
    free + used == total."""
    free = pool._free[: pool._nfree]
    assert len(set(free.tolist())) == len(free)
    assert (pool.refs[free] == 0).all()
    counted = np.zeros(pool.num_pages, np.int64)
    for slot in range(len(pool.mapped)):
        row = pool.tables[slot]
        n = int(pool.mapped[slot])
        assert (row[:n] >= 0).all() and (row[n:] == -1).all()
        np.add.at(counted, row[:n], 1)
    for pages in held:
        np.add.at(counted, pages, 1)
    assert counted.tolist() == pool.refs.tolist()
    assert pool.available + int(np.count_nonzero(pool.refs)) == pool.num_pages
    assert pool.available + pool.used == pool.num_pages


op = st.one_of(
    st.tuples(st.just("write"), st.integers(0, SLOTS - 1), st.integers(1, 40)),
    st.tuples(st.just("release"), st.integers(0, SLOTS - 1), st.just(0)),
    st.tuples(st.just("save"), st.integers(0, SLOTS - 1), st.integers(1, ROW)),
    st.tuples(st.just("load"), st.integers(0, SLOTS - 1), st.integers(0, 8)),
    st.tuples(st.just("drop"), st.integers(0, 8), st.just(0)),
    st.tuples(st.just("share"), st.integers(0, SLOTS - 1), st.integers(0, SLOTS - 1)),
)


@settings(max_examples=300, deadline=None)
@given(st.lists(op, max_size=60))
def test_random_operations_keep_the_invariants(ops: list[tuple[str, int, int]]) -> None:
    pool = PagePool(PAGES, SLOTS, ROW)
    held: list[np.ndarray] = []  # what a prefix store would hold: page ids it increfed
    length = [0] * SLOTS  # positions written per slot
    for name, a, b in ops:
        if name == "write":  # a row goes on by b positions (or waits: nothing changes)
            start, end = length[a], min(length[a] + b, ROW * 16)
            before = (pool.refs.copy(), pool.tables.copy(), pool.available)
            need = pool.pages_needed(a, start, end)
            copies = pool.prepare_write(a, start, end)
            if copies is None:
                assert need > before[2]
                assert (pool.refs == before[0]).all() and (pool.tables == before[1]).all()
            else:
                assert pool.available == before[2] - need
                written = pool.tables[a, start // 16 : pages_for(end)]
                assert (pool.refs[written] == 1).all()  # a row never writes a shared page
                for src, dst in copies:
                    assert pool.refs[src] >= 1 and pool.refs[dst] == 1
                length[a] = end
        elif name == "release":
            pool.release(a)
            length[a] = 0
        elif name == "save" and pool.mapped[a]:  # the store keeps b leading pages
            pages = pool.pages_of(a)[:b].copy()
            pool.incref(pages)
            held.append(pages)
        elif name == "load" and held and not pool.mapped[a % SLOTS]:
            pages = held[b % len(held)]
            pool.map(a % SLOTS, 0, pages)
            length[a % SLOTS] = len(pages) * 16
        elif name == "drop" and held:
            pool.decref(held.pop(a % len(held)))
        elif name == "share" and a != b and not pool.mapped[b] and length[a]:
            pool.share(a, b, length[a])
            length[b] = length[a]
        _check(pool, held)
    for slot in range(SLOTS):
        pool.release(slot)
    for pages in held:
        pool.decref(pages)
    assert pool.available == PAGES and not pool.refs.any()


def test_allocation_is_all_or_nothing() -> None:
    pool = PagePool(4, 2, 4)
    assert pool.prepare_write(0, 0, 48) is not None  # 3 pages
    assert pool.alloc(2) is None and pool.available == 1
    assert pool.prepare_write(1, 0, 20) is None  # needs 2 of 1
    assert pool.mapped[1] == 0 and pool.available == 1
    assert pool.prepare_write(1, 0, 16) == [] and pool.available == 0


def test_a_shared_partial_page_is_copied_before_a_write() -> None:
    pool = PagePool(8, 2, 4)
    pool.prepare_write(0, 0, 20)  # pages for positions 0..19: two
    first, tail = pool.pages_of(0).tolist()
    pool.share(0, 1, 19)  # a choice starts from the prompt's first 19 positions
    assert pool.pages_of(1).tolist() == [first, tail]
    assert pool.pages_needed(1, 19, 20) == 1
    copies = pool.prepare_write(1, 19, 20)
    assert copies is not None and len(copies) == 1 and copies[0][0] == tail
    assert pool.pages_of(1).tolist() == [first, copies[0][1]]  # the full page still shared
    assert pool.refs[first] == 2 and pool.refs[tail] == 1
    assert pool.prepare_write(0, 20, 21) == []  # the tail is slot 0's alone again


def test_mistakes_are_refused() -> None:
    pool = PagePool(8, 2, 2)
    with pytest.raises(ValueError, match="holds 0 positions"):
        pool.prepare_write(0, 16, 17)  # a hole
    with pytest.raises(ValueError, match="cannot hold 33"):
        pool.prepare_write(0, 0, 33)
    pool.prepare_write(0, 0, 1)
    pool.release(0)
    with pytest.raises(AssertionError):
        pool.decref(np.array([0], np.int32))


def test_decode_rows_get_their_next_pages_at_once_or_not_at_all() -> None:
    pool = PagePool(5, 3, 2)
    for slot in range(3):
        assert pool.prepare_write(slot, 0, 16) == []
    assert pool.append(np.array([0, 2]))
    assert pool.mapped.tolist() == [2, 1, 2] and pool.available == 0
    assert not pool.append(np.array([1]))  # no page left: nothing changed
    assert pool.mapped.tolist() == [2, 1, 2]
    pool.release(2)
    with pytest.raises(ValueError, match="cannot hold another page"):
        pool.append(np.array([0]))
    assert pool.available == 2  # the page taken for it went back
    _check(pool, [])
