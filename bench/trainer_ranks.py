"""Benchmark: a training step's seconds with 1 and 2 trainer ranks on the tiny MoE.

Prints one JSON object. Each configuration is the real trainer (`python -m rlfleet.trainer`,
DeepSpeed on the CPU accelerator, gloo) fed the same synthetic trajectories over a real
NATS hub (`StandaloneNats`); two ranks are two processes bound as the operator's pods
are (node_rank 0 and 1 of two nodes). A step is read from the trainer's step log
(`step_seconds`: forward, backward and optimiser step over every micro-batch, the ranks
splitting them); the first step (warm-up) is left out.

- `step_s_by_ranks`: the median step's seconds per rank count.
- `speedup`: one rank's over two ranks', measured in this same run.
- `threads_per_rank`: torch threads each rank gets, the host's cores split evenly, as
  one rank per GPU splits a node.

`--quick` runs both configurations for two steps of one group (still two micro-batches a
step, to split), to check the script.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from rlfleet.api.wire import Segment, Trajectory, encode_trajectory, trajectory_subject
from rlfleet.bus.streams import ensure_run_streams
from rlfleet.launch.caches import own_temporary_caches
from rlfleet.local.nats import HUB_DOMAIN, StandaloneNats
from rlfleet.models.tiny import init_model

RANKS = (1, 2)
GROUP = 8
LENGTH = 96  # tokens per trajectory
PROMPT = 16
GROUPS_PER_STEP = 4
STEPS = 6
MICRO_BATCH_TOKENS = 512  # padded tokens per micro-batch: several per step to split
QUICK = {"GROUPS_PER_STEP": 1, "STEPS": 2}  # the first step is left out: one is measured


def _trajectory(run: str, group: int, attempt: int) -> bytes:
    rng = np.random.default_rng(group * 1000 + attempt)
    generated = LENGTH - PROMPT
    segment = Segment(
        tokens=rng.integers(0, 256, LENGTH).tolist(),
        prompt_len=PROMPT,
        generated=[1] * generated,
        logprobs=(-rng.random(generated) * 6).tolist(),
        versions=[0] * generated,
        routed_experts=rng.integers(0, 8, (LENGTH - 1) * 2 * 2).astype("<u2").tobytes(),
        moe_layers=2,
        top_k=2,
    )
    return encode_trajectory(
        Trajectory(
            run=run,
            task_id=str(group),
            group_id=str(group),
            group_size=GROUP,
            attempt=attempt,
            reward=float(rng.random()),
            reward_breakdown={"exact": 1.0},
            segments=[segment],
            worker="bench",
            created_at=time.time(),
        )
    )


async def _feed(servers: StandaloneNats, run: str) -> None:
    nc = await servers.bed.hub.connect()
    try:
        await ensure_run_streams(nc, run, HUB_DOMAIN)
        js = nc.jetstream(domain=HUB_DOMAIN)
        for group in range(GROUPS_PER_STEP * STEPS):
            for attempt in range(GROUP):
                await js.publish(trajectory_subject(run), _trajectory(run, group, attempt))
    finally:
        await nc.close()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _step_seconds(root: Path, servers: StandaloneNats, model: Path, ranks: int) -> list[float]:
    run = f"bench-ranks-{ranks}"
    asyncio.run(_feed(servers, run))
    checkpoints = root / run / "checkpoints"
    threads = max(1, (os.cpu_count() or 1) // ranks)
    env = (
        os.environ
        | servers.bed.hub.client_env()
        | {
            "DS_ACCELERATOR": "cpu",
            "TOKENIZERS_PARALLELISM": "false",
            "OMP_NUM_THREADS": str(threads),
        }
    )
    step_tokens = GROUPS_PER_STEP * GROUP * (LENGTH - PROMPT)
    port = _free_port()
    processes = []
    for node in range(ranks):
        config = root / run / f"node-{node}.json"
        config.parent.mkdir(parents=True, exist_ok=True)
        config.write_text(
            json.dumps(
                {
                    "run": run,
                    "nats_url": servers.bed.hub.url,
                    "jetstream_domain": HUB_DOMAIN,
                    "model": str(model),
                    "checkpoint_dir": str(checkpoints),
                    "step_tokens": step_tokens,
                    "max_step_tokens": step_tokens,
                    "micro_batch_tokens": MICRO_BATCH_TOKENS,
                    "max_staleness": STEPS,
                    "max_steps": STEPS,
                    "ranks": {"node_rank": node, "nodes": ranks, "master_port": port},
                }
            )
        )
        log = (root / run / f"node-{node}.log").open("w")
        processes.append(
            subprocess.Popen(
                [sys.executable, "-m", "rlfleet.trainer", str(config)],
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        )
    codes = [p.wait(timeout=600) for p in processes]
    if codes != [0] * ranks:
        raise SystemExit(f"{ranks} ranks exited {codes}: see {root / run}")
    steps = [json.loads(line) for line in (checkpoints / "steps.jsonl").read_text().splitlines()]
    return [s["step_seconds"] for s in steps[1:]]


def step_seconds_by_ranks() -> dict[str, float]:
    """The median step's seconds per rank count (`bench/scaleout.py` reports them too)."""
    with tempfile.TemporaryDirectory() as name:
        root = Path(name)
        servers = StandaloneNats(root / "nats")
        try:
            model = init_model("tiny-moe", root / "tiny-moe")
            seconds = {ranks: _step_seconds(root, servers, model, ranks) for ranks in RANKS}
        finally:
            servers.stop()
    return {str(r): round(statistics.median(s), 4) for r, s in seconds.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smallest sizes: check the script")
    if parser.parse_args().quick:
        globals().update(QUICK)
    own_temporary_caches("rlfleet-bench-trainer-ranks-caches-")  # this invocation's, removed after
    step_s = step_seconds_by_ranks()
    print(
        json.dumps(
            {
                "ranks": list(RANKS),
                "model": "tiny-moe",
                "step_tokens": GROUPS_PER_STEP * GROUP * (LENGTH - PROMPT),
                "micro_batch_tokens": MICRO_BATCH_TOKENS,
                "threads_per_rank": {str(r): max(1, (os.cpu_count() or 1) // r) for r in RANKS},
                "step_s_by_ranks": step_s,
                "speedup": round(step_s["1"] / step_s["2"], 3),
            }
        )
    )


if __name__ == "__main__":
    main()
