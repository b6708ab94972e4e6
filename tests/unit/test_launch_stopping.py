"""How a component's loops sleep until woken: a loop stopped by cancelling it stops, even
when the cancel arrives as it is woken (Python 3.11's `asyncio.wait_for` swallows that
cancel, and a feed's shutdown hung in CI so)."""

from __future__ import annotations

import asyncio

from rlfleet.launch.stopping import wait_set


def test_a_loop_cancelled_as_it_is_woken_stops() -> None:
    async def scenario() -> int:
        woken = asyncio.Event()
        turns = 0

        async def loop() -> None:
            nonlocal turns
            while turns < 3:  # a loop that ran on after its cancel ends here, not hangs
                await wait_set(woken, 10.0)
                woken.clear()
                turns += 1

        task = asyncio.create_task(loop())
        await asyncio.sleep(0)  # the loop is waiting
        woken.set()
        task.cancel()  # in the same turn of the event loop as the wake
        await asyncio.gather(task, return_exceptions=True)
        return turns

    assert asyncio.run(scenario()) == 0


def test_a_wait_says_whether_it_was_woken() -> None:
    async def scenario() -> tuple[bool, bool]:
        woken = asyncio.Event()
        asyncio.get_running_loop().call_later(0.01, woken.set)
        return await wait_set(woken, 5.0), await wait_set(asyncio.Event(), 0.01)

    assert asyncio.run(scenario()) == (True, False)
