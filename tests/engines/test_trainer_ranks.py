"""The trainer as one DeepSpeed job over two processes (gloo on CPU), bound the way the
operator's pods are: node_rank 0 and 1 of two nodes, one rank each, rendezvous at rank 0."""

from __future__ import annotations

import asyncio
import socket
from pathlib import Path

import pytest
import torch
from test_trainer_loop import GROUP, TrainerProcess, group, make_streams, publish, trained

from rlfleet.local.nats import HUB_DOMAIN, StandaloneNats
from rlfleet.models.tiny import init_model, read_weights
from rlfleet.weightsync import Receiver, SyncConfig, WeightStream

NAMES = "abcdef"  # six groups: three steps of two
STEPS = 3
# 3 micro-batches a step: an odd count, so one rank pads with a micro-batch of no tokens.
SETTINGS = dict(
    max_steps=STEPS, micro_batch_tokens=90, learning_rate=1e-3, weightsync={"snapshot_every": 8}
)


@pytest.fixture(scope="module")
def tiny_moe_fp32(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Published in float32, so versions show the trained weights to the last bit."""
    return init_model("tiny-moe", tmp_path_factory.mktemp("tiny-moe-fp32"), dtype=torch.float32)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Job:
    """One trainer process per node, as the StatefulSet's pods run them (each starting
    `procs_per_node` ranks), each with its own checkpoint volume, as each pod's claim is,
    or all on one folder (`shared_checkpoints`), as on a ReadWriteMany volume."""

    def __init__(
        self,
        tmp_path: Path,
        model: Path,
        servers: StandaloneNats,
        nodes: int = 2,
        procs_per_node: int = 1,
        shared_checkpoints: bool = False,
        **settings,
    ) -> None:
        port = free_port()
        self.nodes: list[TrainerProcess] = []
        for node in range(nodes):
            directory = tmp_path / f"node-{node}"
            directory.mkdir()
            shared = {"run": self.nodes[0].run} if node else {}
            if shared_checkpoints:  # the first node's, where its steps are logged
                shared["checkpoint_dir"] = str(tmp_path / "node-0" / "checkpoints")
            ranks = {
                "node_rank": node,
                "nodes": nodes,
                "procs_per_node": procs_per_node,
                "master_port": port,
            }
            self.nodes.append(
                TrainerProcess(directory, model, servers.bed.hub, ranks=ranks, **shared, **settings)
            )
        self.first = self.nodes[0]
        self.run = self.first.run

    @property
    def checkpoints(self) -> Path:
        return self.nodes[0].directory / "checkpoints"

    def start(self) -> None:
        for process in self.nodes:
            process.start()

    def exit_codes(self, timeout: float = 120) -> list[int]:
        return [p.proc.wait(timeout=timeout) for p in self.nodes if p.proc is not None]

    def kill(self) -> None:
        for process in self.nodes:
            process.kill()


async def published(servers: StandaloneNats, run: str) -> tuple[list, dict[str, torch.Tensor]]:
    """Every manifest on the run's weight stream, and the newest version's tensors as a
    receiver rebuilds them."""
    nc = await servers.bed.hub.connect()
    try:
        stream = WeightStream(nc, run, SyncConfig(), HUB_DOMAIN)
        receiver = Receiver(stream)
        await receiver.sync()
        sub = await stream.js.subscribe(
            stream.subjects.manifests, stream=stream.subjects.stream, ordered_consumer=True
        )
        manifests = []
        while True:
            try:
                msg = await sub.next_msg(timeout=2)
            except TimeoutError:
                break
            manifests.append(stream.subjects.version_of(msg.subject))
        await sub.unsubscribe()
        return manifests, dict(receiver.state.tensors)
    finally:
        await nc.close()


def train(
    tmp_path: Path,
    model: Path,
    servers: StandaloneNats,
    nodes: int,
    procs_per_node: int,
    **settings,
):
    """Trains STEPS steps on the same six groups; returns the versions of the manifests on
    the run's weight stream, its last version's weights and its first node."""
    job = Job(tmp_path, model, servers, nodes, procs_per_node, **(SETTINGS | settings))
    hub = servers.bed.hub
    asyncio.run(make_streams(hub, job.run))
    try:
        asyncio.run(publish(hub, job.run, [p for n in NAMES for p in group(job.run, n, 0)]))
        job.start()
        job.first.wait(lambda: len(job.first.steps()) == STEPS)
        assert job.exit_codes() == [0] * nodes, job.first.tail()
    finally:
        job.kill()
    versions, weights = asyncio.run(published(servers, job.run))
    return versions, weights, job.first


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory, tiny_moe_fp32: Path, nats_servers: StandaloneNats):
    return train(tmp_path_factory.mktemp("one-rank"), tiny_moe_fp32, nats_servers, 1, 1)


@pytest.mark.parametrize(
    ("zero_stage", "nodes", "procs_per_node", "shared_checkpoints"),
    [(1, 2, 1, True), (2, 2, 1, False), (3, 2, 1, False), (2, 1, 2, False)],
    ids=["zero1-2pods-one-checkpoint-folder", "zero2-2pods", "zero3-2pods", "zero2-1pod-2procs"],
)
def test_two_ranks_train_one_stream_into_one_version_stream_like_one_rank(
    tmp_path: Path,
    tiny_moe_fp32: Path,
    nats_servers: StandaloneNats,
    one_rank,
    zero_stage: int,
    nodes: int,
    procs_per_node: int,
    shared_checkpoints: bool,
) -> None:
    """Two pods may share one checkpoint folder (a ReadWriteMany volume): they train as
    well, and keep only the newest checkpoints there without tripping over each other."""
    versions, weights, first = train(
        tmp_path,
        tiny_moe_fp32,
        nats_servers,
        nodes,
        procs_per_node,
        zero_stage=zero_stage,
        shared_checkpoints=shared_checkpoints,
    )
    # One version stream: each version published once, by one publisher.
    assert versions == list(range(STEPS + 1))
    # Every trajectory trained once, in the steps a single trainer would take.
    steps = first.steps()
    assert sorted(trained(first)) == sorted(f"{n}/{a}" for n in NAMES for a in range(GROUP))
    assert [s["trajectories"] for s in steps] == [s["trajectories"] for s in one_rank[2].steps()]
    # The same weights as one rank up to float rounding: the ranks sum their gradients in
    # another order than one rank's micro-batches do, so the last bits differ (and Adam,
    # dividing by the gradient's root mean square, can carry such a difference into an
    # update of the weights where a gradient is ~0). Measured against how far three steps
    # moved the weights, the gap was 0 to 1.1e-4 of it (ZeRO-2 often bitwise equal).
    base = read_weights(tiny_moe_fp32)
    reference = one_rank[1]
    assert weights.keys() == reference.keys() == base.keys()
    moved = sum(float((reference[k] - base[k]).norm() ** 2) for k in base) ** 0.5
    gap = sum(float((weights[k] - reference[k]).norm() ** 2) for k in base) ** 0.5
    assert moved > 0
    assert gap <= 1e-3 * moved, (gap, moved)
    kept = sorted(p.name for p in (first.directory / "checkpoints").glob("step-*"))
    assert kept == ["step-00000002", "step-00000003"]  # keep_checkpoints: the newest 2


def test_losing_a_rank_stops_the_job_and_a_restart_resumes_without_repeating(
    tmp_path: Path, tiny_moe_fp32: Path, nats_servers: StandaloneNats
) -> None:
    job = Job(tmp_path, tiny_moe_fp32, nats_servers, **SETTINGS)
    hub = nats_servers.bed.hub
    asyncio.run(make_streams(hub, job.run, ack_wait_s=3))
    first, second = job.nodes
    try:
        asyncio.run(publish(hub, job.run, [p for n in NAMES for p in group(job.run, n, 0)]))
        job.start()
        first.wait(lambda: len(first.steps()) >= 1)
        second.kill()
        # Rank 0 notices at its next collective and fails, rather than wait forever.
        assert first.proc is not None and first.proc.wait(timeout=120) != 0
        killed_at = int((job.checkpoints / "latest").read_text().strip().removeprefix("step-"))
        job.start()
        first.wait(lambda: len(first.steps()) == STEPS)
        assert job.exit_codes() == [0, 0], first.tail()
    finally:
        job.kill()
    ids = trained(first)
    assert sorted(ids) == sorted(f"{n}/{a}" for n in NAMES for a in range(GROUP))
    assert [s["step"] for s in first.steps()] == list(range(1, STEPS + 1))
    assert f"resumed at step {killed_at}" in first.log.read_text()
