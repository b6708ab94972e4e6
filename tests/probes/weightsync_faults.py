"""A worker extension for probes that injects faults into weightsync inside vLLM.

Named to vLLM as `weightsync_faults.FaultyWorker`, with this folder on PYTHONPATH.
"""

from __future__ import annotations

from typing import Any

from rlfleet.weightsync import WeightsyncWorker


class _CorruptOnce:
    """The engine's tensor-parallel group, but the next tensor received from a broadcast
    arrives with one bit of its last byte flipped (where the last worker's shard is)."""

    def __init__(self, engine: Any) -> None:
        self.engine, self.group = engine, engine._group

    def __getattr__(self, name: str) -> Any:
        return getattr(self.group, name)

    def broadcast(self, tensor, src: int = 0):
        received = self.group.broadcast(tensor, src)
        received[-1] ^= 1
        self.engine._group = self.group  # once
        return received


class FaultyWorker(WeightsyncWorker):
    def probe_corrupt_next_received(self, rank: int) -> bool:
        """On tensor-parallel rank `rank` (a follower), corrupt the first tensor received
        in the next update, after the broadcast and before vLLM loads it."""
        engine = self.weight_transfer_engine
        if engine._group.rank_in_group != rank:
            return False
        assert not engine.leads, "the leader sends, it receives nothing"
        engine._group = _CorruptOnce(engine)
        return True
