"""The engine → event loop hand-off: one wake-up per batch, a hard bound, release on close."""

from __future__ import annotations

import asyncio
import threading

from zerolayer.engine.outbox import Outbox
from zerolayer.engine.step import StepOutput


def test_bound_is_hard_and_steps_arrive_in_order_in_few_batches() -> None:
    async def main() -> None:
        outbox = Outbox(max_pending=4)
        batches: list[list] = []
        outbox.attach(asyncio.get_running_loop(), batches.append)
        high = 0

        def engine() -> None:
            nonlocal high
            for i in range(200):
                outbox.put(i)  # type: ignore[arg-type]
                high = max(high, outbox.pending)

        thread = threading.Thread(target=engine)
        thread.start()
        while thread.is_alive() or outbox.pending:
            await asyncio.sleep(0.001)
        thread.join()
        steps = [step for batch in batches for step in batch]
        assert steps == list(range(200))
        assert high <= 4  # never more than max_pending waiting, however slow the loop
        assert len(batches) < 200

    asyncio.run(main())


def test_close_releases_a_blocked_engine_thread_and_drops_later_steps() -> None:
    loop = asyncio.new_event_loop()  # never run: nothing is taken from the outbox
    try:
        outbox = Outbox(max_pending=2)
        outbox.attach(loop, lambda steps: None)
        outbox.put(StepOutput())
        outbox.put(StepOutput())
        blocked = threading.Thread(target=outbox.put, args=(StepOutput(),))
        blocked.start()
        blocked.join(0.2)
        assert blocked.is_alive()  # the third step waits for the loop
        outbox.close()
        blocked.join(5)
        assert not blocked.is_alive()
        outbox.put(StepOutput())  # after close: dropped, never blocks
        assert outbox.pending == 0
    finally:
        loop.close()
