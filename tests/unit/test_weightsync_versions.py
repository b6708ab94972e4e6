"""The one wait for "this engine serves version v", blocking and async alike."""

from __future__ import annotations

import asyncio
import itertools

import pytest

from rlfleet.weightsync import wait_for_version, wait_for_version_async


def test_the_wait_ends_once_the_version_or_a_newer_one_is_held() -> None:
    held = iter([None, 1, 3])
    wait_for_version(lambda: next(held), 2, timeout_s=10, what="the engine", poll_s=0)
    assert next(held, "asked no more") == "asked no more"
    wait_for_version(lambda: 5, 5, timeout_s=0, what="the engine")  # already there: no wait


def test_a_version_that_never_comes_times_out_naming_who_waited() -> None:
    with pytest.raises(TimeoutError, match="vLLM's workers did not reach weight version 4"):
        wait_for_version(lambda: 3, 4, timeout_s=0.05, what="vLLM's workers", poll_s=0.01)


def test_the_async_wait_lets_the_loop_run_while_it_waits() -> None:
    async def scenario() -> None:
        versions = itertools.count()
        version = 0

        async def load() -> None:
            nonlocal version
            for _ in range(3):
                await asyncio.sleep(0)
                version = next(versions)

        loading = asyncio.create_task(load())
        await wait_for_version_async(lambda: version, 2, timeout_s=10, what="engine", poll_s=0)
        await loading
        with pytest.raises(TimeoutError, match="engine did not reach weight version 3"):
            await wait_for_version_async(lambda: version, 3, timeout_s=0.05, what="engine")

    asyncio.run(scenario())
