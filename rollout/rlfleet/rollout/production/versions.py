"""Which policy version a production server serves, switched in place as it is told.

Each server is in a set of the pool's servers (the canary set, or the stable rest); the
run's serving stream holds the version each set is to serve, written by whoever runs the
run's cycles, and the version it may be told next (its standby). The server's vLLM
workers follow the run's weights (weightsync) into a host copy while it serves, up to
the version to serve and no further; once they hold it, the scheduler is paused keeping
every request, the copy is written into the model, and serving resumes: no request
fails, and tokens after the switch carry the new version. A set told an older version
than it serves (a canary rolled back) goes back the same way: its workers rebuild that
version from the snapshot before it, verified against its digest, so it serves it bit
for bit again. That needs the version still on the weight stream
(`SyncConfig.keep_snapshots`); one retired is never reached, and the server goes on
serving what it serves.

Between switches the host copy holds the standby (a candidate ahead, or the version a
canary replaced), fetched or rebuilt while the server serves: the pause is then only the
write, and the requests in flight wait for nothing else.
"""

from __future__ import annotations

import asyncio
import logging

from nats.js.errors import NotFoundError
from prometheus_client import Gauge, Info

from rlfleet.api.inferencepool import SERVED_WEIGHTS
from rlfleet.api.wire import ServingTarget, decode_serving_target, serving_stream, serving_subject
from rlfleet.launch.production import ServingConfig
from rlfleet.rollout.production.capture import Bus
from rlfleet.weightsync import (
    vllm_held_async,
    vllm_hold_at_most_async,
    vllm_start_async,
    vllm_update_async,
)

log = logging.getLogger(__name__)

serving_version = Gauge("rlfleet_serving_policy_version", "Policy version the server serves")
# The region operator reads it from every serving pod (InferencePool.status.servedVersions).
served_weights = Info(SERVED_WEIGHTS, "The run, replica set, served version and its digest")
switch_pause = Gauge("rlfleet_serving_switch_pause_seconds", "The last switch's pause")


class VersionFollower:
    def __init__(self, config: ServingConfig, bus: Bus) -> None:
        if config.replica_set is None:
            raise ValueError("a server that follows versions names its replica set")
        self.config = config
        self.bus = bus
        self.replica_set = config.replica_set
        self.serving = config.base_version
        self.ceiling: int | None = None  # what the workers were told to hold at most

    async def run(self, state) -> None:
        """Follow the set's version for as long as the server runs (`state` is the app's:
        vLLM puts its engine there as it starts). A failure is logged and tried again
        while the server goes on serving what it serves."""
        config = self.config
        self.announce(self.serving, "")
        engine = None
        while True:
            try:
                if engine is None and hasattr(state, "engine_client"):
                    await vllm_start_async(
                        state.engine_client,
                        config.nats_url,
                        config.run,
                        config.weights_domain,
                        config.weightsync,
                    )
                    engine = state.engine_client
                target = None if engine is None else await self.target()
                if target is not None:
                    await self.switch(engine, target)
            except Exception:
                log.exception("following set %s's version; trying again", self.replica_set)
            await asyncio.sleep(config.poll_s)

    async def target(self) -> ServingTarget | None:
        js = self.bus.jetstream()
        if js is None:
            return None  # NATS is away: serve what it serves
        run = self.config.run
        subject = serving_subject(run, self.replica_set)
        try:
            message = await js.get_last_msg(serving_stream(run), subject, direct=True)
        except NotFoundError:
            return None
        target = decode_serving_target(message.data)  # a refusal is logged by the caller
        if (target.run, target.replica_set) != (run, self.replica_set):
            raise ValueError(f"{subject} holds the target of {target.run}/{target.replica_set}")
        return target

    async def switch(self, engine, target: ServingTarget) -> None:
        """Load the target's version once the workers hold it, forward or back; otherwise
        hold its standby version ready."""
        version = target.version
        ceiling = self._ceiling_for(target)
        if self.ceiling != ceiling:
            await vllm_hold_at_most_async(engine, ceiling)
            self.ceiling = ceiling
        if version == self.serving or await vllm_held_async(engine) != version:
            return  # served already; or not fetched, or not rebuilt, yet
        update = await vllm_update_async(engine, version)
        self.serving = update.version
        self.announce(update.version, update.digest or "")
        switch_pause.set(update.pause_s)
        log.warning(  # on-call reads which version production serves
            "set %s serves version %d (digest %s); paused %.3fs, writing %.3fs of it",
            self.replica_set, update.version, update.digest, update.pause_s, update.write_s,
        )  # fmt: skip

    def _ceiling_for(self, target: ServingTarget) -> int:
        """The version the workers are to hold. A set told another version than it serves
        holds exactly that one, fetching a newer one or rebuilding an older one. A set
        told what it serves holds the target's standby, ahead or back; with none named it
        keeps what it holds (a fetched candidate that was sent back: the next one is
        newer, and going back would be a rebuild for nothing)."""
        if target.version != self.serving:
            return target.version
        if target.standby is not None:
            return target.standby
        return target.version if self.ceiling is None else self.ceiling

    def announce(self, version: int, digest: str) -> None:
        """Says on /metrics what the server serves: the pool's operator reads it."""
        serving_version.set(version)
        served_weights.info(
            {
                "run": self.config.run,
                "replica_set": self.replica_set,
                "version": str(version),
                "digest": digest,
            }
        )
