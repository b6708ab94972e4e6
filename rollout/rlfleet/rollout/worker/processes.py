"""A rollout pod's engine processes: one rollout worker per engine when the pod's GPUs
hold several engines (`layout`). Imports no vLLM: the pod's first process only watches."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import time

import msgspec

from rlfleet.launch.settings import WorkerConfig
from rlfleet.rollout.worker import layout

# Which of the pod's engines a process drives; set for the processes `run` starts.
ENGINE = "RLFLEET_ROLLOUT_ENGINE"

log = logging.getLogger(__name__)


def engine_config(config: WorkerConfig, engine: int) -> WorkerConfig:
    """Engine `engine`'s worker: its own name in trajectories and logs, its own metrics port."""
    port = None if config.metrics_port is None else config.metrics_port + engine
    return msgspec.structs.replace(config, name=f"{config.name}/{engine}", metrics_port=port)


def run(chosen: layout.Layout, command: list[str]) -> int:
    """`command` (a rollout worker) once per engine, each seeing only its engine's GPUs.
    SIGTERM reaches every one (each finishes its groups); one that fails stops the rest,
    so the pod restarts whole. Returns the pod's exit status: the first failure's, else 0."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    count = chosen.tensor_parallel * chosen.engines
    devices = visible.split(",") if visible else [str(index) for index in range(count)]
    children: list[subprocess.Popen] = []

    def stop(*_) -> None:
        for child in children:
            if child.poll() is None:
                child.send_signal(signal.SIGTERM)

    # Before the first child: a SIGTERM while they start must reach those started.
    signal.signal(signal.SIGTERM, stop)
    for index, group in enumerate(layout.engine_devices(devices, chosen)):
        env = {**os.environ, "CUDA_VISIBLE_DEVICES": ",".join(group), ENGINE: str(index)}
        children.append(subprocess.Popen(command, env=env))
    failed = 0
    while any(child.poll() is None for child in children):
        for child in children:
            if not failed and child.poll():
                failed = child.returncode
                log.error(
                    "engine process %d exited with %d: stopping the others", child.pid, failed
                )
                stop()
        time.sleep(0.5)
    return failed or next((c.returncode for c in children if c.returncode), 0)
