"""Methods mixed into vLLM's worker (`worker_extension_cls`), callable by name over RPC."""

from __future__ import annotations

from typing import Any


class WeightsyncWorker:
    def rlfleet_weightsync_status(self) -> dict[str, Any]:
        """The version the worker holds verified, the one its model runs, that version's
        verified digest, and the worker's own digest of what it loaded."""
        return self.weight_transfer_engine.status()

    def rlfleet_weightsync_hold_at_most(self, version: int | None) -> None:
        """Hold no newer version than `version`, going back to it if need be."""
        self.weight_transfer_engine.hold_at_most(version)

    def rlfleet_weightsync_forget_loaded(self) -> None:
        """Take the model's weights as unknown: the next update reloads every tensor."""
        self.weight_transfer_engine.forget_loaded()

    def rlfleet_weightsync_update(self, update_info: dict[str, Any]) -> dict[str, Any]:
        """vLLM's three update calls in one RPC, then the status: one round trip per pause."""
        self.start_weight_update()
        self.update_weights(update_info)
        self.finish_weight_update()
        return self.weight_transfer_engine.status()
