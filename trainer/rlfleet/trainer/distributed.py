"""The trainer's ranks: one DeepSpeed job over the trainer's pods, one process per GPU.

Design: rank 0 reads and scatters. Rank 0 alone holds the JetStream durable consumer,
the group buffer, validation, staleness, acknowledgements, the checkpoint's client state
and the step log; each step it decides the batch exactly as a single trainer would, cuts
it into micro-batches and scatters them across the ranks (`share`). The alternative,
data-parallel consumers with a deterministic split, would need every rank to agree on
which groups complete, which go stale and which expire, over a stream whose deliveries
differ per consumer: the decisions that make a step (`GroupBuffer`) are stateful and
timed, so agreeing on them is a protocol of its own. Trajectories are small next to the
model (tokens and routed experts), so one reader costs little, and the resume logic
(the checkpoint names the stream sequences it trained on) stays what it was.

The ranks are data-parallel over a step's micro-batches. Each micro-batch's loss is
already its share of the step's mean (divided by the whole step's tokens); DeepSpeed
averages gradients over the ranks, so each rank scales its loss by the world size and
the average becomes the sum: the gradient one rank would take over the whole step. A
rank short of micro-batches pads with one whose mask is empty (zero loss, zero gradient),
because backward's hooks reduce gradients collectively: every rank calls it as often.

Every rank must take part in every collective in the same order, so rank 0 sends an
`Order` each turn of its loop: a step (with this rank's micro-batches), idle (nothing
ready; it keeps the followers' waits under the process group's timeout and notices a
lost rank at once), or stop (all ranks leave together). A rank that dies closes its
gloo connections: the next collective fails on every other rank, which exits nonzero, so
the pods restart and the job resumes from the last checkpoint. A rank that hangs, or an
unreachable host, is given up on after the process group's timeout (DeepSpeed's
`init_distributed` default, 10 minutes), NCCL's watchdog likewise.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

import deepspeed
import torch
import torch.distributed as dist
from deepspeed.accelerator import get_accelerator

from rlfleet.launch.settings import Ranks
from rlfleet.trainer.rows import Rows, idle_rows


def init_distributed(ranks: Ranks, local_rank: int) -> None:
    """Joins the job as `ranks.rank(local_rank)` of `ranks.world`, through the environment
    `torch.distributed`'s env:// rendezvous reads."""
    address, port = ranks.master_addr, ranks.master_port
    if ranks.world == 1:
        # A job of one meets nobody: itself on loopback (no need to resolve pod 0's name),
        # on any free port, so trainers sharing a host never clash.
        address = "127.0.0.1"
        with socket.socket() as s:
            s.bind((address, 0))
            port = s.getsockname()[1]
    os.environ.update(
        RANK=str(ranks.rank(local_rank)),
        LOCAL_RANK=str(local_rank),
        WORLD_SIZE=str(ranks.world),
        MASTER_ADDR=address,
        MASTER_PORT=str(port),
    )
    # The CPU accelerator defaults to oneCCL; gloo needs nothing installed.
    backend = "gloo" if get_accelerator().device_name() == "cpu" else None
    deepspeed.init_distributed(dist_backend=backend, auto_mpi_discovery=False)


def leave() -> None:
    """Leaves the job's process group, if this process joined one. A rank that exits still
    in it can abort as the group's threads are torn down with the interpreter (CI, a
    2-pod ZeRO-2 job: rank 0 trained every step, then died of SIGABRT, "terminate called
    without an active exception")."""
    if dist.is_initialized():
        dist.destroy_process_group()


def rank() -> int:
    return dist.get_rank()


def world() -> int:
    return dist.get_world_size()


class Kind(Enum):
    STEP = "step"
    RESTORE = "restore"  # back to step `step`'s checkpoint (a production run's reset)
    IDLE = "idle"
    STOP = "stop"


@dataclass
class Order:
    """What rank 0 tells a rank to do next: for a step, its number (the checkpoint's tag),
    this rank's micro-batches, the whole step's generated tokens, the checkpoint to keep
    however old (`Policy.save`) and this rank's share of the held-out trajectories."""

    kind: Kind
    step: int = 0
    micro_batches: list[Rows] = field(default_factory=list)
    tokens: int = 0
    pinned: tuple[int, ...] = ()
    held_out: list[Rows] = field(default_factory=list)


def share(micro_batches: list[Rows], ranks: int) -> list[list[Rows]]:
    """The step's micro-batches dealt round-robin over `ranks`, each rank's list padded
    to the same length with a micro-batch that trains on nothing: every rank must call
    backward (whose hooks reduce gradients collectively) as often as the others."""
    if not micro_batches:  # nothing to deal (a step with nothing held out): no filler either
        return [[] for _ in range(ranks)]
    shares = [micro_batches[r::ranks] for r in range(ranks)]
    longest = max(len(s) for s in shares)
    filler = idle_rows(min(micro_batches, key=lambda rows: rows.batch.inputs.numel()))
    return [s + [filler] * (longest - len(s)) for s in shares]


def send(orders: list[Order]) -> Order:
    """Rank 0: gives each rank its order (`orders[r]` to rank r); returns rank 0's own."""
    if len(orders) == 1:
        return orders[0]
    received: list[Order | None] = [None]
    dist.scatter_object_list(received, orders, src=0)
    assert received[0] is not None
    return received[0]


def receive() -> Order:
    """A rank other than 0: waits for its next order."""
    received: list[Order | None] = [None]
    dist.scatter_object_list(received, None, src=0)
    assert received[0] is not None
    return received[0]


def gather(obj: Any) -> list[Any]:
    """Every rank's `obj`, in rank order (weightsync's `Part.gather`)."""
    if world() == 1:
        return [obj]
    gathered: list[Any] = [None] * world()
    dist.all_gather_object(gathered, obj)
    return gathered


def reduce(values: torch.Tensor, op: dist.ReduceOp.RedOpType) -> torch.Tensor:
    """`values` reduced over every rank with `op`, on the host, or as is in a job of one."""
    if world() == 1:
        return values
    # NCCL reduces device tensors only; gloo takes either.
    on_device = values.to(get_accelerator().current_device_name())
    dist.all_reduce(on_device, op=op)
    return on_device.cpu()
