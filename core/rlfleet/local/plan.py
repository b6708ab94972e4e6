"""What `rlfleet run` starts for an RLRun on one machine, decided without starting it.

The same spec the operator reads becomes one trainer, one rollout worker per region
(each behind its region's NATS leaf node, as in production), a task feeder, and the
evaluator when the spec has an evaluation gate. The
trainer and the rollout workers get disjoint CPU cores, as they would sit on separate
GPUs, so an asynchronous run measures overlap rather than contention.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from dataclasses import dataclass
from pathlib import Path

import msgspec
from msgspec.structs import replace

from rlfleet.api.profile import Profile
from rlfleet.api.rlrun import RLRunSpec
from rlfleet.api.wire import BusRole
from rlfleet.bus.connection import CREDENTIALS_ENV
from rlfleet.launch import components, from_spec, objectstore, pods
from rlfleet.local.nats import HUB_DOMAIN, NatsBed
from rlfleet.local.processes import free_port
from rlfleet.pipeline.model import Feed, Pipeline
from rlfleet.pipeline.sizing import Split, pipeline_for

TINY_SCHEME = "tiny://"  # model.uri tiny://tiny-moe: made on the spot, then warmed up


@dataclass(frozen=True)
class Layout:
    """Where a local run keeps everything; running again with the same root resumes."""

    root: Path
    spec_dir: Path = Path()  # where the run's file is: its relative paths start there

    @classmethod
    def of(cls, name: str, spec_file: Path, root: Path | None = None) -> Layout:
        """The folder of the run `name` from `spec_file`: `root`, or .rlfleet/runs/NAME."""
        return cls(root or Path(".rlfleet") / "runs" / name, spec_dir=spec_file.parent)

    @property
    def model(self) -> Path:
        return self.root / "model"

    @property
    def models(self) -> Path:
        """Where an s3:// model is fetched (`launch.objectstore.cache_folder`)."""
        return self.root / "models"

    @property
    def checkpoints(self) -> Path:
        return self.root / "trainer"

    @property
    def nats(self) -> Path:
        return self.root / "nats"

    def credentials(self, role: BusRole) -> Path:
        """The NATS user of one of the run's components (or its observer's), as its pods
        would have it."""
        return self.nats / f"{role}.creds"

    @property
    def logs(self) -> Path:
        return self.root / "logs"

    @property
    def configs(self) -> Path:
        return self.root / "config"

    @property
    def report(self) -> Path:
        return self.root / "report"

    @property
    def caches(self) -> Path:
        """The run's compile caches (`rlfleet.launch.caches`), kept for re-runs."""
        return self.root / "cache"


@dataclass(frozen=True)
class Tuning:
    """Sizes for a tiny model on a few CPU cores; production sizes come from the images.
    What the run learns by (learning rate, step size, turns, ...) is the spec's, as in a
    cluster (`examples/local.yaml` states `make demo`'s recipe)."""

    # Supervised steps on the suite before RL (`bench/warmup.py` measures the choice): 240
    # leave the model right on about a third of attempts and some attempt right on two
    # thirds of tasks. RL turns "sometimes right" into "right", so that gap is what a run
    # can gain; fewer steps leave less right, more answer most tasks outright.
    warmup_steps: int = 240
    max_model_len: int = 1024
    # Three groups at once per rollout worker: with one, a worker's engine idles while a
    # group's last attempts finish and runs small batches.
    max_sessions: int = 48
    queue_depth: int = 8


@dataclass(frozen=True)
class Process:
    name: str
    argv: list[str]
    config: msgspec.Struct  # its settings, written as JSON where `settings_path` says
    env: dict[str, str]
    settings_file: Path | None = None  # None: the argv's last word

    @property
    def settings_path(self) -> Path:
        return self.settings_file or Path(self.argv[-1])

    @property
    def metrics_url(self) -> str | None:
        """Where the process serves its Prometheus metrics, if it does."""
        port = getattr(self.config, "metrics_port", None)
        return None if port is None else f"http://127.0.0.1:{port}{pods.METRICS_PATH}"


def local_pipeline(spec: RLRunSpec, profile: Profile, tuning: Tuning) -> Pipeline:
    """`rlfleet plan`'s model of what `processes` starts: one trainer rank, and one worker
    per region, all on the one rollout core (`split_cores`)."""
    split = Split(trainer_gpus=1, rollout_gpus={"local": len(spec.rollout_regions)})
    feed = from_spec.feed_settings("local", spec, pods.Placement("nats://local"))
    return pipeline_for(spec, profile, split, Feed(tuning.queue_depth, feed.poll_s))


def serving_dtype(cpu_flags: set[str]) -> str:
    """What the rollout engines compute in on this machine's CPU. Without bf16 instructions
    (AVX-512 BF16, AMX) every bf16 matmul is converted on the fly: float32 generates the
    demo's rollouts about twice as fast and computes as the trainer does (the
    train/inference mismatch falls by four orders of magnitude). Weights still travel in
    the checkpoint's dtype."""
    return "bfloat16" if cpu_flags & {"avx512_bf16", "amx_bf16"} else "float32"


def cpu_flags() -> set[str]:
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    line = next((line for line in info.splitlines() if line.startswith("flags")), "")
    return set(line.partition(":")[2].split())


def split_cores(cores: list[int]) -> tuple[list[int], list[int]]:
    """Trainer cores and rollout cores, disjoint, at least one each (shared if only one)."""
    if len(cores) < 2:
        return cores, cores
    half = len(cores) // 2
    return cores[:half], cores[half:]


def pinned(component: components.Program, cores: list[int], config_path: Path) -> list[str]:
    cpus = ",".join(map(str, cores))
    return ["taskset", "-c", cpus, *component.command(sys.executable), str(config_path)]


def model_path(spec: RLRunSpec, layout: Layout) -> Path:
    if spec.model.uri.startswith(TINY_SCHEME):
        return layout.model
    if spec.model.uri.startswith(objectstore.S3_SCHEME):
        return objectstore.cache_folder(layout.models, spec.model.uri, spec.model.endpoint)
    return Path(pods.model_dir(spec))


def processes(
    name: str, spec: RLRunSpec, layout: Layout, nats: NatsBed, tuning: Tuning
) -> list[Process]:
    """The components as local processes, with the settings pods get from the same spec
    (`rlfleet.launch.from_spec`) and this machine's sizes on top. Each connects to NATS as
    the user of its component (`layout.credentials`), as its pods would, and serves its
    metrics on a port of its own (`Process.metrics_url`)."""
    trainer_cores, rollout_cores = split_cores(sorted(os.sched_getaffinity(0)))
    model = str(model_path(spec, layout))
    threads = {"OMP_NUM_THREADS": str(len(trainer_cores))}
    hub = pods.Placement(nats.hub.url, HUB_DOMAIN)
    trainer = from_spec.trainer_settings(name, spec, model, str(layout.checkpoints), metered(hub))
    trainer = replace(trainer, zero_stage=min(trainer.zero_stage, 2))  # ZeRO-3 needs a GPU
    found = [_component(layout, "trainer", components.TRAINER, trainer_cores, trainer, threads)]
    rollout_env = _rollout_env(rollout_cores)
    found += _rollout_workers(name, spec, layout, model, nats, tuning, rollout_cores, rollout_env)
    feed = from_spec.feed_settings(name, spec, metered(hub))
    feed = replace(feed, depth=tuning.queue_depth, tasks_dir=str(layout.spec_dir.resolve()))
    found.append(_component(layout, "feed", components.FEED, rollout_cores, feed, {}))
    if spec.evaluation is not None:
        # Scoring shares the rollout cores: it generates, as they do.
        evaluator = from_spec.evaluator_settings(name, spec, model, metered(hub))
        scoring_threads = {"OMP_NUM_THREADS": rollout_env["OMP_NUM_THREADS"]}
        found.append(
            _component(
                layout, "evaluator", components.EVALUATOR, rollout_cores, evaluator, scoring_threads
            )
        )
    return found


def metered(at: pods.Placement) -> pods.Placement:
    """`at`, serving its metrics on a free port of this machine."""
    return dataclasses.replace(at, metrics_port=free_port())


def _component(
    layout: Layout,
    process_name: str,
    component: components.Component,
    cores: list[int],
    config: msgspec.Struct,
    env: dict,
) -> Process:
    """One of the run's components, pinned to `cores`, as its own NATS user."""
    path = layout.configs / f"{process_name}.json"
    env = env | {CREDENTIALS_ENV: str(layout.credentials(BusRole(component.name)))}
    return Process(process_name, pinned(component, cores, path), config, env)


def _rollout_env(rollout_cores: list[int]) -> dict[str, str]:
    return {
        "OMP_NUM_THREADS": str(len(rollout_cores)),
        # vLLM's CPU engine binds its own threads; keep them on the rollout cores.
        "VLLM_CPU_OMP_THREADS_BIND": ",".join(map(str, rollout_cores)),
        "VLLM_CPU_KVCACHE_SPACE": "1",
        # Engine and model in the worker's own process: on one shared core, vLLM's usual
        # three processes only add a hand-off per engine step and per weight update.
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    }


def _rollout_workers(
    name: str,
    spec: RLRunSpec,
    layout: Layout,
    model: str,
    nats: NatsBed,
    tuning: Tuning,
    rollout_cores: list[int],
    rollout_env: dict[str, str],
) -> list[Process]:
    """One rollout worker per region, behind the region's leaf node, on the rollout cores."""
    dtype = serving_dtype(cpu_flags())
    found = []
    for demand in spec.rollout_regions:
        at = pods.Placement(nats.leaves[demand.name].url, HUB_DOMAIN, demand.name, "0")
        worker = from_spec.rollout_settings(name, spec, model, metered(at))
        worker = replace(
            worker,
            dtype=dtype,
            max_sessions=tuning.max_sessions,
            max_model_len=tuning.max_model_len,
        )
        found.append(
            _component(
                layout,
                f"rollout-{demand.name}",
                components.ROLLOUT,
                rollout_cores,
                worker,
                rollout_env,
            )
        )
    return found
