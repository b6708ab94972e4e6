"""The programs of a run, and how each starts: `COMPONENTS` names the long-running ones
(`python -m MODULE`), which settings each reads and how a pod builds them
(`component_settings`); `components_of` says which a run has, and so which NATS users the
hub mints it.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Generic, TypeVar

import msgspec

from rlfleet.api.rlrun import RLRunSpec
from rlfleet.api.wire import BusRole
from rlfleet.launch.caches import own_caches
from rlfleet.launch.from_spec import (
    collector_settings,
    conductor_settings,
    evaluator_settings,
    feed_settings,
    rollout_settings,
    serving_settings,
    trainer_settings,
)
from rlfleet.launch.pods import (
    DEEPSPEED_CONFIG_FILE,
    SPEC_FILE,
    Placement,
    model_dir,
    read_deepspeed,
    read_spec,
)
from rlfleet.launch.production import CollectorConfig, ConductorConfig, ServingConfig
from rlfleet.launch.settings import (
    EvaluatorConfig,
    FeedConfig,
    TrainerConfig,
    WorkerConfig,
    from_json,
)
from rlfleet.launch.stopping import log_as_components_do

S = TypeVar("S", bound=msgspec.Struct)


@dataclass(frozen=True)
class Program:
    """A program of the components' images: `python -m MODULE ...`."""

    module: str

    def command(self, python: str = "python") -> list[str]:
        return [python, "-m", self.module]


@dataclass(frozen=True)
class Component(Program, Generic[S]):
    """A long-running part of a run: `python -m MODULE SETTINGS.json`, its settings as a
    local run writes them, or `--rlrun [SPEC]` in a pod, which builds them with
    `for_pod` from the mounted spec and the placement its environment gives."""

    name: str
    settings: type[S]
    for_pod: Callable[[str, RLRunSpec, Placement], S]

    def read(self, path: Path) -> S:
        return from_json(path.read_bytes(), self.settings)


def _trainer_pod(name: str, spec: RLRunSpec, at: Placement) -> TrainerConfig:
    deepspeed = read_deepspeed(spec, Path(DEEPSPEED_CONFIG_FILE))
    return trainer_settings(
        name, spec, model_dir(spec), f"{at.state_dir}/checkpoints", at, deepspeed
    )


def _rollout_pod(name: str, spec: RLRunSpec, at: Placement) -> WorkerConfig:
    return rollout_settings(name, spec, model_dir(spec), at)


def _evaluator_pod(name: str, spec: RLRunSpec, at: Placement) -> EvaluatorConfig:
    return evaluator_settings(name, spec, model_dir(spec), at)


# What a pod's init container runs to fetch an s3:// model into the model cache.
FETCH_MODEL = Program("rlfleet.launch.objectstore")
# A version of a run off its weight stream, as a Hugging Face checkpoint (`rlfleet export`).
EXPORT = Program("rlfleet.weightsync.checkpoint")
TRAINER = Component("rlfleet.trainer", "trainer", TrainerConfig, _trainer_pod)
ROLLOUT = Component("rlfleet.rollout", "rollout", WorkerConfig, _rollout_pod)
FEED = Component("rlfleet.rollout.taskfeed.feed", "feed", FeedConfig, feed_settings)
EVALUATOR = Component(
    "rlfleet.rollout.evaluation.evaluator", "evaluator", EvaluatorConfig, _evaluator_pod
)
# A production run's, in the hub: its cycles' experience, and its cycles.
COLLECTOR = Component(
    "rlfleet.rollout.production.collector", "collector", CollectorConfig, collector_settings
)
CONDUCTOR = Component(
    "rlfleet.operator.conductor", "conductor", ConductorConfig, conductor_settings
)
COMPONENTS = {c.name: c for c in (TRAINER, ROLLOUT, FEED, EVALUATOR, COLLECTOR, CONDUCTOR)}
# A production pool's server: production's own pod, not the run's (the user's Deployment
# runs it, with vLLM's arguments after the settings).
SERVING = Component(
    "rlfleet.rollout.production.serving", "serving", ServingConfig, serving_settings
)


def components_of(spec: RLRunSpec) -> list[Component]:
    """The components a run has: a trainer; rollout workers and their feed, or a
    production run's collector and conductor; and an evaluator, with an evaluation."""
    found: list[Component] = [TRAINER]
    found += [COLLECTOR, CONDUCTOR] if spec.production is not None else [ROLLOUT, FEED]
    return found + ([EVALUATOR] if spec.evaluation is not None else [])


def hub_roles(spec: RLRunSpec) -> list[BusRole]:
    """The users whose Secrets the hub operator writes in the hub: its components' there,
    and the observer's."""
    return [BusRole(c.name) for c in components_of(spec) if c is not ROLLOUT] + [BusRole.OBSERVER]


def region_role(spec: RLRunSpec) -> BusRole:
    """The user whose Secret the hub writes in each region of the run: its rollout
    workers', or its production pool's servers'."""
    return BusRole.SERVING if spec.production is not None else BusRole.ROLLOUT


# What `rlfleet run` runs besides: a tiny model's warm-up and a whole-suite evaluation.
WARMUP = Program("rlfleet.rollout.environment.warmup")
EVALUATION = Program("rlfleet.rollout.evaluation.suite")


def component_settings(argv: list[str], component: Component[S]) -> S:
    """A component's start: logging as every component logs, then its settings from its
    command line: `CONFIG.json` (its own settings, as `rlfleet run` writes them) or
    `--rlrun [SPEC]` (a pod: the mounted spec, `SPEC_FILE` by default, placed by the
    environment). One that cannot run as told exits with the reason, not a traceback, so
    `kubectl logs` says what to fix."""
    log_as_components_do()
    program = " ".join(component.command())
    parser = argparse.ArgumentParser(prog=program)
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("config", nargs="?", type=Path, help="the component's settings")
    source.add_argument(
        "--rlrun", nargs="?", const=SPEC_FILE, type=Path, help="the run's mounted spec"
    )
    args = parser.parse_args(argv)
    own_caches(None)  # a pod's under the root the operator mounts; a local tree's as set
    try:
        if args.config:
            return component.read(args.config)
        run, spec = read_spec(args.rlrun)
        return component.for_pod(run, spec, Placement.from_env(os.environ))
    except (OSError, ValueError, msgspec.DecodeError) as error:
        sys.exit(f"{program}: cannot run {args.config or args.rlrun}: {error}")
