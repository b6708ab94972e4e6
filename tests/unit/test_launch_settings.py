"""What the components run with, from a pod's mounted spec or a local run's JSON file: one
spec field, one meaning in every component that needs it."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import msgspec
import pytest
import yaml
from conftest import ROOT

from rlfleet.api.rlrun import RLRunSpec
from rlfleet.api.wire import WEIGHT_CHUNK_BYTES
from rlfleet.launch import components, from_spec, pods
from rlfleet.launch.settings import PoolConfig, SyncConfig, from_json, to_json
from rlfleet.local import plan

AT = pods.Placement("nats://hub:4222", "hub", "region-a", "rollout-0")
PRODUCTION = {"pool": {"region": "region-a", "name": "chat"}}


def _spec(name: str = "rlrun.yaml", **rollout: object) -> RLRunSpec:
    document = yaml.safe_load((ROOT / "examples" / name).read_text())
    document["spec"]["rollout"].update(rollout)
    return RLRunSpec.model_validate(document["spec"])


def test_rollouts_sample_and_the_trainer_scores_at_the_specs_temperature() -> None:
    hot = _spec(temperature=1.3)
    assert components.ROLLOUT.for_pod("r", hot, AT).session.temperature == 1.3
    assert components.TRAINER.for_pod("r", hot, AT).temperature == 1.3
    # Unset, both stay at 1: the model's own distribution.
    plain = _spec()
    assert components.ROLLOUT.for_pod("r", plain, AT).session.temperature == 1.0
    assert components.TRAINER.for_pod("r", plain, AT).temperature == 1.0


def test_the_specs_mlflow_server_reaches_the_trainer_with_the_spec_as_its_parameters() -> None:
    document = yaml.safe_load((ROOT / "examples" / "rlrun.yaml").read_text())
    document["spec"]["tracking"] = {"mlflow": {"trackingUri": "http://mlflow.tools:5000"}}
    tracking = components.TRAINER.for_pod(
        "team-a_tiny", RLRunSpec.model_validate(document["spec"]), AT
    ).tracking
    assert tracking is not None
    assert (tracking.uri, tracking.experiment, tracking.run_name) == (
        "http://mlflow.tools:5000",
        "team-a",  # the run's namespace, by default
        "team-a_tiny",
    )
    assert tracking.params["trainer.learningRate"] == "1e-05"  # the schema's default too
    assert tracking.params["model.uri"] == document["spec"]["model"]["uri"]
    assert components.TRAINER.for_pod("r", _spec(), AT).tracking is None


def test_the_specs_weight_sync_reaches_every_component_that_moves_weights() -> None:
    spec = _spec().model_copy(
        update={"weight_sync": _spec().weight_sync.model_copy(update={"shard_size_mib": 4})}
    )
    for component in (components.TRAINER, components.ROLLOUT):
        sync = component.for_pod("r", spec, AT).weightsync
        assert (sync.snapshot_every, sync.shard_bytes) == (20, 4 << 20)


def test_a_production_runs_cycle_deadline_and_canary_reach_its_conductor() -> None:
    production = PRODUCTION | {
        "cycle": {"phaseDeadlineSeconds": 900},
        "canary": {"windowSeconds": 120, "minSamples": 8},
    }
    document = yaml.safe_load((ROOT / "examples" / "rlrun.yaml").read_text())["spec"]
    production_run = {"rollout": None, "production": production}
    gated = {"evaluation": {"suite": "rules"}}
    spec = RLRunSpec.model_validate(document | gated | production_run)
    conductor = components.CONDUCTOR.for_pod("r", spec, AT)
    assert conductor.phase_deadline_s == 900
    assert (conductor.canary.window_s, conductor.canary.min_samples) == (120, 8)


def _local(tmp_path: Path) -> dict[str, plan.Process]:
    spec = _spec("local.yaml")
    leaves = {r.name: SimpleNamespace(url=f"nats://{r.name}:4222") for r in spec.rollout.regions}
    nats = SimpleNamespace(hub=SimpleNamespace(url="nats://hub:4222"), leaves=leaves)
    layout = plan.Layout(tmp_path)
    processes = plan.processes("local", spec, layout, nats, plan.Tuning())  # type: ignore[arg-type]
    return {p.name: p for p in processes}


def test_a_local_run_writes_each_process_settings_its_program_reads_back(tmp_path) -> None:
    processes = _local(tmp_path)
    assert set(processes) == {"trainer", "rollout-region-a", "rollout-region-b", "feed"}
    for name, process in processes.items():
        component = components.COMPONENTS[name.partition("-")[0]]
        assert process.argv[-4:-1] == component.command(process.argv[-4])
        path = Path(process.argv[-1])
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(to_json(process.config))
        assert component.read(path) == process.config
    # The example's recipe, as a pod would have it, and the machine's sizes on top.
    trainer, worker = processes["trainer"].config, processes["rollout-region-a"].config
    assert (trainer.step_groups, trainer.learning_rate, trainer.zero_stage) == (8, 5e-4, 1)
    assert (trainer.learning_rate_warmup_steps, trainer.learning_rate_decay_steps) == (50, 1350)
    assert (worker.group_size, worker.session.turn_tokens) == (16, 24)
    assert processes["feed"].config.groups_per_step == trainer.step_groups
    assert worker.max_sessions == plan.Tuning().max_sessions


def test_a_local_run_serves_each_process_metrics_on_a_port_of_its_own(tmp_path) -> None:
    processes = _local(tmp_path)
    urls = {name: process.metrics_url for name, process in processes.items()}
    assert all(url and url.startswith("http://127.0.0.1:") for url in urls.values()), urls
    assert len(set(urls.values())) == len(urls)


def test_a_pod_serves_metrics_where_its_environment_says_or_nowhere() -> None:
    env = {pods.NATS_URL_ENV: "nats://hub:4222", pods.METRICS_PORT_ENV: "9400"}
    at = pods.Placement.from_env(env)
    document = yaml.safe_load((ROOT / "examples" / "rlrun.yaml").read_text())
    gated = document["spec"] | {"evaluation": {"suite": "rules"}}
    rollouts = RLRunSpec.model_validate(gated)
    production = RLRunSpec.model_validate(gated | {"rollout": None, "production": PRODUCTION})
    runs = [(spec, c) for spec in (rollouts, production) for c in components.components_of(spec)]
    assert {component.name for _, component in runs} == set(components.COMPONENTS)
    for spec, component in runs:
        assert component.for_pod("r", spec, at).metrics_port == 9400
    assert pods.Placement.from_env({pods.NATS_URL_ENV: "nats://hub:4222"}).metrics_port is None
    with pytest.raises(ValueError, match="RLFLEET_METRICS_PORT='http'"):
        pods.Placement.from_env(env | {pods.METRICS_PORT_ENV: "http"})


def test_a_rollout_pod_claims_sandboxes_from_its_envpool_with_its_mounted_token() -> None:
    spec = _spec()  # names its EnvPool
    url = "http://arith-sandbox-sandbox.team-a.svc:8080"
    env = {pods.NATS_URL_ENV: "nats://hub:4222", pods.ENVPOOL_URL_ENV: url}
    worker = from_spec.rollout_settings("run", spec, "/models/m", pods.Placement.from_env(env))
    assert worker.envpool == PoolConfig(url=url, token_file=pods.ENVPOOL_TOKEN_FILE)
    # No pool told: a server of the worker's own (as `rlfleet run` has).
    alone = pods.Placement.from_env({pods.NATS_URL_ENV: "nats://hub:4222"})
    assert from_spec.rollout_settings("run", spec, "/models/m", alone).envpool is None


def test_a_misspelt_setting_is_refused_when_read(tmp_path) -> None:
    written = msgspec.json.decode(to_json(_local(tmp_path)["feed"].config))
    with pytest.raises(msgspec.ValidationError, match="max_stalenes"):
        from_json(msgspec.json.encode(written | {"max_stalenes": 3}), components.FEED.settings)


def test_a_weight_chunk_larger_than_the_weights_stream_takes_is_refused() -> None:
    """The weights stream is declared once (`rlfleet.bus.streams`), sized for chunks of at
    most `WEIGHT_CHUNK_BYTES`: a larger chunk would be refused mid-publish, so the settings
    refuse it up front."""
    assert SyncConfig().chunk_bytes == WEIGHT_CHUNK_BYTES
    with pytest.raises(ValueError, match="chunk_bytes"):
        SyncConfig(chunk_bytes=WEIGHT_CHUNK_BYTES + 1)
