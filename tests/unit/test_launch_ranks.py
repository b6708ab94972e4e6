"""A trainer pod's place in the run's one DeepSpeed job, read back from the environment the
operator gives it (`Placement.from_env`) into the trainer's settings (`TrainerConfig.ranks`).
Pure: the operator's side is in test_operator_workloads, the bed's in test_operator_fleet."""

from __future__ import annotations

import pytest
import yaml
from conftest import ROOT

from rlfleet.api.rlrun import RLRunSpec
from rlfleet.launch import components, pods
from rlfleet.launch.settings import Ranks

NATS = {pods.NATS_URL_ENV: "nats://hub:4222"}
JOB = NATS | {
    pods.TRAINER_NODES_ENV: "2",
    pods.TRAINER_PROCS_PER_NODE_ENV: "8",
    pods.TRAINER_MASTER_ADDR_ENV: "r-trainer-0.r-trainer.team-a.svc",
    pods.TRAINER_MASTER_PORT_ENV: "29500",
}


def _spec() -> RLRunSpec:
    document = yaml.safe_load((ROOT / "examples" / "rlrun.yaml").read_text())
    return RLRunSpec.model_validate(document["spec"])


def test_each_pod_of_a_two_pod_job_reads_its_own_ranks_into_the_trainers_settings() -> None:
    ranks = [
        components.TRAINER.for_pod(
            "r", _spec(), pods.Placement.from_env(JOB | {pods.TRAINER_NODE_RANK_ENV: str(i)})
        ).ranks
        for i in (0, 1)
    ]
    assert ranks == [
        Ranks(node_rank=i, nodes=2, procs_per_node=8, master_addr=JOB[pods.TRAINER_MASTER_ADDR_ENV])
        for i in (0, 1)
    ]
    # One job of 16 ranks: pod 1's first process is rank 8, not a second rank 0.
    assert [r.world for r in ranks] == [16, 16] and ranks[1].rank(0) == 8


def test_without_a_job_the_trainer_is_a_job_of_one() -> None:
    assert pods.Placement.from_env(NATS).ranks == Ranks()


@pytest.mark.parametrize(
    ("changes", "error"),
    [
        ({}, "RLFLEET_TRAINER_NODE_RANK is not set"),
        ({pods.TRAINER_NODE_RANK_ENV: ""}, "RLFLEET_TRAINER_NODE_RANK is not set"),
        ({pods.TRAINER_NODE_RANK_ENV: "2"}, "RLFLEET_TRAINER_NODE_RANK=2: expected below"),
        ({pods.TRAINER_NODE_RANK_ENV: "-1"}, "RLFLEET_TRAINER_NODE_RANK='-1'"),
        (
            {pods.TRAINER_NODE_RANK_ENV: "0", pods.TRAINER_NODES_ENV: "0"},
            "RLFLEET_TRAINER_NODES='0'",
        ),
        (
            {pods.TRAINER_NODE_RANK_ENV: "0", pods.TRAINER_NODES_ENV: "two"},
            "RLFLEET_TRAINER_NODES='two'",
        ),
        (
            {pods.TRAINER_NODE_RANK_ENV: "0", pods.TRAINER_PROCS_PER_NODE_ENV: "0"},
            "RLFLEET_TRAINER_PROCS_PER_NODE='0'",
        ),
        (
            {pods.TRAINER_NODE_RANK_ENV: "0", pods.TRAINER_MASTER_PORT_ENV: "70000"},
            "RLFLEET_TRAINER_MASTER_PORT='70000'",
        ),
    ],
)
def test_a_bad_rank_environment_is_refused_naming_the_variable(
    changes: dict[str, str], error: str
) -> None:
    with pytest.raises(ValueError, match=error):
        pods.Placement.from_env(JOB | changes)


def test_a_pod_with_fewer_gpus_than_ranks_is_refused_naming_the_field() -> None:
    from rlfleet.trainer.ranks import too_few_gpus

    why = too_few_gpus(procs=8, gpus=4)
    assert why is not None and "spec.trainer.gpusPerReplica" in why and "sees 4 GPUs" in why
    assert too_few_gpus(procs=8, gpus=8) is None
    assert too_few_gpus(procs=2, gpus=0) is None  # CPU ranks over gloo
