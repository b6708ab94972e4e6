"""Where the trainer's checkpoints live: a volume per pod, or one folder every node shares.

A trainer pod's claim is usually its own (a volume per pod): each node's first process
writes the model states its ranks resume from and prunes its own old steps. On a
ReadWriteMany volume every node sees one folder: were each node's first process to write
the model states and prune, they would write one file at once and remove one step twice,
and the second removal fails (`bench/scaleout.py`: `FileNotFoundError`, the job down).
So the job finds out which it has, once, at start (`shared_across_nodes`), and one process
per folder writes the model states and prunes (`prunes`).
"""

from __future__ import annotations

import shutil
import uuid
from collections.abc import Collection
from pathlib import Path

import torch
import torch.distributed as dist

from rlfleet.trainer import distributed


def tag(step: int) -> str:
    return f"step-{step:08d}"


def shared_across_nodes(directory: Path, local_rank: int) -> bool:
    """Collective: whether some node sees another node's mark in `directory`, that is
    whether nodes share the folder. Every rank gets the same answer."""
    if distributed.world() == 1:
        return False
    token = [uuid.uuid4().hex if distributed.rank() == 0 else None]
    dist.broadcast_object_list(token, src=0)  # one job, one name: old marks never count
    directory.mkdir(parents=True, exist_ok=True)
    mark = directory / f".node-{token[0]}-{distributed.rank()}"
    if local_rank == 0:
        mark.touch()
    dist.barrier()
    seen = len(list(directory.glob(f".node-{token[0]}-*")))
    dist.barrier()  # everyone has looked before any mark goes
    if local_rank == 0:
        mark.unlink()
    shared = distributed.reduce(torch.tensor([float(seen > 1)]), dist.ReduceOp.MAX)
    return bool(shared[0])


def prunes(shared: bool, local_rank: int) -> bool:
    """Whether this process writes its folder's model states and prunes it: the job's
    first on a shared folder, each node's first on a folder of its own."""
    return distributed.rank() == 0 if shared else local_rank == 0


def prune(directory: Path, keep: int, pinned: Collection[int]) -> None:
    """Removes all but the newest `keep` steps, and the `pinned` ones."""
    steps = sorted(p for p in directory.glob("step-*") if p.is_dir())
    kept = {tag(step) for step in pinned}
    for old in steps[:-keep]:
        if old.name not in kept:
            shutil.rmtree(old)
