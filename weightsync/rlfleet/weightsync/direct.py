"""A NATS client of weightsync's own for moving shards: JetStream's batched direct get,
each chunk received straight into its place in the shard, and acknowledged publishes
of chunks, on a raw asyncio connection.

nats-py reads 32 KiB at a time, copies every message out of its parse buffer twice and
runs a callback per message, and on the way out builds each message by joining bytes:
for 1 MiB chunks that was most of a receiver's and a publisher's time. Here the kernel
writes a chunk's payload directly into the shard's buffer (asyncio's `BufferedProtocol`);
only control lines, headers and acks pass through a small line buffer. A connection
serves any number of requests, told apart by their reply subjects, but a server answers
them one after another, so callers that want requests served side by side open several;
a fetch holds only its shard's buffer, so the caller's window of requests in flight
bounds the memory.

It speaks just what it needs of the protocol (client protocol 1, headers): INFO,
CONNECT with the credentials of the nats-py client it is opened from, SUB, PUB, HPUB,
PING, PONG, MSG, HMSG, -ERR.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
from dataclasses import dataclass, field

import nats.errors
import nats.js.errors
import numpy as np
from nats.aio.client import Client

from rlfleet.weightsync.errors import CorruptShard

log = logging.getLogger(__name__)

# Every chunk of a shard names its index and the shard's chunk count: "<index>/<count>".
CHUNK_HEADER = "Rlfleet-Chunk"
END_OF_BATCH = 204
# Control lines and header blocks; payloads bypass it. It grows for a longer line.
LINE_BUFFER = 64 << 10
_CRLF = b"\r\n"
_CHUNK_PREFIX = CHUNK_HEADER.lower().encode() + b":"
_NO_RESPONDERS = 503
# How long opening a connection may take, at least. nats-py's own connect timeout (2 s by
# default) bounds one try of a client that tries again; nothing retries a shard connection
# but the caller's whole version, and on a busy host (a rollout engine on both of two
# cores) a loopback handshake can take longer than 2 s.
OPEN_TIMEOUT_S = 10.0
# The server's -ERR for a connection that sent no CONNECT in its auth timeout.
_HANDSHAKE_TIMED_OUT = "Authentication Timeout"


@dataclass
class _Ack:
    """A publish awaiting the stream's acknowledgement (JSON), or its error."""

    done: asyncio.Future[None]

    def take(self, status: int | None, payload: bytes) -> None:
        if self.done.done():
            return
        if status == _NO_RESPONDERS:
            self.done.set_exception(nats.js.errors.NoStreamResponseError())
            return
        try:
            answer = json.loads(payload)
        except ValueError:
            answer = {"error": {"code": status or 0, "description": repr(payload[:200])}}
        if "error" not in answer:
            self.done.set_result(None)
            return
        try:
            nats.js.errors.APIError.from_error(answer["error"])  # raises the code's error
        except nats.js.errors.APIError as error:
            self.done.set_exception(error)


@dataclass
class _Batch:
    """One shard request: its chunks land at index * chunk in `data`."""

    where: str
    data: memoryview
    chunk: int
    count: int
    done: asyncio.Future[int]
    got: bytearray = field(init=False)
    received: int = 0
    problem: str = ""

    def __post_init__(self) -> None:
        self.got = bytearray(self.count)

    def place(self, headers: bytes, size: int) -> memoryview | None:
        """Where a chunk's `size` payload bytes go, or None (noted) when it is off."""
        index, count = -1, 0
        for line in headers.split(_CRLF)[1:]:
            if line.lower().startswith(_CHUNK_PREFIX):
                with_count = line[len(_CHUNK_PREFIX) :].strip().split(b"/")
                if len(with_count) == 2 and all(p.isdigit() for p in with_count):
                    index, count = int(with_count[0]), int(with_count[1])
        expected = min(self.chunk, len(self.data) - index * self.chunk)
        if count != self.count or not 0 <= index < count or self.got[index] or size != expected:
            self.problem = self.problem or (
                f"chunk {index}/{count} of {size} bytes (expected {self.count} chunks)"
            )
            return None
        self.got[index] = 1
        self.received += 1
        start = index * self.chunk
        return self.data[start : start + size]


class ShardConnection(asyncio.BufferedProtocol):
    """A connection for shards' chunks; open it with `open`, close it with `close`."""

    def __init__(self) -> None:
        self._line = bytearray(LINE_BUFFER)
        self._start = self._end = 0
        self._message: tuple[_Batch | _Ack | None, int, int] | None = None  # header, total
        self._payload: memoryview | None = None
        self._ack: tuple[_Ack, int | None] | None = None  # whose payload is being read
        self._filled = 0
        self._direct = False
        self._transport: asyncio.Transport | None = None
        self._info: asyncio.Future[dict] = asyncio.get_running_loop().create_future()
        self._pong: asyncio.Future[None] | None = None
        self._waiting: dict[bytes, _Batch | _Ack] = {}
        self._inbox = ""
        self._replies = itertools.count()
        self._closed: Exception | None = None

    @classmethod
    async def open(cls, nc: Client) -> ShardConnection:
        """A connection to the server `nc` is connected to, as `nc`'s user. A server that
        timed the handshake out (it waits 2 s for CONNECT, which a starved event loop on a
        saturated machine can miss) is asked again, within the same deadline."""
        async with asyncio.timeout(max(nc.options["connect_timeout"], OPEN_TIMEOUT_S)):
            while True:
                try:
                    return await cls._open(nc)
                except nats.errors.Error as error:
                    if _HANDSHAKE_TIMED_OUT not in str(error):
                        raise
                    log.warning("a direct connection's handshake timed out: opening another")

    @classmethod
    async def _open(cls, nc: Client) -> ShardConnection:
        url = nc.connected_url
        if url is None:
            raise nats.errors.ConnectionClosedError
        loop = asyncio.get_running_loop()
        try:
            _, self = await loop.create_connection(cls, url.hostname, url.port or 4222)
        except OSError as error:
            raise nats.errors.NoServersError from error
        try:
            info = await self._info
            if info.get("tls_required"):
                raise nats.errors.Error("direct gets speak plain TCP; the server wants TLS")
            self._inbox = nc.new_inbox()
            self._write(
                b"CONNECT %s\r\nSUB %s.* 1\r\n"
                % (json.dumps(_connect_options(nc, info)).encode(), self._inbox.encode())
            )
            await self._ping()
        except BaseException:
            self.close()
            raise
        return self

    def close(self) -> None:
        if self._transport is not None:
            self._transport.close()

    async def get(
        self,
        api: str,
        request: dict,
        size: int,
        chunk: int,
        where: str,
        into: memoryview | None = None,
    ) -> memoryview:
        """The `size` bytes that the batch `request` to `api` returns, as chunks of `chunk`
        bytes naming their index, in `into` (new memory when None); CorruptShard if any
        is off or missing."""
        if self._closed is not None:
            raise self._closed
        reply = f"{self._inbox}.{next(self._replies)}"
        count = max(1, -(-size // chunk))
        done = asyncio.get_running_loop().create_future()
        # Not bytearray(size), which zeroes what the chunks overwrite anyway.
        data = into if into is not None else memoryview(np.empty(size, np.uint8))
        batch = _Batch(where, data, chunk, count, done)
        self._waiting[reply.encode()] = batch
        try:
            body = json.dumps(request).encode()
            self._write(b"PUB %s %s %d\r\n%s\r\n" % (api.encode(), reply.encode(), len(body), body))
            status = await batch.done
        finally:
            del self._waiting[reply.encode()]
        if status != END_OF_BATCH or batch.problem or batch.received != count:
            raise CorruptShard(
                f"{where}: got {batch.received} of {count} chunks (status {status})"
                + (f": {batch.problem}" if batch.problem else "")
            )
        return batch.data

    async def publish(
        self, subject: str, payload: bytes | memoryview, headers: dict[str, str], ack_wait_s: float
    ) -> None:
        """Publishes to a stream and waits up to `ack_wait_s` for its acknowledgement; the
        stream's error (`nats.js.errors.APIError`), NoStreamResponseError if none takes it."""
        reply = f"{self._inbox}.{next(self._replies)}".encode()
        ack = _Ack(asyncio.get_running_loop().create_future())
        self._waiting[reply] = ack
        block = "".join(f"{k}: {v}\r\n" for k, v in headers.items())
        head = f"NATS/1.0\r\n{block}\r\n".encode()
        try:
            self._write(
                b"HPUB %s %s %d %d\r\n%s"
                % (subject.encode(), reply, len(head), len(head) + len(payload), head)
            )
            self._write(payload)
            self._write(_CRLF)
            async with asyncio.timeout(ack_wait_s):
                await ack.done
        finally:
            del self._waiting[reply]

    async def _ping(self) -> None:
        self._pong = asyncio.get_running_loop().create_future()
        self._write(b"PING\r\n")
        await self._pong

    def _write(self, data: bytes) -> None:
        if self._closed is not None:
            raise self._closed
        assert self._transport is not None
        self._transport.write(data)

    # asyncio's side

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self._transport = transport

    def connection_lost(self, exc: Exception | None) -> None:
        self._fail(nats.errors.UnexpectedEOF() if exc is None else nats.errors.Error(repr(exc)))

    def get_buffer(self, sizehint: int) -> memoryview:
        # A payload whose start is consumed goes straight to its place.
        self._direct = self._payload is not None and self._start == self._end
        if self._direct:
            assert self._payload is not None
            return self._payload[self._filled :]
        if self._start == self._end:
            self._start = self._end = 0
        elif len(self._line) - self._end < LINE_BUFFER // 4:
            kept = self._line[self._start : self._end]
            # A line longer than the buffer: a new, larger one (the old may still be lent).
            if len(kept) * 2 > len(self._line):
                self._line = bytearray(2 * len(self._line))
            self._line[: len(kept)] = kept
            self._start, self._end = 0, len(kept)
        return memoryview(self._line)[self._end :]

    def buffer_updated(self, nbytes: int) -> None:
        if self._direct:
            self._filled += nbytes
        else:
            self._end += nbytes
        try:
            self._parse()
        except (ValueError, IndexError) as error:
            self._fail(nats.errors.ProtocolError(f"unreadable from the server: {error!r}"))
            self.close()

    def eof_received(self) -> bool:
        return False

    # the protocol

    def _parse(self) -> None:
        while True:
            if self._payload is not None:
                take = min(self._end - self._start, len(self._payload) - self._filled)
                self._payload[self._filled : self._filled + take] = memoryview(self._line)[
                    self._start : self._start + take
                ]
                self._filled += take
                self._start += take
                if self._filled < len(self._payload):
                    return
                if self._ack is not None:
                    ack, status = self._ack
                    ack.take(status, self._payload.tobytes())
                    self._ack = None
                self._payload = None
            elif self._message is not None:
                batch, header, total = self._message
                if self._end - self._start < header:
                    return
                headers = bytes(self._line[self._start : self._start + header])
                self._start += header
                self._message = None
                self._take(batch, headers, total - header)
            else:
                at = self._line.find(_CRLF, self._start, self._end)
                if at < 0:
                    return
                line = bytes(self._line[self._start : at])
                self._start = at + 2
                self._control(line)

    def _control(self, line: bytes) -> None:
        op, _, rest = line.partition(b" ")
        op = op.upper()
        if op == b"HMSG":
            # HMSG <subject> <sid> [reply] <header bytes> <total bytes>
            args = rest.split()
            self._message = (self._waiting.get(args[0]), int(args[-2]), int(args[-1]))
        elif op == b"MSG":
            # MSG <subject> <sid> [reply] <total bytes>: an ack (a chunk has headers).
            args = rest.split()
            self._take(self._waiting.get(args[0]), b"NATS/1.0", int(args[-1]))
        elif op == b"PING":
            self._write(b"PONG\r\n")
        elif op == b"PONG":
            if self._pong is not None and not self._pong.done():
                self._pong.set_result(None)
        elif op == b"INFO":
            if not self._info.done():
                self._info.set_result(json.loads(rest))
        elif op == b"-ERR":
            self._fail(nats.errors.Error(f"nats: {rest.decode(errors='replace').strip()}"))
            self.close()
        # "+OK" and the empty line after a payload need nothing.

    def _take(self, waiting: _Batch | _Ack | None, headers: bytes, size: int) -> None:
        status_line = headers.split(_CRLF, 1)[0].split()
        status = int(status_line[1]) if len(status_line) > 1 else None
        place = None
        if isinstance(waiting, _Ack):
            self._ack = (waiting, status)
        elif waiting is not None and status is not None:
            if not waiting.done.done():
                waiting.done.set_result(status)
        elif waiting is not None:
            place = waiting.place(headers, size)
        # An ack, a reply nobody waits for any more (a cancelled request), or a chunk that
        # is off: read past its payload.
        self._payload = place if place is not None else memoryview(bytearray(size))
        self._filled = 0

    def _fail(self, error: Exception) -> None:
        self._closed = self._closed or error
        for waiter in (self._info, self._pong, *(w.done for w in self._waiting.values())):
            if waiter is not None and not waiter.done():
                waiter.set_exception(error)


def _connect_options(nc: Client, info: dict) -> dict:
    """CONNECT's fields: the same user as `nc`, signing this connection's nonce."""
    options: dict = {
        "verbose": False,
        "pedantic": False,
        "lang": "python3-rlfleet-direct-get",
        "version": "1",
        "protocol": 1,
        "headers": True,
        "no_responders": True,
    }
    # nats-py keeps the credentials' callbacks (`user_jwt_cb`, `signature_cb`) privately.
    jwt, sign = nc._user_jwt_cb, nc._signature_cb
    url = nc.connected_url
    if jwt is not None and sign is not None:
        options |= {"jwt": jwt().decode(), "sig": sign(info["nonce"]).decode()}
    elif nc.options["user"] is not None:
        options |= {"user": nc.options["user"], "pass": nc.options["password"]}
    elif nc.options["token"] is not None:
        options["auth_token"] = nc.options["token"]
    elif url is not None and url.username:
        options |= {"user": url.username, "pass": url.password}
    return options
