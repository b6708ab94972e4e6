"""How a one-loop component process runs: from its settings file, until SIGTERM (a pod
stopping) or SIGINT."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TypeVar

import msgspec

from rlfleet.launch.settings import from_json

S = TypeVar("S", bound=msgspec.Struct)


def log_as_components_do() -> None:
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )


def log_with_vllm() -> None:
    """In a process vLLM's logging runs (its OpenAI server, its engine's workers): rlfleet's
    lines at INFO, through vLLM's own handlers, so they land beside vLLM's in the pod's
    log. Without it they had no handler of their own and were lost."""
    ours = logging.getLogger("rlfleet")
    if not ours.handlers:
        for handler in logging.getLogger("vllm").handlers:
            ours.addHandler(handler)
        ours.setLevel(logging.INFO)
        ours.propagate = False


def process_settings(program: str, kind: type[S]) -> S:
    """A local process's start (one no pod runs): logging as every component logs, then
    its settings from its one argument, CONFIG.json. One that cannot read them exits
    with the reason, naming the field, not with a traceback."""
    log_as_components_do()
    if len(sys.argv) != 2:
        sys.exit(f"usage: python -m {program} CONFIG.json")
    try:
        return from_json(Path(sys.argv[1]).read_bytes(), kind)
    except (OSError, msgspec.DecodeError) as error:
        sys.exit(f"{program}: cannot read {sys.argv[1]}: {error}")


def run_until_signalled(loop: Callable[[asyncio.Event], Awaitable[None]]) -> None:
    """Runs `loop(stop)`; a signal sets `stop`, and the loop finishes what it is doing."""

    async def running() -> None:
        stop = asyncio.Event()
        for signum in (signal.SIGTERM, signal.SIGINT):
            asyncio.get_running_loop().add_signal_handler(signum, stop.set)
        await loop(stop)

    asyncio.run(running())


async def wait_set(event: asyncio.Event, seconds: float) -> bool:
    """Waits up to `seconds` for `event`; whether it is set. Every loop that sleeps until
    woken waits so, not by `asyncio.wait_for(event.wait(), seconds)`: on Python 3.11 that
    swallows a cancel which arrives as the event is set (CPython gh-86296), and a loop
    stopped by cancelling it then runs on forever (a feed's shutdown hung so in CI)."""
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(seconds):
            await event.wait()
    return event.is_set()
