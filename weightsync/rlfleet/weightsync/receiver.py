"""The rollout side: follow a run's versions and hold the newest one, verified.

The receiver reads manifests as they appear, plans the cheapest way from what it holds
to the newest version (deltas forward, or the newest usable snapshot), fetches each
version's shards in parallel, re-fetching a bad shard alone, and applies the version
all or nothing. A version that fails verification is set aside and the receiver
rebuilds from a snapshot instead. It never holds anything but a verified version.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import threading
from collections.abc import Awaitable, Callable

import msgspec

from rlfleet.api.wire import WeightManifest, decode_manifest
from rlfleet.bus.patience import TRANSIENT, patiently
from rlfleet.bus.reading import messages
from rlfleet.launch.stopping import wait_set
from rlfleet.weightsync import metrics
from rlfleet.weightsync.buffers import ShardBuffers
from rlfleet.weightsync.direct import ShardConnection
from rlfleet.weightsync.errors import CorruptShard, NotOurs, UnknownBase, WeightsyncError
from rlfleet.weightsync.plan import Key, plan
from rlfleet.weightsync.shards import apply_version, checksum
from rlfleet.weightsync.state import WeightState
from rlfleet.weightsync.transport import WeightStream

log = logging.getLogger(__name__)

# Called after each applied version with its manifest and the tensors it changed.
OnVersion = Callable[[WeightManifest, set[str]], Awaitable[None]]

FETCH_ATTEMPTS = 3
# A following receiver looks for new manifests this often, and more often for a while
# after one is published (a region's mirror may take a moment to hold it).
IDLE_POLL_S = 1.0
NUDGED_POLL_S = 0.05
NUDGED_POLLS = 20


class Receiver:
    def __init__(
        self,
        stream: WeightStream,
        state: WeightState | None = None,
        on_version: OnVersion | None = None,
        fetch_timeout: float = 30.0,
    ) -> None:
        self.stream = stream
        self.state = state or WeightState()
        self.on_version = on_version
        self.fetch_timeout = fetch_timeout
        self.known: dict[Key, WeightManifest] = {}
        # Held while a version is written into `state`; readers of `state` take it too.
        self.state_lock = threading.Lock()
        # Tensors changed since the last `take_changed`, for engines that copy `state`.
        self._changed: set[str] = set()
        # The memory of the version applied last, for the next one's shards.
        self.buffers = ShardBuffers()
        self._refused: set[Key] = set()
        self._unreachable: set[int] = set()
        self._read = 0  # the stream sequence of the last manifest read
        # The newest version to hold; None: the newest there is. Below the one held, the
        # receiver goes back to it (from a snapshot): a server told to serve it again.
        self.ceiling: int | None = None

    @property
    def version(self) -> int | None:
        return self.state.version

    def _take(self, data: bytes, subject: str) -> None:
        try:
            manifest = decode_manifest(data)
            if (
                manifest.run != self.stream.run
                or self.stream.subjects.version_of(subject) != manifest.version
            ):
                raise NotOurs(
                    f"{subject}: manifest of run {manifest.run} version {manifest.version}"
                )
        except (msgspec.DecodeError, ValueError, WeightsyncError) as error:
            metrics.REJECTED.labels(NotOurs.reason).inc()
            log.warning(
                "ignored a message on %s that is not a manifest of ours: %s", subject, error
            )
            return
        self.known[(manifest.version, manifest.kind)] = manifest

    async def sync(self) -> int | None:
        """Read every manifest on the stream now, then move to the newest version."""
        await patiently(self._read_manifests, "reading manifests")
        await self.advance()
        return self.version

    async def follow(self, stop: asyncio.Event) -> None:
        """Apply new versions as their manifests appear, until `stop` is set."""
        # Never gives up: a receiver outlives NATS restarts and waits for a late publisher.
        await patiently(lambda: self._follow_until(stop), "following manifests", math.inf)

    async def _read_manifests(self, check_anew: bool = True) -> int:
        """Reads the manifests the stream holds past the last one read, by direct gets (a
        receiver makes no consumer, and needs no right to); returns how many. A stream
        made anew, its sequences starting again, is read from its start (with
        `check_anew`, the server is asked when nothing was read)."""
        stream, subject = self.stream.subjects.stream, self.stream.subjects.manifests
        read = 0
        async for message in messages(self.stream.js, stream, subject, after=self._read):
            self._take(message.data, message.subject)
            self._read = message.seq or self._read
            read += 1
        made_anew = (
            check_anew
            and not read
            and self._read
            and (await self.stream.js.stream_info(stream)).state.last_seq < self._read
        )
        if made_anew:
            self._read = 0
            return await self._read_manifests()
        return read

    async def _follow_until(self, stop: asyncio.Event) -> None:
        nudged = asyncio.Event()
        announced = -1  # the newest version a nudge named

        async def nudge(message) -> None:
            nonlocal announced
            with contextlib.suppress(ValueError):  # not a manifest's subject: a wake all the same
                announced = max(announced, self.stream.subjects.version_of(message.subject))
            nudged.set()

        # A manifest published wakes the receiver at once; it reads it from its stream,
        # where a region's mirror may hold it a moment later: it looks again shortly until
        # it knows every version a nudge named. (Looking on after that, with a version
        # every third of a second as in the demo, was 40 requests a second for good, in
        # the engine's process.) A stream made anew, rare, is asked about once a second.
        wake = await self.stream.nc.subscribe(self.stream.subjects.manifests, cb=nudge)
        loop = asyncio.get_running_loop()
        soon, asked_anew = 0, -math.inf
        try:
            while not stop.is_set():
                check_anew = loop.time() - asked_anew >= IDLE_POLL_S
                if check_anew:
                    asked_anew = loop.time()
                read = await self._read_manifests(check_anew)
                if read or self._behind():
                    await self.advance()
                if read and announced <= max((v for v, _ in self.known), default=-1):
                    soon = 0
                await wait_set(nudged, NUDGED_POLL_S if soon else IDLE_POLL_S)
                soon = NUDGED_POLLS if nudged.is_set() else max(0, soon - 1)
                nudged.clear()
        finally:
            await wake.unsubscribe()

    def _wanted(self) -> list[int]:
        """Known versions it may hold, newest first."""
        versions = {v for v, _ in self.known if self.ceiling is None or v <= self.ceiling}
        return sorted(versions, reverse=True)

    def _behind(self) -> bool:
        newest = next(iter(self._wanted()), None)
        return newest is not None and newest not in self._unreachable and newest != self.version

    async def advance(self) -> None:
        """Move to the newest known version (up to `ceiling`) reachable from here, or stay
        put."""
        while True:
            usable = {key: m for key, m in self.known.items() if key not in self._refused}
            steps = self._best_plan(usable)
            if not steps or await self._walk(steps):
                return

    def _best_plan(self, usable: dict[Key, WeightManifest]) -> list[Key] | None:
        wanted = {version for version, _ in usable} & set(self._wanted())
        for target in sorted(wanted, reverse=True):
            if target == self.version:
                return []
            steps = plan(usable, self.version, target)
            if steps is not None:
                return steps
            if target not in self._unreachable:
                # A delta whose base nobody has: counted once, never applied.
                self._unreachable.add(target)
                metrics.REJECTED.labels(UnknownBase.reason).inc()
                log.warning(
                    "version %d cannot be reached from %s: unknown base", target, self.version
                )
        return None

    async def _walk(self, steps: list[Key]) -> bool:
        """Apply the steps in order; False if one was refused and a new plan is needed.

        The next step's shards are fetched while a step is applied (a joining receiver's
        deltas arrive during its snapshot's decoding): two steps' shards are held at most.
        """
        upcoming = [asyncio.ensure_future(self.fetch(self.known[steps[0]]))] if steps else []
        try:
            return await self._walk_fetched(steps, upcoming)
        finally:
            for fetch in upcoming:
                fetch.cancel()
            await asyncio.gather(*upcoming, return_exceptions=True)

    async def _walk_fetched(self, steps: list[Key], upcoming: list[asyncio.Future]) -> bool:
        for step, key in enumerate(steps):
            manifest = self.known[key]
            try:
                shards = await upcoming.pop()
                if step + 1 < len(steps):
                    upcoming.append(asyncio.ensure_future(self.fetch(self.known[steps[step + 1]])))
                changed = await asyncio.to_thread(self._apply, manifest, shards)
                self.buffers.give(shards)
            except TRANSIENT as error:
                log.warning("version %d (%s) stalled: %s; will retry", key[0], key[1], error)
                return True
            except WeightsyncError as error:
                metrics.REJECTED.labels(error.reason).inc()
                log.error("refused version %d (%s): %s; planning around it", key[0], key[1], error)
                self._refused.add(key)
                return False
            metrics.APPLIED.labels(manifest.kind).inc()
            metrics.VERSION.set(manifest.version)
            log.info(
                "holding version %d (%s, %d tensors changed)",
                manifest.version,
                manifest.kind,
                len(changed),
            )
            if self.on_version is not None:
                await self.on_version(manifest, changed)
        return True

    def _apply(self, manifest: WeightManifest, shards: list[memoryview]) -> set[str]:
        with self.state_lock:
            changed = apply_version(self.state, manifest, shards)
            self._changed |= changed if manifest.kind == "delta" else set(self.state.tensors)
            return changed

    def take_changed(self) -> set[str]:
        """Names changed since the last call (all, after a snapshot); hold `state_lock`."""
        changed, self._changed = self._changed, set()
        return changed

    async def fetch(self, manifest: WeightManifest) -> list[memoryview]:
        """Every shard of the version; a bad shard is fetched again alone.

        At most `parallel_fetches` shards are requested at once, each over a connection
        of its own, and only their buffers are held besides the shards already fetched.
        They land in `buffers`, the memory of the version applied last, where it fits.
        Raises CorruptShard when a shard stays bad, TimeoutError when the stream stays
        unreachable (transient: the version is not refused for it).
        """
        count = min(self.stream.config.parallel_fetches, len(manifest.shards))
        async with self.stream.connections(max(1, count)) as connections:
            return await self._fetch(manifest, connections)

    async def _fetch(
        self, manifest: WeightManifest, connections: list[ShardConnection]
    ) -> list[memoryview]:
        # The idle connections: taking one is the window's bound.
        idle: asyncio.Queue[ShardConnection] = asyncio.Queue()
        for connection in connections:
            idle.put_nowait(connection)

        async def one(index: int) -> memoryview:
            ref = manifest.shards[index]
            where = f"version {manifest.version} shard {index}"
            last_problem = ""
            for attempt in range(1, FETCH_ATTEMPTS + 1):
                connection = await idle.get()
                try:
                    async with asyncio.timeout(self.fetch_timeout):
                        into = self.buffers.take(ref.size)
                        data = await self.stream.fetch_shard(manifest, ref, connection, into)
                except TimeoutError:
                    log.warning(
                        "%s, attempt %d: no answer in %.0fs", where, attempt, self.fetch_timeout
                    )
                    continue
                except CorruptShard as error:
                    data, problem = memoryview(b""), str(error)
                else:
                    bad = checksum(data) != ref.checksum
                    problem = f"{where}: checksum mismatch" if bad else ""
                finally:
                    idle.put_nowait(connection)
                if not problem:
                    metrics.FETCHED_BYTES.inc(len(data))
                    return data
                metrics.REJECTED.labels(CorruptShard.reason).inc()
                log.warning("attempt %d: %s", attempt, problem)
                last_problem = problem
            if last_problem:
                raise CorruptShard(
                    f"{where}: still bad after {FETCH_ATTEMPTS} fetches: {last_problem}"
                )
            raise TimeoutError(f"{where}: no answer after {FETCH_ATTEMPTS} tries")

        return list(await asyncio.gather(*(one(i) for i in range(len(manifest.shards)))))
