"""Weightsync's tunables, in one place: `SyncConfig`, which lives with the other settings a
run's components get (`rlfleet.launch.settings`), so the RLRun spec can fill it in."""

from rlfleet.launch.settings import SyncConfig

__all__ = ["SyncConfig"]
