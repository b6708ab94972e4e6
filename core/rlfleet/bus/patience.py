"""Going on through a NATS server's restart: a call that fails while the client reconnects
is tried again, with backoff, for as long as a restart takes, instead of ending the
process (which a restart would then cost the work it held: a trainer's step, a worker's
groups)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import TypeVar

import nats.errors

log = logging.getLogger(__name__)
T = TypeVar("T")

# What a server restarting looks like to a client: the connection closed or refused, a
# request unanswered.
TRANSIENT: tuple[type[Exception], ...] = (TimeoutError, nats.errors.Error)


async def patiently(
    step: Callable[[], Awaitable[T]],
    what: str,
    give_up_s: float = 120.0,
    transient: tuple[type[Exception], ...] = TRANSIENT,
) -> T:
    """`step()`, again after transient trouble, until it succeeds or `give_up_s` passed."""
    deadline = asyncio.get_running_loop().time() + give_up_s
    delay = 0.2
    while True:
        try:
            return await step()
        except transient as error:
            if asyncio.get_running_loop().time() > deadline:
                raise
            log.warning("%s: %r; retrying in %.1fs", what, error, delay)
            await asyncio.sleep(delay)
            delay = min(delay * 2, 2.0)
