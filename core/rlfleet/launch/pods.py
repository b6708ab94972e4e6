"""What the operator gives a component's pod, and the component reads back: the run's
mounted spec, its DeepSpeed settings and NATS and EnvPool secrets, and the environment
that says where the pod was placed (`Placement`). `rlfleet run` places local processes
with the same `Placement`, so a component is told where it runs in one way only.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rlfleet.api.rlrun import RLRunSpec
from rlfleet.api.wire import BusRole
from rlfleet.launch import objectstore
from rlfleet.launch.settings import Ranks

SPEC_DIR = "/etc/rlfleet"
SPEC_FILE = f"{SPEC_DIR}/rlrun.json"  # {"run": its key on NATS, "spec": RLRun spec}, as JSON
# The ConfigMap `spec.trainer.deepSpeedConfigMap`, in trainer pods: a folder of its own,
# since a mount inside the read-only spec volume would need a folder made in it.
DEEPSPEED_DIR = "/etc/rlfleet-deepspeed"
DEEPSPEED_KEY = "ds_config.json"
DEEPSPEED_CONFIG_FILE = f"{DEEPSPEED_DIR}/{DEEPSPEED_KEY}"
STATE_DIR = "/var/lib/rlfleet"  # the trainer's checkpoints and step log live under here
# A component's own NATS user (a .creds file, from `nats_credentials_secret(run, role)`).
NATS_CREDENTIALS_DIR = "/var/run/secrets/rlfleet/nats"
NATS_CREDENTIALS_KEY = "creds"
# A rollout pod's bearer token for its run's EnvPool (a Secret the region operator mints).
ENVPOOL_TOKEN_DIR = "/var/run/secrets/rlfleet/envpool"
ENVPOOL_TOKEN_KEY = "token"
ENVPOOL_TOKEN_FILE = f"{ENVPOOL_TOKEN_DIR}/{ENVPOOL_TOKEN_KEY}"

# The environment a pod gets from the operator (`Placement.from_env` reads it back).
NATS_URL_ENV = "RLFLEET_NATS_URL"
JETSTREAM_DOMAIN_ENV = "RLFLEET_JETSTREAM_DOMAIN"
REGION_ENV = "RLFLEET_REGION"
POD_NAME_ENV = "RLFLEET_POD_NAME"
STATE_DIR_ENV = "RLFLEET_STATE_DIR"
ENVPOOL_URL_ENV = "RLFLEET_ENVPOOL_URL"  # a rollout pod's EnvPool Service
# A production pool's server: the set of the pool's servers it is in ("canary", "stable").
REPLICA_SET_ENV = "RLFLEET_REPLICA_SET"
# The port the component serves its Prometheus metrics on (`/metrics`). The operator sets
# it from the same number as the pod's `metrics` port and scrape annotations, so the three
# cannot disagree; processes sharing a host (`rlfleet run`) are each given their own.
METRICS_PORT_ENV = "RLFLEET_METRICS_PORT"
METRICS_PATH = "/metrics"  # where prometheus_client's server answers
# A trainer pod's place in the run's DeepSpeed job (`rlfleet.launch.settings.Ranks`): its
# ordinal in the StatefulSet (the downward API's `apps.kubernetes.io/pod-index` label),
# the job's pods, processes per pod and rank 0's pod, as the operator sizes them.
TRAINER_NODE_RANK_ENV = "RLFLEET_TRAINER_NODE_RANK"
TRAINER_NODES_ENV = "RLFLEET_TRAINER_NODES"
TRAINER_PROCS_PER_NODE_ENV = "RLFLEET_TRAINER_PROCS_PER_NODE"
TRAINER_MASTER_ADDR_ENV = "RLFLEET_TRAINER_MASTER_ADDR"
TRAINER_MASTER_PORT_ENV = "RLFLEET_TRAINER_MASTER_PORT"

FILE_SCHEME = "file://"
# The model cache volume, where an s3:// model is fetched (`objectstore.cache_folder`).
MODEL_CACHE_DIR = "/var/cache/rlfleet/models"


@dataclass(frozen=True)
class Placement:
    """Where one component runs: the NATS server it reaches, the JetStream domain of the
    run's streams, for a rollout worker its region and pod, the port it serves its
    metrics on (none: it serves none), and for a trainer its place in the job."""

    nats_url: str
    jetstream_domain: str | None = None
    region: str | None = None
    pod: str | None = None
    state_dir: str = STATE_DIR
    metrics_port: int | None = None
    ranks: Ranks = field(default_factory=Ranks)
    envpool_url: str | None = None  # where a rollout worker claims sandboxes
    replica_set: str | None = None  # a production pool's server's set; None: it follows none

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> Placement:
        if not env.get(NATS_URL_ENV):
            raise ValueError(f"{NATS_URL_ENV} is not set: which NATS server holds the run?")
        return cls(
            nats_url=env[NATS_URL_ENV],
            jetstream_domain=env.get(JETSTREAM_DOMAIN_ENV) or None,
            region=env.get(REGION_ENV) or None,
            pod=env.get(POD_NAME_ENV) or None,
            state_dir=env.get(STATE_DIR_ENV) or STATE_DIR,
            metrics_port=_port(env, METRICS_PORT_ENV),
            ranks=_ranks(env),
            envpool_url=env.get(ENVPOOL_URL_ENV) or None,
            replica_set=env.get(REPLICA_SET_ENV) or None,
        )


def _ranks(env: Mapping[str, str]) -> Ranks:
    """A trainer pod's place in the job, as the operator tells it; a job of one process
    when it tells none. A job of several pods needs each pod's rank: without it every pod
    would be rank 0 of its own job."""
    one = Ranks()
    if not env.get(TRAINER_NODES_ENV):
        return one
    nodes = _count(env, TRAINER_NODES_ENV, least=1, default=one.nodes)
    if not env.get(TRAINER_NODE_RANK_ENV):
        raise ValueError(
            f"{TRAINER_NODE_RANK_ENV} is not set: which of the {nodes} trainer pods is this "
            "(its StatefulSet's apps.kubernetes.io/pod-index label)?"
        )
    rank = _count(env, TRAINER_NODE_RANK_ENV, least=0, default=one.node_rank)
    if rank >= nodes:
        raise ValueError(
            f"{TRAINER_NODE_RANK_ENV}={rank}: expected below {TRAINER_NODES_ENV}={nodes}"
        )
    return Ranks(
        node_rank=rank,
        nodes=nodes,
        procs_per_node=_count(env, TRAINER_PROCS_PER_NODE_ENV, least=1, default=one.procs_per_node),
        master_addr=env.get(TRAINER_MASTER_ADDR_ENV) or one.master_addr,
        master_port=_port(env, TRAINER_MASTER_PORT_ENV) or one.master_port,
    )


def _count(env: Mapping[str, str], name: str, least: int, default: int) -> int:
    text = env.get(name)
    if not text:
        return default
    if not text.isdigit() or int(text) < least:
        raise ValueError(f"{name}={text!r}: expected a whole number, {least} or more")
    return int(text)


def _port(env: Mapping[str, str], name: str) -> int | None:
    text = env.get(name)
    if not text:
        return None
    if not text.isdigit() or not 0 < int(text) < 65536:
        raise ValueError(f"{name}={text!r}: expected a TCP port, 1 to 65535")
    return int(text)


def envpool_token_secret(run: str) -> str:
    """The Secret holding a run's token for its EnvPool, beside its mirror in a region."""
    return f"{run}-envpool"


# Every user the hub operator mints a run, whatever its kind: one per component, and the
# observer, for people and tools (`kubectl get secret <run>-nats-observer`).
POD_ROLES = tuple(BusRole)


def nats_credentials_secret(run: str, role: BusRole) -> str:
    """The Secret with the NATS user of one of the run's components, in the cluster its
    pods run in: the rollout workers' in each region, the others' in the hub."""
    return f"{run}-nats-{role}"


def run_key(namespace: str, name: str) -> str:
    """An RLRun's name on NATS, in its streams, subjects and user: runs of one name in two
    namespaces are two runs. Neither a namespace nor an RLRun's name may hold `_` (both
    are DNS labels), so two runs never share a key."""
    return f"{namespace}_{name}"


def spec_document(run: str, spec: dict) -> str:
    """The mounted file's text: the run's key on NATS (`run_key`) and its spec."""
    return json.dumps({"run": run, "spec": spec}, sort_keys=True)


def read_spec(path: Path) -> tuple[str, RLRunSpec]:
    """The run's key on NATS and its spec, from the mounted file."""
    document = json.loads(path.read_text())
    return document["run"], RLRunSpec.model_validate(document["spec"])


def model_dir(spec: RLRunSpec) -> str:
    """The base checkpoint's folder: a `file://` model's from a mounted volume, an `s3://`
    one's in the model cache, where the pod's init container fetched it."""
    uri = spec.model.uri
    if uri.startswith(objectstore.S3_SCHEME):
        folder = objectstore.cache_folder(Path(MODEL_CACHE_DIR), uri, spec.model.endpoint)
        if not (folder / objectstore.MANIFEST).exists():
            raise ValueError(
                f"spec.model.uri {uri!r}: not fetched into {folder}; the pod's init container "
                "fetch-model fetches it first (kubectl logs POD -c fetch-model)"
            )
        return str(folder)
    if not uri.startswith(FILE_SCHEME):
        raise ValueError(
            f"spec.model.uri {uri!r}: components read file:// and s3:// checkpoints; mount "
            "the model and name its folder"
        )
    return uri.removeprefix(FILE_SCHEME)


def read_deepspeed(spec: RLRunSpec, path: Path) -> dict[str, Any] | None:
    """The user's DeepSpeed settings, from the mounted `ds_config.json` of the ConfigMap
    the spec names (None when it names none)."""
    config_map = spec.trainer.deep_speed_config_map
    if config_map is None:
        return None
    document = json.loads(path.read_text())
    if not isinstance(document, dict):
        raise ValueError(
            f"spec.trainer.deepSpeedConfigMap {config_map}: {DEEPSPEED_KEY} is not a JSON object"
        )
    return document
