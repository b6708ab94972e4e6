"""Reading a run's streams as its components and the operator do: the newest message on a
subject, or the messages after a sequence, each decoded. Direct gets only: a reader makes
no consumer, so it leaves nothing behind on the server and needs no right to make one.

A message that is not of the reader's schema (a bug, an old writer, a forgery) is passed
over, logged and counted by the reader's `skipped`: no reader stops on one.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable
from typing import TypeVar

import msgspec
from nats.errors import NoRespondersError
from nats.js import JetStreamContext
from nats.js.api import RawStreamMsg
from nats.js.errors import NotFoundError

log = logging.getLogger(__name__)
M = TypeVar("M")


def _unreadable(subject: str, error: Exception, skipped: Callable[[], None] | None) -> None:
    log.warning("ignored an unreadable message on %s: %s", subject, error)
    if skipped is not None:
        skipped()


async def newest(
    js: JetStreamContext,
    stream: str,
    subject: str,
    decode: Callable[[bytes], M],
    skipped: Callable[[], None] | None = None,
) -> M | None:
    """The newest message on `subject`, decoded; None when there is none yet, the stream
    is not there yet, or the message cannot be read."""
    try:
        message = await js.get_last_msg(stream, subject, direct=True)
        return decode(message.data)
    except (NotFoundError, NoRespondersError):
        return None
    except (msgspec.ValidationError, msgspec.DecodeError) as error:
        _unreadable(subject, error, skipped)
        return None


async def messages(
    js: JetStreamContext, stream: str, subject: str, after: int = 0, *, direct: bool = True
) -> AsyncIterator[RawStreamMsg]:
    """The stream's messages on `subject` after sequence `after`, oldest first, one direct
    get each (the server finds the next by its subject index); `direct=False` for a
    stream that allows no direct gets (the stream leader answers instead)."""
    seq = after
    while True:
        try:
            message = await js.get_msg(
                stream, seq=seq + 1, subject=subject, next=True, direct=direct
            )
        except (NotFoundError, NoRespondersError):
            return
        assert message.seq is not None
        seq = message.seq
        yield message


async def decoded(
    js: JetStreamContext,
    stream: str,
    subject: str,
    decode: Callable[[bytes], M],
    after: int = 0,
    skipped: Callable[[], None] | None = None,
) -> AsyncIterator[tuple[int, M]]:
    """`messages`, decoded, with their sequences; the unreadable passed over."""
    async for message in messages(js, stream, subject, after):
        try:
            value = decode(message.data)
        except (msgspec.ValidationError, msgspec.DecodeError) as error:
            _unreadable(subject, error, skipped)
            continue
        yield message.seq, value  # type: ignore[misc]


async def recent(
    js: JetStreamContext,
    stream: str,
    subject: str,
    decode: Callable[[bytes], M],
    look_back: int,
    skipped: Callable[[], None] | None = None,
) -> list[M]:
    """The readable messages on `subject` among the stream's last `look_back`, newest
    first: what a reader looking for something recent reads, however long the history."""
    try:
        last = (await js.stream_info(stream)).state.last_seq
    except (NotFoundError, NoRespondersError):
        return []
    found = [
        m async for _, m in decoded(js, stream, subject, decode, max(0, last - look_back), skipped)
    ]
    return found[::-1]
