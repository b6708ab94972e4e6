"""The DeepSpeed configuration the trainer initialises its engine with: its own settings,
and under them the user's (`spec.trainer.deepSpeedConfigMap`). Pure, and free of torch, so
a bad user file is refused before anything loads."""

from __future__ import annotations

import copy
from collections.abc import Iterator, Mapping
from typing import Any

from rlfleet.launch.settings import TrainerConfig

# Set by the trainer outside the DeepSpeed JSON, so a user's value would fight it: the
# optimiser and its schedule are torch's, built from the trainer's settings and handed to
# DeepSpeed (and kept in its checkpoints); the precision is the RLRun's
# (`spec.trainer.precision`, bf16 over float32 master weights or float32), which the
# scores, the reference model and the kernels (`numerics`) follow; a step's size is the
# loop's, counted in tokens, not DeepSpeed's batch.
# ZeRO's optimizer offload runs DeepSpeed's own CPU Adam (it refuses a client optimizer,
# `zero_force_ds_cpu_optimizer`), which needs a compiler the trainer image does not carry.
RESERVED = (
    "train_batch_size",
    "optimizer",
    "scheduler",
    "bf16",
    "fp16",
    "amp",
    "torch_autocast",
    "zero_optimization.offload_optimizer",
)
# The trainer's choices a user may change.
DEFAULTS: dict[str, Any] = {"steps_per_print": 1 << 30}  # the loop logs its own steps
# Where the RLRun says what a refused key would.
SPEC_FIELDS = {
    "zero_optimization.stage": "spec.trainer.zeroStage",
    "bf16": "spec.trainer.precision",
    "fp16": "spec.trainer.precision",
}


def own_settings(config: TrainerConfig, shared_checkpoints: bool = False) -> dict[str, Any]:
    """What the trainer decides, whatever the user's file says. `shared_checkpoints`: every
    node sees one checkpoint folder (`checkpoints.shared_across_nodes`)."""
    return {
        # DeepSpeed keeps float32 master weights and optimiser state under bf16.
        "bf16": {"enabled": config.precision == "bf16"},
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        # A step has as many micro-batches as its tokens need: the loop owns the boundary.
        "managed_gradient_accumulation": False,
        "gradient_clipping": config.grad_clip,
        "zero_optimization": {"stage": config.zero_stage},
        "zero_allow_untested_optimizer": True,  # torch's AdamW
        # A trainer pod checkpointing to its own volume has its first process write the
        # model states its ranks resume from; on a shared folder rank 0 alone writes them.
        "checkpoint": {"use_node_local_storage": not shared_checkpoints},
    }


def _leaves(settings: Mapping[str, Any], prefix: str = "") -> Iterator[str]:
    """The dotted paths of the keys of `settings` that hold no object."""
    for key, value in settings.items():
        if isinstance(value, Mapping):
            yield from _leaves(value, f"{prefix}{key}.")
        else:
            yield f"{prefix}{key}"


def owned_paths(own: Mapping[str, Any]) -> set[str]:
    """The key paths a user's file may not set: the leaves of `own` and `RESERVED`.
    An object of `own` (`zero_optimization`) stays open to the user's other keys."""
    return set(_leaves(own)) | set(RESERVED)


def _clashes(user: Mapping[str, Any], owned: set[str], prefix: str = "") -> list[str]:
    """The user's key paths that set an owned one: the key itself, an object holding
    owned keys given as something else (`"zero_optimization": 3`), or an object under an
    owned key (`bf16`, reported once, not key by key)."""
    found = []
    for key, value in user.items():
        path = f"{prefix}{key}"
        if path in owned or (
            not isinstance(value, Mapping) and any(o.startswith(f"{path}.") for o in owned)
        ):
            found.append(path)
        elif isinstance(value, Mapping):
            found.extend(_clashes(value, owned, f"{path}."))
    return found


def merged(user: Mapping[str, Any], own: Mapping[str, Any]) -> dict[str, Any]:
    """`DEFAULTS`, then the user's settings, then `own` on top, nested objects merged key
    by key. A user key that `own` or `RESERVED` holds is an error naming every such key."""
    clashes = _clashes(user, owned_paths(own))
    if clashes:
        hints = [f"{path} is {SPEC_FIELDS[path]}" for path in clashes if path in SPEC_FIELDS]
        raise ValueError(
            f"deepSpeedConfigMap's ds_config.json sets keys the trainer sets itself: "
            f"{', '.join(clashes)}; remove them"
            + (f" ({'; '.join(hints)} in the RLRun)" if hints else "")
        )
    result = copy.deepcopy(DEFAULTS) | copy.deepcopy(dict(user))
    _overlay(result, own)
    return result


def _overlay(target: dict[str, Any], top: Mapping[str, Any]) -> None:
    for key, value in top.items():
        if isinstance(value, Mapping) and isinstance(target.get(key), dict):
            _overlay(target[key], value)
        else:
            target[key] = copy.deepcopy(value)


def deepspeed_config(config: TrainerConfig, shared_checkpoints: bool = False) -> dict[str, Any]:
    """The engine's configuration: the user's (`config.deepspeed`) under the trainer's."""
    return merged(config.deepspeed, own_settings(config, shared_checkpoints))
