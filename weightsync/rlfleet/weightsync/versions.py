"""Waiting until something holds or serves a weight version: one loop, whether the caller
blocks (vLLM's worker and client sides) or awaits (the rollout engine's driver)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterator

Held = Callable[[], int | None]  # the version held or served now; None: none yet


def reached(held: int | None, version: int) -> bool:
    """Whether `held` is `version` or newer."""
    return held is not None and held >= version


def _polls(held: Held, version: int, timeout_s: float, what: str) -> Iterator[None]:
    """Yields, for the caller to sleep, until `held()` reaches `version`; TimeoutError,
    naming `what`, once `timeout_s` has passed without."""
    deadline = time.monotonic() + timeout_s
    while not reached(held(), version):
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} did not reach weight version {version} in {timeout_s:g}s")
        yield


def wait_for_version(
    held: Held, version: int, timeout_s: float, *, what: str, poll_s: float = 0.05
) -> None:
    """Blocks until `held()` is `version` or newer, asking every `poll_s`."""
    for _ in _polls(held, version, timeout_s, what):
        time.sleep(poll_s)


async def wait_for_version_async(
    held: Held, version: int, timeout_s: float, *, what: str, poll_s: float = 0.05
) -> None:
    """`wait_for_version` for a coroutine: the event loop runs on while it waits."""
    for _ in _polls(held, version, timeout_s, what):
        await asyncio.sleep(poll_s)
