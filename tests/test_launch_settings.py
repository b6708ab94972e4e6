"""What the components run with, from a pod's mounted spec: one spec field, one meaning in
every component that needs it."""

from __future__ import annotations

import yaml
from conftest import ROOT

from rlfleet import launch
from rlfleet.api.rlrun import RLRunSpec
from rlfleet.rollout import config as rollout_config
from rlfleet.trainer import config as trainer_config


def _spec(**rollout: object) -> RLRunSpec:
    document = yaml.safe_load((ROOT / "examples" / "rlrun.yaml").read_text())
    document["spec"]["rollout"].update(rollout)
    return RLRunSpec.model_validate(document["spec"])


def test_rollouts_sample_and_the_trainer_scores_at_the_specs_temperature() -> None:
    at = launch.Placement("nats://hub:4222", "hub", "region-a", "rollout-0")
    hot = _spec(temperature=1.3)
    assert rollout_config.from_spec("r", hot, at).session.temperature == 1.3
    assert trainer_config.from_spec("r", hot, at).temperature == 1.3
    # Unset, both stay at 1: the model's own distribution.
    plain = _spec()
    assert rollout_config.from_spec("r", plain, at).session.temperature == 1.0
    assert trainer_config.from_spec("r", plain, at).temperature == 1.0
