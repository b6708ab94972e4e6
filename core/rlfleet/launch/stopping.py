"""How a one-loop component process runs: until SIGTERM (a pod stopping) or SIGINT."""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Awaitable, Callable


def run_until_signalled(loop: Callable[[asyncio.Event], Awaitable[None]]) -> None:
    """Runs `loop(stop)`; a signal sets `stop`, and the loop finishes what it is doing."""

    async def running() -> None:
        stop = asyncio.Event()
        for signum in (signal.SIGTERM, signal.SIGINT):
            asyncio.get_running_loop().add_signal_handler(signum, stop.set)
        await loop(stop)

    asyncio.run(running())
