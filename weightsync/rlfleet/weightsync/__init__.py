"""Weightsync: lossless sharded weight deltas over NATS JetStream, applied inside vLLM.

This is the public API; other components import from here, never from the modules.
Trainers publish (`Publisher`; ranks that each hold part of the model pass their `Part`
and publish the tensors `owned_names` gives them), rollout workers receive (`Receiver`)
or let vLLM's workers receive (`vllm_options`, `vllm_start`, `vllm_held`,
`vllm_update`, and their `_async` twins for vLLM's OpenAI-compatible server). A
component that adds its own methods to vLLM's workers subclasses `WeightsyncWorker` and
names its class in `vllm_options(worker_extension=...)`.
`wait_for_version` (and its async twin) waits until an engine serves a version;
`write_checkpoint` writes a version's tensors as a Hugging Face checkpoint (and
`python -m rlfleet.weightsync.checkpoint` a run's version off its stream).
"""

from rlfleet.weightsync.checkpoint import write_checkpoint
from rlfleet.weightsync.config import SyncConfig
from rlfleet.weightsync.publisher import Publisher, PublishFailed
from rlfleet.weightsync.ranks import Part, owned_names
from rlfleet.weightsync.receiver import Receiver
from rlfleet.weightsync.state import WeightState
from rlfleet.weightsync.transport import WeightStream
from rlfleet.weightsync.versions import wait_for_version, wait_for_version_async
from rlfleet.weightsync.vllm_client import Update as VllmUpdate
from rlfleet.weightsync.vllm_client import held as vllm_held
from rlfleet.weightsync.vllm_client import held_async as vllm_held_async
from rlfleet.weightsync.vllm_client import hold_at_most_async as vllm_hold_at_most_async
from rlfleet.weightsync.vllm_client import llm_options as vllm_options
from rlfleet.weightsync.vllm_client import start as vllm_start
from rlfleet.weightsync.vllm_client import start_async as vllm_start_async
from rlfleet.weightsync.vllm_client import status as vllm_status
from rlfleet.weightsync.vllm_client import update as vllm_update
from rlfleet.weightsync.vllm_client import update_async as vllm_update_async
from rlfleet.weightsync.vllm_worker import WeightsyncWorker

__all__ = [
    "Part",
    "PublishFailed",
    "Publisher",
    "Receiver",
    "SyncConfig",
    "VllmUpdate",
    "WeightState",
    "WeightStream",
    "WeightsyncWorker",
    "owned_names",
    "vllm_held",
    "vllm_held_async",
    "vllm_hold_at_most_async",
    "vllm_options",
    "vllm_start",
    "vllm_start_async",
    "vllm_status",
    "vllm_update",
    "vllm_update_async",
    "wait_for_version",
    "wait_for_version_async",
    "write_checkpoint",
]
