"""A user's DeepSpeed settings (`spec.trainer.deepSpeedConfigMap`): the operator mounts the
ConfigMap's ds_config.json into trainer pods, a pod reads it into its settings, and the
trainer merges it under its own keys, refusing the keys it sets itself."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import msgspec
import pytest
import yaml
from conftest import ROOT

from rlfleet.api.meta import COMPONENT_LABEL
from rlfleet.api.rlrun import RLRunSpec
from rlfleet.launch import components
from rlfleet.launch.from_spec import trainer_settings
from rlfleet.launch.pods import DEEPSPEED_CONFIG_FILE, DEEPSPEED_DIR, DEEPSPEED_KEY, Placement
from rlfleet.launch.settings import TrainerConfig, to_json
from rlfleet.local.processes import run_in_session
from rlfleet.operator.config import Images, Workloads
from rlfleet.operator.workloads.hub import hub_objects
from rlfleet.trainer.deepspeed_config import deepspeed_config, merged, own_settings

TUNING = {"zero_optimization": {"reduce_bucket_size": 1234567, "overlap_comm": True}}


def settings(**deepspeed: object) -> TrainerConfig:
    return TrainerConfig(
        run="team-a_run",
        nats_url="nats://hub:4222",
        model=Path("/models/tiny"),
        checkpoint_dir=Path("/state/checkpoints"),
        deepspeed=deepspeed,
    )


def run_document(**trainer: object) -> dict:
    run = yaml.safe_load((ROOT / "examples" / "rlrun.yaml").read_text())
    run["metadata"] |= {"namespace": "team-a", "uid": "hub-uid"}
    run["spec"]["trainer"] = trainer
    return run


def test_without_a_user_file_the_engine_gets_the_trainers_own_settings() -> None:
    assert deepspeed_config(settings()) == {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "managed_gradient_accumulation": False,
        "gradient_clipping": 1.0,
        "zero_optimization": {"stage": 2},
        "zero_allow_untested_optimizer": True,
        "checkpoint": {"use_node_local_storage": True},
        "steps_per_print": 1 << 30,
        "bf16": {"enabled": False},
    }


def test_the_runs_precision_and_checkpoint_folder_set_the_engines() -> None:
    """bf16 in the RLRun is DeepSpeed's bf16 (float32 master weights and Adam state); on a
    folder every node shares, rank 0 alone writes the model states."""
    bf16 = msgspec.structs.replace(settings(), precision="bf16")
    engine = deepspeed_config(bf16, shared_checkpoints=True)
    assert engine["bf16"] == {"enabled": True}
    assert engine["checkpoint"] == {"use_node_local_storage": False}


def test_the_users_keys_merge_under_the_trainers_nested_ones_too() -> None:
    config = msgspec.structs.replace(settings(**TUNING, wall_clock_breakdown=True), zero_stage=3)
    engine = deepspeed_config(config)
    assert engine["zero_optimization"] == {
        "stage": 3,
        "reduce_bucket_size": 1234567,
        "overlap_comm": True,
    }
    assert engine["wall_clock_breakdown"] is True
    assert engine["gradient_clipping"] == config.grad_clip


def test_a_user_may_change_what_the_trainer_only_defaults() -> None:
    assert deepspeed_config(settings(steps_per_print=10))["steps_per_print"] == 10


@pytest.mark.parametrize(
    "user, key",
    [
        ({"train_batch_size": 64}, "train_batch_size"),
        ({"train_micro_batch_size_per_gpu": 4}, "train_micro_batch_size_per_gpu"),
        ({"gradient_accumulation_steps": 8}, "gradient_accumulation_steps"),
        ({"gradient_clipping": 0.5}, "gradient_clipping"),
        ({"zero_optimization": {"stage": 3, "overlap_comm": True}}, "zero_optimization.stage"),
        ({"zero_optimization": 3}, "zero_optimization"),
        ({"optimizer": {"type": "Adam", "params": {"lr": 1e-4}}}, "optimizer"),
        ({"scheduler": {"type": "WarmupLR"}}, "scheduler"),
        ({"bf16": {"enabled": True}}, "bf16"),
        ({"fp16": {"enabled": False}}, "fp16"),
        (
            {"zero_optimization": {"offload_optimizer": {"device": "cpu"}}},
            "zero_optimization.offload_optimizer",
        ),
    ],
)
def test_a_key_the_trainer_sets_is_refused_by_name(user: dict, key: str) -> None:
    with pytest.raises(ValueError, match="sets keys the trainer sets itself") as refused:
        deepspeed_config(settings(**user))
    assert str(refused.value).split(": ", 1)[1].split(";")[0] == key


def test_every_refused_key_is_named_at_once_with_where_the_run_sets_it() -> None:
    user = {"bf16": {"enabled": True}, "zero_optimization": {"stage": 3}, "optimizer": {}}
    with pytest.raises(ValueError) as refused:
        merged(user, own_settings(settings()))
    message = str(refused.value)
    assert "bf16, zero_optimization.stage, optimizer;" in message
    assert "zero_optimization.stage is spec.trainer.zeroStage" in message
    assert "bf16 is spec.trainer.precision" in message


def test_merging_leaves_the_users_settings_as_they_were() -> None:
    user = json.loads(json.dumps(TUNING))
    merged(user, own_settings(settings()))
    assert user == TUNING


def test_a_trainer_pod_reads_the_mounted_file_only_when_the_spec_names_a_config_map(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    mounted = tmp_path / DEEPSPEED_KEY
    mounted.write_text(json.dumps(TUNING))
    monkeypatch.setattr(components, "DEEPSPEED_CONFIG_FILE", str(mounted))
    at = Placement("nats://hub:4222", "hub")
    named = RLRunSpec.model_validate(run_document(deepSpeedConfigMap="ds-tuning")["spec"])
    config = components.TRAINER.for_pod("team-a_run", named, at)
    assert config.deepspeed == TUNING
    assert deepspeed_config(config)["zero_optimization"]["reduce_bucket_size"] == 1234567
    unnamed = RLRunSpec.model_validate(run_document()["spec"])
    assert components.TRAINER.for_pod("team-a_run", unnamed, at).deepspeed == {}


def test_a_mounted_file_that_is_no_json_object_names_the_field(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    mounted = tmp_path / DEEPSPEED_KEY
    mounted.write_text("[1, 2]")
    monkeypatch.setattr(components, "DEEPSPEED_CONFIG_FILE", str(mounted))
    spec = RLRunSpec.model_validate(run_document(deepSpeedConfigMap="ds-tuning")["spec"])
    with pytest.raises(ValueError, match=r"deepSpeedConfigMap ds-tuning: ds_config\.json"):
        components.TRAINER.for_pod("team-a_run", spec, Placement("nats://hub:4222"))


def test_settings_for_a_spec_naming_a_config_map_need_its_json() -> None:
    spec = RLRunSpec.model_validate(run_document(deepSpeedConfigMap="ds-tuning")["spec"])
    at = Placement("nats://hub:4222")
    with pytest.raises(ValueError, match="only a trainer pod mounts the ConfigMap"):
        trainer_settings("run", spec, "/models/tiny", "/state", at)


def test_a_local_run_refuses_a_config_map_it_cannot_read(tmp_path: Path) -> None:
    from rlfleet.local.run import InvalidRun, load

    path = tmp_path / "rlrun.yaml"
    path.write_text(yaml.safe_dump(run_document(deepSpeedConfigMap="ds-tuning")))
    with pytest.raises(InvalidRun, match=r"spec\.trainer\.deepSpeedConfigMap"):
        load(path)


def test_the_operator_mounts_the_config_map_where_trainer_pods_read_it() -> None:
    def pods(run: dict) -> dict[str, dict]:
        made = hub_objects(run, Images(), Workloads(), None)
        return {
            o["metadata"]["labels"][COMPONENT_LABEL]: o["spec"]["template"]["spec"]
            for o in made
            if o["kind"] in ("StatefulSet", "Deployment")
        }

    named = pods(run_document(deepSpeedConfigMap="ds-tuning"))
    trainer = named["trainer"]
    (volume,) = [v for v in trainer["volumes"] if v.get("configMap", {}).get("name") == "ds-tuning"]
    (item,) = volume["configMap"]["items"]
    (mount,) = [m for m in trainer["containers"][0]["volumeMounts"] if m["name"] == volume["name"]]
    assert item["key"] == DEEPSPEED_KEY
    assert f"{mount['mountPath']}/{item['path']}" == DEEPSPEED_CONFIG_FILE
    assert mount["readOnly"]
    assert all(
        "ds-tuning" not in json.dumps(pod) for name, pod in named.items() if name != "trainer"
    )
    unnamed = pods(run_document())["trainer"]
    assert DEEPSPEED_DIR not in json.dumps(unnamed)


def test_the_trainer_refuses_owned_keys_before_loading_anything(tmp_path: Path) -> None:
    path = tmp_path / "trainer.json"
    path.write_bytes(to_json(settings(bf16={"enabled": True}, gradient_clipping=0.1)))
    result = subprocess.run(
        [sys.executable, "-m", "rlfleet.trainer", str(path)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 1
    assert "python -m rlfleet.trainer: deepSpeedConfigMap's ds_config.json" in result.stderr
    assert "bf16, gradient_clipping" in result.stderr
    assert "Traceback" not in result.stderr


def test_the_users_settings_reach_the_trainers_engine(tmp_path: Path) -> None:
    """One real DeepSpeed engine per settings file (CPU accelerator): the user's bucket
    size is the engine's, and the trainer's own keys stay the trainer's."""
    from rlfleet.models.tiny import init_model  # torch: only where an engine runs

    model = init_model("tiny-moe", tmp_path / "model")

    def engine(name: str, **deepspeed: object) -> dict:
        config = msgspec.structs.replace(
            settings(**deepspeed), model=model, checkpoint_dir=tmp_path / name
        )
        (tmp_path / f"{name}.json").write_bytes(to_json(config))
        report = tmp_path / f"{name}.report.json"
        result = run_in_session(
            [
                sys.executable,
                str(ROOT / "tests" / "probes" / "policy_deepspeed.py"),
                str(tmp_path / f"{name}.json"),
                str(report),
            ],
            env={**os.environ, "DS_ACCELERATOR": "cpu", "TOKENIZERS_PARALLELISM": "false"},
            timeout=600,
        )
        assert result.returncode == 0, result.stderr[-4000:]
        return json.loads(report.read_text())

    bucket = 1_234_567
    tuned = engine("tuned", zero_optimization={"reduce_bucket_size": bucket})
    default = engine("default")
    assert tuned["reduce_bucket_size"] == bucket != default["reduce_bucket_size"]
    assert tuned["zero_stage"] == default["zero_stage"] == settings().zero_stage
    assert tuned["gradient_clipping"] == settings().grad_clip
