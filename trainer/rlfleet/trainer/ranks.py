"""Starting this pod's ranks: one process per local rank (`Ranks.procs_per_node`), or the
one rank in this process when a pod runs one."""

from __future__ import annotations

import asyncio
import logging
import os
import signal

import torch.multiprocessing

from rlfleet.launch.settings import TrainerConfig
from rlfleet.trainer import distributed
from rlfleet.trainer.follower import follow
from rlfleet.trainer.loop import Trainer


def too_few_gpus(procs: int, gpus: int) -> str | None:
    """Why a pod that sees `gpus` CUDA devices cannot run `procs` ranks, or None. A pod
    with none runs its ranks on the CPU (gloo), as this project's tests do; one with
    fewer GPUs than ranks would put two ranks on a GPU, and NCCL refuses that mid-job."""
    if 0 < gpus < procs:
        return (
            f"{procs} ranks per pod (spec.trainer.gpusPerReplica) but this pod sees {gpus} "
            "GPUs: the node gave fewer than requested, or CUDA_VISIBLE_DEVICES hides some"
        )
    return None


def launch(config: TrainerConfig) -> None:
    """Runs this pod's ranks until the job stops; raises if one of them fails (the others
    are then stopped too, so the pod restarts whole)."""
    if config.ranks.procs_per_node == 1:
        run_rank(0, config)
        return
    ranks = torch.multiprocessing.start_processes(
        run_rank,
        args=(config,),
        nprocs=config.ranks.procs_per_node,
        start_method="spawn",
        join=False,
    )

    def forward(signum: int, _frame) -> None:
        # The kubelet signals the pod's first process only; rank 0 decides what stops.
        for process in ranks.processes:
            if process.pid is not None and process.is_alive():
                os.kill(process.pid, signum)

    signal.signal(signal.SIGTERM, forward)
    while not ranks.join():
        pass


def run_rank(local_rank: int, config: TrainerConfig) -> None:
    """One rank of the job: rank 0 trains from the stream, the others follow it."""
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        _run(local_rank, config)
    finally:
        distributed.leave()


def _run(local_rank: int, config: TrainerConfig) -> None:
    if config.ranks.rank(local_rank) != 0:
        # All ranks leave together when rank 0 says so (SIGTERM there finishes the step
        # under way first); a rank that left alone would fail the step for everyone.
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        asyncio.run(follow(config, local_rank))
        return
    trainer = Trainer(config)

    async def run() -> None:
        # SIGTERM finishes the step under way (checkpoint, publish, ack) and exits.
        asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, trainer.stopping.set)
        await trainer.run()

    asyncio.run(run())
