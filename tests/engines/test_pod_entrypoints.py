"""The pods the operators make, run the way their images run them: each container's
command (or its image's ENTRYPOINT, read from `images/`) and args, over the spec the
operator mounts and the environment it sets, and nothing else. Real NATS (the hub and
region-a's leaf node), real DeepSpeed and real vLLM: the trainer, the task feed and a
rollout worker placed in region-a train together, and the run's evaluator scores them."""

from __future__ import annotations

import asyncio
import base64
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import nats
import nats.js.errors
import pytest
import yaml
from conftest import ROOT, scrape, wait_for
from nats.js.api import StreamInfo

from rlfleet.api.inferencepool import InferencePoolSpec, ServedVersion
from rlfleet.api.meta import COMPONENT_LABEL
from rlfleet.api.wire import (
    BusRole,
    CycleState,
    EvaluationReport,
    StepReport,
    Trajectory,
    cycle_state_subject,
    decode_cycle_state,
    decode_evaluation_report,
    decode_step_report,
    decode_trajectory,
    evaluation_subject,
    step_subject,
    trajectory_stream,
)
from rlfleet.bus.connection import CREDENTIALS_ENV
from rlfleet.bus.reading import newest
from rlfleet.bus.streams import cycle_stream, evaluation_stream, step_stream
from rlfleet.launch.caches import CACHE_ROOT_ENV
from rlfleet.launch.pods import (
    METRICS_PORT_ENV,
    SPEC_FILE,
    STATE_DIR_ENV,
    nats_credentials_secret,
    run_key,
)
from rlfleet.launch.production import FEEDBACK_DIR_ENV
from rlfleet.local.files import write_secret
from rlfleet.local.nats import HUB_DOMAIN, NatsBed, NatsServer, start_nats
from rlfleet.local.plan import cpu_flags, serving_dtype
from rlfleet.local.processes import Supervisor, free_port
from rlfleet.local.run import make_streams
from rlfleet.models.tiny import init_model
from rlfleet.operator.config import Images, NatsAccess, Workloads
from rlfleet.operator.served import read_served
from rlfleet.operator.workloads.common import spec_config_map
from rlfleet.operator.workloads.hub import POD_INDEX_LABEL, hub_objects, mirror
from rlfleet.operator.workloads.inferencepool import pool_feedback
from rlfleet.operator.workloads.rollout import rollout_deployment
from rlfleet.rollout.environment.tasks import rules_suite, write_suite
from rlfleet.weightsync import SyncConfig, WeightStream

REGION = "region-a"
POOL = "chat-prod"
# What this machine needs and a GPU image would not: a small KV cache and one thread each.
CPU_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "OMP_NUM_THREADS": "1"}
EVALUATION_TASKS = 4


def entrypoint(image: str) -> list[str]:
    """The ENTRYPOINT of the image's Dockerfile (`ghcr.io/rlfleet/NAME:TAG`)."""
    name = image.rsplit("/", 1)[-1].split(":")[0]
    for line in (ROOT / "images" / f"{name}.Dockerfile").read_text().splitlines():
        if line.startswith("ENTRYPOINT "):
            return json.loads(line.removeprefix("ENTRYPOINT "))
    raise AssertionError(f"images/{name}.Dockerfile has no ENTRYPOINT")


def as_process(
    pod_spec: dict, pod: str, mounted: Path, state: Path, user: Path
) -> tuple[list, dict]:
    """The argv and environment of a pod's one container: the spec file at `mounted`
    stands for the ConfigMap volume, `state` for the trainer's state volume and `user`
    for the run's NATS user Secret. The pods' one metrics port becomes a free port each,
    as the four share this host's network."""
    (container,) = pod_spec["containers"]
    argv = [sys.executable if a == "python" else a for a in container.get("command") or []]
    argv = argv or [sys.executable, *entrypoint(container["image"])[1:]]
    argv += [str(mounted) if a == SPEC_FILE else a for a in container["args"]]
    env = {e["name"]: e.get("value") for e in container["env"] if "value" in e}
    env[CREDENTIALS_ENV] = str(user)  # where the pod reads its mounted Secret
    for e in container["env"]:
        path = e.get("valueFrom", {}).get("fieldRef", {}).get("fieldPath")
        if path == "metadata.name":
            env[e["name"]] = pod
        elif path == f"metadata.labels['{POD_INDEX_LABEL}']":
            env[e["name"]] = pod.rsplit("-", 1)[1]  # the StatefulSet labels its ordinal
    (metrics,) = [p["containerPort"] for p in container["ports"] if p["name"] == "metrics"]
    assert env[METRICS_PORT_ENV] == str(metrics)
    return argv, env | {STATE_DIR_ENV: str(state), METRICS_PORT_ENV: str(free_port())} | CPU_ENV


def the_run(model: Path, bed: NatsBed, evaluation_suite: Path) -> dict:
    run = yaml.safe_load((ROOT / "examples" / "rlrun.yaml").read_text())
    run["metadata"] |= {"namespace": "team-a", "uid": "hub-uid"}
    spec = run["spec"]
    spec["model"] |= {"uri": f"file://{model}", "volumeClaimName": "models"}
    spec["rollout"]["taskSuite"] = "rules"  # bare questions: no sandbox per attempt
    # Nor an EnvPool: its pods and tokens are tested on the bed (test_operator_fleet.py).
    del spec["rollout"]["envPool"]
    # This host has no GPU: a trainer pod of one process, not one rank per GPU it lacks.
    spec.setdefault("trainer", {})["gpusPerReplica"] = 0
    # A few tasks, scored once: the first version the evaluator sees.
    spec["evaluation"] = {"suite": str(evaluation_suite), "everyVersions": 1000}
    spec["weightSync"]["endpoints"] = [{"region": REGION, "url": bed.leaves[REGION].url}]
    return run


@pytest.fixture
def pods(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[dict, NatsBed, Path, dict[str, dict], dict[str, str]]]:
    """The operators' objects for the example run, started as processes; and where each
    serves its metrics. Stopped after the test that uses them: left training through the
    module, they starved the tests after it of both cores (a vLLM server there took over
    300 s to start in the suite, 81 s alone)."""
    work = tmp_path_factory.mktemp("pods")
    supervisor = Supervisor(work / "logs", attached=True)
    try:
        bed = start_nats([REGION], supervisor, work / "nats")
        suite = work / "evaluation.jsonl"
        write_suite(rules_suite(EVALUATION_TASKS, seed=7), suite)
        run = the_run(init_model("tiny-moe", work / "model"), bed, suite)
        access = NatsAccess(url=bed.hub.url, domain=HUB_DOMAIN, credentials_secret="nats")
        # What the hub mints into the run's Secrets: each component's pods connect as a
        # user of their own, allowed only what that component does.
        meta = run["metadata"]
        for role in BusRole:
            key = run_key(meta["namespace"], meta["name"])
            write_secret(work / f"{role}.creds", bed.run_user(key, role))
        # The run's streams and region-a's weights mirror, as the hub operator makes them.
        asyncio.run(make_streams(bed, run_key(meta["namespace"], meta["name"])))
        made = hub_objects(run, Images(), Workloads(), access)
        objects = {o["kind"]: o for o in made if o["kind"] != "Deployment"}
        deployments = {
            o["metadata"]["labels"][COMPONENT_LABEL]: o for o in made if o["kind"] == "Deployment"
        }
        mounted = work / "spec" / "rlrun.json"
        mounted.parent.mkdir()
        mounted.write_text(objects["ConfigMap"]["data"]["rlrun.json"])
        # The region acts on its mirror of the run, which the hub annotates.
        copy = mirror(run, "hub", access)
        copy["metadata"]["uid"] = "mirror-uid"
        pool = yaml.safe_load((ROOT / "examples" / "inferencepool.yaml").read_text())
        rollout = rollout_deployment(
            copy,
            POOL,
            InferencePoolSpec.model_validate(pool["spec"]),
            1,
            Images().rollout,
            Workloads(),
            REGION,
        )
        started = {
            "trainer": (objects["StatefulSet"], "tiny-moe-arith-trainer-0"),
            "feed": (deployments["feed"], "tiny-moe-arith-feed-7d9f-x2x4q"),
            "evaluator": (deployments["evaluator"], "tiny-moe-arith-evaluator-5f6d-k8w2p"),
            "rollout": (rollout, "tiny-moe-arith-rollout-chat-prod-5b8c-qz7lm"),
        }
        metrics = {}
        for name, (workload, pod) in started.items():
            pod_spec = workload["spec"]["template"]["spec"]
            user = work / f"{name}.creds"
            argv, env = as_process(pod_spec, pod, mounted, work / "state", user)
            supervisor.start(name, argv, env)
            metrics[name] = f"http://127.0.0.1:{env[METRICS_PORT_ENV]}/metrics"
        workloads = {name: workload for name, (workload, _) in started.items()}
        yield run, bed, work, workloads, metrics
    finally:
        supervisor.stop_all()


async def first_step_and_trajectory(server: NatsServer, run: str) -> tuple[StepReport, Trajectory]:
    """The trainer's newest step report once there is one, and the first trajectory."""
    nc = await server.connect()
    try:
        js = nc.jetstream()
        for _ in range(450):
            try:
                report = await js.get_last_msg(step_stream(run), step_subject(run))
                break
            except nats.js.errors.NotFoundError:
                await asyncio.sleep(2)
        else:
            raise AssertionError("no step report within 900 s")
        first = await js.get_msg(trajectory_stream(run), 1)
        return decode_step_report(report.data), decode_trajectory(first.data)
    finally:
        await nc.close()


async def last_evaluation(server: NatsServer, run: str) -> EvaluationReport:
    nc = await server.connect()
    try:
        js = nc.jetstream()
        for _ in range(150):
            try:
                found = await js.get_last_msg(evaluation_stream(run), evaluation_subject(run))
                return decode_evaluation_report(found.data)
            except nats.js.errors.NotFoundError:
                await asyncio.sleep(2)
        raise AssertionError("no evaluation within 300 s")
    finally:
        await nc.close()


async def weight_mirror(server: NatsServer, run: str, domain: str) -> StreamInfo:
    nc = await server.connect()
    try:
        weights = WeightStream(nc, run, SyncConfig(), domain)
        return await weights.js.stream_info(weights.subjects.stream)
    finally:
        await nc.close()


def test_the_operators_pods_train_from_the_mounted_spec_alone(pods) -> None:
    run, bed, work, workloads, metrics = pods
    name = run["metadata"]["name"]
    key = run_key(run["metadata"]["namespace"], name)  # the run's name on NATS
    # The model's claim is mounted read-only where its file:// uri points (here the
    # model already is at that path, as the volume would put it).
    for component in ("trainer", "rollout"):
        pod_spec = workloads[component]["spec"]["template"]["spec"]
        mounts = {m["name"]: m for m in pod_spec["containers"][0]["volumeMounts"]}
        assert mounts["model"] == {
            "name": "model",
            "mountPath": run["spec"]["model"]["uri"].removeprefix("file://"),
            "readOnly": True,
        }
        claims = [v for v in pod_spec["volumes"] if "persistentVolumeClaim" in v]
        assert claims == [{"name": "model", "persistentVolumeClaim": {"claimName": "models"}}]
    # Every pod mounts its component's NATS user from its Secret and is told where it is.
    for component, workload in workloads.items():
        pod_spec = workload["spec"]["template"]["spec"]
        secrets = [v["secret"]["secretName"] for v in pod_spec["volumes"] if "secret" in v]
        assert secrets == [f"{name}-nats-{component}"]
        env = {e["name"]: e.get("value") for e in pod_spec["containers"][0]["env"]}
        assert env[CREDENTIALS_ENV] == "/var/run/secrets/rlfleet/nats/creds"
    step, trajectory = asyncio.run(first_step_and_trajectory(bed.hub, key))
    assert step.run == key and step.policy_version >= 1
    # The worker names itself by its region and pod; the spec's group size holds.
    assert trajectory.worker == f"{REGION}/tiny-moe-arith-rollout-chat-prod-5b8c-qz7lm"
    assert trajectory.group_size == 8
    # Each serves its metrics where its pod's environment says, weightsync's among them (a
    # counter moves just after the message it counts is out).
    trainer = metrics["trainer"]
    wait_for("a step counted", lambda: scrape(trainer)["rlfleet_trainer_steps_total"] >= 1, 30)
    assert scrape(trainer)['rlfleet_weightsync_published_bytes_total{kind="full"}'] > 0
    worker = metrics["rollout"]
    trajectories = "rlfleet_rollout_trajectories_total"
    wait_for("a trajectory counted", lambda: scrape(worker)[trajectories] >= 1, 30)
    assert "rlfleet_weightsync_fetched_bytes_total" in scrape(worker)
    for component in ("feed", "evaluator"):
        assert "process_cpu_seconds_total" in scrape(metrics[component])

    # The worker reads weights from its region's own mirror of the hub's stream, so a
    # version crosses the WAN once.
    def mirrored() -> bool:
        info = asyncio.run(weight_mirror(bed.leaves[REGION], key, REGION))
        return info.mirror is not None and info.state.messages > 0

    wait_for("region-a's mirror of the weights", mirrored, timeout=120)
    # The trainer keeps its checkpoints and step log in the state volume.
    wait_for("the step log", lambda: (work / "state" / "checkpoints" / "steps.jsonl").exists())
    # The evaluator scored a version the trainer published on the suite the spec names.
    evaluation = asyncio.run(last_evaluation(bed.hub, key))
    assert evaluation.suite == run["spec"]["evaluation"]["suite"]
    assert (evaluation.tasks, evaluation.attempts) == (EVALUATION_TASKS, 8)
    logs = {p.stem: p.read_text() for p in (work / "logs").glob("*.log")}
    assert "Traceback" not in logs["trainer"] + logs["feed"] + logs["evaluator"], logs


def served(url: str) -> dict[str, float] | None:
    """A process's metrics, once it serves them."""
    try:
        return scrape(url)
    except OSError:
        return None


def production_run(bed: NatsBed) -> tuple[dict, str, NatsAccess]:
    """The real-time example as the hub holds it, its key on NATS with its streams made,
    and the hub's NATS as the operators reach it."""
    run = yaml.safe_load((ROOT / "examples" / "realtime.yaml").read_text())
    run["metadata"] |= {"namespace": "team-a", "uid": "hub-uid"}
    key = run_key("team-a", run["metadata"]["name"])
    asyncio.run(make_streams(bed, key))
    return run, key, NatsAccess(url=bed.hub.url, domain=HUB_DOMAIN, credentials_secret="nats")


def test_a_production_runs_collector_and_conductor_start_from_the_mounted_spec(
    tmp_path: Path,
) -> None:
    """The hub's pods of a production run, as their images run them: the conductor (in
    the operator's image) reads the mounted spec, connects as its own user and opens
    the first cycle; the collector waits for it, serving its metrics."""
    supervisor = Supervisor(tmp_path / "logs", attached=True)
    try:
        bed = start_nats([REGION], supervisor, tmp_path / "nats")
        run, key, access = production_run(bed)
        made = hub_objects(run, Images(), Workloads(), access)
        mounted = tmp_path / "rlrun.json"
        mounted.write_text(next(o for o in made if o["kind"] == "ConfigMap")["data"]["rlrun.json"])
        metrics = {}
        for workload in made:
            component = workload["metadata"]["labels"].get(COMPONENT_LABEL)
            if component not in ("collector", "conductor"):
                continue
            assert workload["kind"] == "Deployment"
            user = tmp_path / f"{component}.creds"
            write_secret(user, bed.run_user(key, BusRole(component)))
            pod_spec = workload["spec"]["template"]["spec"]
            argv, env = as_process(pod_spec, f"{component}-7d9f-x2x4q", mounted, tmp_path, user)
            supervisor.start(component, argv, env)
            metrics[component] = f"http://127.0.0.1:{env[METRICS_PORT_ENV]}/metrics"

        async def first_state() -> CycleState | None:
            nc = await bed.hub.connect()
            try:
                return await newest(
                    nc.jetstream(), cycle_stream(key), cycle_state_subject(key), decode_cycle_state
                )
            finally:
                await nc.close()

        state = wait_for("the conductor's first cycle", lambda: asyncio.run(first_state()))
        assert (state.run, state.number, state.phase) == (key, 1, "Collecting")
        for component, url in metrics.items():
            wait_for(f"{component}'s metrics", lambda u=url: served(u))
        supervisor.check_alive()
    finally:
        supervisor.stop_all()


def test_a_pod_told_no_nats_or_given_a_model_it_cannot_read_says_so(tmp_path: Path) -> None:
    spec = yaml.safe_load((ROOT / "examples" / "rlrun.yaml").read_text())["spec"]
    mounted = tmp_path / "rlrun.json"
    mounted.write_text(json.dumps({"run": "r", "spec": spec}))
    feed = [sys.executable, "-m", "rlfleet.rollout.taskfeed.feed", "--rlrun", str(mounted)]
    done = subprocess.run(feed, capture_output=True, text=True, timeout=120)
    assert done.returncode != 0 and "RLFLEET_NATS_URL is not set" in done.stderr
    assert "Traceback" not in done.stderr

    spec["model"]["uri"] = "s3://bucket/tiny-moe"
    mounted.write_text(json.dumps({"run": "r", "spec": spec}))
    trainer = [sys.executable, "-m", "rlfleet.trainer", "--rlrun", str(mounted)]
    env = os.environ | {"RLFLEET_NATS_URL": "nats://127.0.0.1:4222"}
    done = subprocess.run(trainer, capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode != 0 and "spec.model.uri 's3://bucket/tiny-moe'" in done.stderr
    assert "Traceback" not in done.stderr


def test_a_production_pools_server_starts_from_the_spec_its_region_mounts(tmp_path: Path) -> None:
    """The pool's own Deployment (examples/serving.yaml), as a pod runs it: its settings are
    made from the run's spec as the region's operator mounts it and the pod's environment,
    and the server says (as the region operator reads it) which run, set and version it
    serves; one with no NATS server named says so in a line."""
    supervisor = Supervisor(tmp_path / "logs", attached=True)
    try:
        bed = start_nats([REGION], supervisor, tmp_path / "nats")
        run, key, access = production_run(bed)
        mirrored = mirror(run, "hub", access)  # as the region holds it, and mounts its spec
        mirrored["metadata"]["uid"] = "region-uid"
        mounted = tmp_path / "rlrun.json"
        mounted.write_text(spec_config_map(mirrored)["data"]["rlrun.json"])
        user = tmp_path / "serving.creds"
        write_secret(user, bed.run_user(key, BusRole.SERVING))

        deployment = yaml.safe_load((ROOT / "examples" / "serving.yaml").read_text())
        pod_spec = deployment["spec"]["template"]["spec"]
        (container,) = pod_spec["containers"]
        volumes = {v["name"]: v for v in pod_spec["volumes"]}
        assert volumes["spec"]["configMap"]["name"] == f"{run['metadata']['name']}-spec"
        assert volumes["nats"]["secret"]["secretName"] == nats_credentials_secret(
            run["metadata"]["name"], BusRole.SERVING
        )
        # The pool's feedback Secret, as the region's operator mints it for pool `chat`.
        pool = yaml.safe_load((ROOT / "examples" / "inferencepool.yaml").read_text())
        pool["metadata"] |= {"name": "chat", "namespace": "team-a", "uid": "pool-uid"}
        secret = pool_feedback(pool, "minted-key")
        assert volumes["feedback"]["secret"]["secretName"] == secret["metadata"]["name"]
        feedback = tmp_path / "feedback"
        feedback.mkdir()
        for name, value in secret["data"].items():
            (feedback / name).write_bytes(base64.b64decode(value))
        model, port = init_model("tiny-moe", tmp_path / "model"), free_port()
        places = {"/models/tiny-moe": str(model), "8000": str(port)}
        args = [places.get(a, a) for a in container["args"]]
        args += ["--dtype", serving_dtype(cpu_flags()), "--max-model-len", "512"]
        command = [sys.executable if a == "python" else a for a in container["command"]]
        argv = [*command, str(mounted), *args]
        env = {e["name"]: e["value"] for e in container["env"] if "value" in e}
        env |= {
            "RLFLEET_NATS_URL": bed.leaves[REGION].url,
            CREDENTIALS_ENV: str(user),
            STATE_DIR_ENV: str(tmp_path / "state"),
            # Deeper than a pod's: vLLM's sockets would not fit under it (`sockets_folder`).
            CACHE_ROOT_ENV: str(tmp_path / "state" / "cache"),
            "VLLM_API_KEY": "k",
            FEEDBACK_DIR_ENV: str(feedback),  # where the pod mounts it
        }
        supervisor.start("serving", argv, env | CPU_ENV)
        said = ServedVersion(run=key, replica_set="stable", version=0, digest="", replicas=1)
        wait_for("the server's version", lambda: read_served("127.0.0.1", port, 5) == said, 300)
        settings = json.loads((tmp_path / "state" / "serving.json").read_text())
        assert (settings["run"], settings["nats_url"]) == (key, bed.leaves[REGION].url)
        assert (settings["jetstream_domain"], settings["weights_domain"]) == (HUB_DOMAIN, REGION)
        supervisor.check_alive()
    finally:
        supervisor.stop_all()

    unplaced = [*argv[:4], str(mounted), "--model", str(model)]
    done = subprocess.run(unplaced, capture_output=True, text=True, timeout=120)
    assert done.returncode != 0 and "RLFLEET_NATS_URL is not set" in done.stderr
    assert "Traceback" not in done.stderr
    # Without the pool's feedback Secret mounted it says so, and serves nothing.
    placed = {"RLFLEET_NATS_URL": bed.leaves[REGION].url, STATE_DIR_ENV: str(tmp_path / "s")}
    done = subprocess.run(unplaced, capture_output=True, text=True, timeout=120, env=placed)
    assert done.returncode != 0 and "no feedback key" in done.stderr
    assert f"{FEEDBACK_DIR_ENV} is not set" in done.stderr and "Traceback" not in done.stderr
