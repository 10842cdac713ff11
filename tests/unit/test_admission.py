"""The fair share of the engine queue (issue #25 item 5): one client flooding cannot fill it."""

from __future__ import annotations

from zerolayer.engine.admission import QueueShares


def test_one_flooding_client_leaves_room_for_a_newcomer():
    q = QueueShares(1024)
    taken = 0
    while q.take("flood"):
        taken += 1
    assert taken == 512  # alone: half the queue
    assert q.take("newcomer")
    q.give_back("flood")
    assert not q.take("flood")  # with another client holding, the flood's share is 1024 // 3


def test_many_flooders_still_leave_room_and_shares_return():
    q = QueueShares(100)
    for k in range(5):
        while q.take(k):
            pass
    assert q.total < 100 and q.take("late")  # each flooder past the reserve got one
    q.give_back("late")
    for k in range(5):
        for _ in range(q._held.get(k, 0)):
            q.give_back(k)
    assert not q._held and q.total == 0
    assert q.share("x") == 50
