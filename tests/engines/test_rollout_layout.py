"""How a rollout pod spreads vLLM over its GPUs (a pure decision), the pod's engine
processes, and the parallel engine's workers agreeing on what they loaded."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
from hypothesis import given
from hypothesis import strategies as st

from rlfleet.launch.settings import WorkerConfig
from rlfleet.rollout.worker import layout
from rlfleet.rollout.worker.processes import engine_config
from rlfleet.weightsync.vllm_client import disagree

GIB = 1 << 30
H100 = 80 * GIB

models = st.integers(min_value=1, max_value=2 << 40)  # up to 2 TiB of weights
pods = st.sampled_from([1, 2, 4, 8, 16])
heads = st.sampled_from([4, 8, 16, 32, 64, 96, 128])
memories = st.sampled_from([24 * GIB, 48 * GIB, 80 * GIB, 141 * GIB, 192 * GIB])


def test_a_model_that_fits_one_gpu_runs_an_engine_per_gpu() -> None:
    chosen = layout.choose(16 * GIB, gpus=8, gpu_bytes=H100, attention_heads=32)
    assert (chosen.tensor_parallel, chosen.engines) == (1, 8)


def test_a_model_too_large_for_one_gpu_spreads_over_as_few_as_hold_it() -> None:
    # 140 GiB of weights: 4 H100s hold 35 GiB each (under 45 % of 80 GiB); 2 would not.
    chosen = layout.choose(140 * GIB, gpus=8, gpu_bytes=H100, attention_heads=32)
    assert (chosen.tensor_parallel, chosen.engines) == (4, 2)
    assert "35.0 GiB of weights per GPU of 80 GiB" in chosen.reason


def test_a_model_no_pod_holds_uses_every_gpu_and_says_it_does_not_fit() -> None:
    chosen = layout.choose(1 << 40, gpus=8, gpu_bytes=H100, attention_heads=64)
    assert (chosen.tensor_parallel, chosen.engines) == (8, 1)
    assert "more than the 45% left beside the KV cache" in chosen.reason


def test_the_cpu_backend_runs_one_engine_of_the_workers_set() -> None:
    assert layout.choose(GIB, 0, 0, 4) == layout.Layout(1, 1, "no GPU: one engine on the CPU")
    assert layout.choose(GIB, 0, 0, 4, tensor_parallel=2).tensor_parallel == 2


@pytest.mark.parametrize(
    ("gpus", "heads", "tensor_parallel", "field"),
    [(8, 32, 3, "does not divide the pod's 8 GPUs"), (4, 6, 4, "6 attention heads")],
)
def test_a_tensor_parallel_setting_that_cannot_work_is_refused(
    gpus: int, heads: int, tensor_parallel: int, field: str
) -> None:
    with pytest.raises(ValueError, match=field):
        layout.choose(GIB, gpus, H100, heads, tensor_parallel)


@given(models, pods, memories, heads)
def test_every_gpu_works_and_engines_are_as_small_as_fit(
    weights: int, gpus: int, memory: int, attention_heads: int
) -> None:
    chosen = layout.choose(weights, gpus, memory, attention_heads)
    assert chosen.tensor_parallel * chosen.engines == gpus
    assert attention_heads % chosen.tensor_parallel == 0
    fits = weights / chosen.tensor_parallel <= layout.WEIGHT_SHARE * memory
    smaller = [
        tp
        for tp in range(1, chosen.tensor_parallel)
        if gpus % tp == 0 and attention_heads % tp == 0
    ]
    # Fewer workers per engine would not hold the weights; more would only slow it.
    assert all(weights / tp > layout.WEIGHT_SHARE * memory for tp in smaller)
    if not fits:
        assert chosen.tensor_parallel == max([*smaller, chosen.tensor_parallel])


@given(models, pods, memories, heads)
def test_each_engine_restricted_to_its_gpus_chooses_the_same_engine(
    weights: int, gpus: int, memory: int, attention_heads: int
) -> None:
    """The pod's processes decide again on their own GPUs: each must run one engine."""
    chosen = layout.choose(weights, gpus, memory, attention_heads)
    alone = layout.choose(weights, chosen.tensor_parallel, memory, attention_heads)
    assert (alone.tensor_parallel, alone.engines) == (chosen.tensor_parallel, 1)


@given(st.lists(st.integers(0, 255), min_size=1, max_size=64, unique=True), st.data())
def test_cpu_workers_get_disjoint_cores_covering_the_process(cpus: list[int], data) -> None:
    workers = data.draw(st.integers(1, len(cpus)))
    groups = [g.split(",") for g in layout.cpu_binds(cpus, workers).split("|")]
    assert len(groups) == workers and all(groups)
    assert sorted(int(c) for g in groups for c in g) == sorted(cpus)


def test_more_cpu_workers_than_cores_is_refused() -> None:
    with pytest.raises(ValueError, match="3 CPU workers need as many CPUs"):
        layout.cpu_binds([0, 1], 3)


def test_engines_get_disjoint_devices_and_their_own_names_and_ports() -> None:
    chosen = layout.Layout(tensor_parallel=2, engines=3, reason="")
    assert layout.engine_devices(["3", "5", "6", "7", "0", "1"], chosen) == [
        ["3", "5"],
        ["6", "7"],
        ["0", "1"],
    ]
    config = WorkerConfig(run="r", nats_url="nats://x", model="/m", name="a/pod-0")
    one = engine_config(config, 1)
    assert (one.name, one.metrics_port) == ("a/pod-0/1", None)
    port = engine_config(WorkerConfig(**{**_fields(config), "metrics_port": 9400}), 2)
    assert port.metrics_port == 9402


def _fields(config: WorkerConfig) -> dict:
    return {name: getattr(config, name) for name in config.__struct_fields__}


def test_workers_that_loaded_different_states_are_refused() -> None:
    same = {"loaded": 3, "verified": "d3", "digest": "d3"}
    disagree([same, dict(same)])
    disagree([{"loaded": None, "verified": None, "digest": None}] * 2)  # before any update
    with pytest.raises(RuntimeError, match="worker 1: 3 forged"):
        disagree([same, {**same, "digest": "forged"}])
    with pytest.raises(RuntimeError, match="worker 0: 2 d2"):
        disagree([{"loaded": 2, "verified": "d2", "digest": "d2"}, same])
    # Workers that computed the same digest, but not the verified one, are refused too.
    with pytest.raises(RuntimeError, match=r"\(verified: 3 d3\)"):
        disagree([{**same, "digest": "other"}] * 2)
    # So are workers told different verified digests.
    with pytest.raises(RuntimeError, match="verified: 3 d3, 3 d4"):
        disagree([same, {"loaded": 3, "verified": "d4", "digest": "d3"}])


POD = """
import os, signal, sys, time
from rlfleet.rollout.worker import processes
from rlfleet.rollout.worker import layout

seen = sys.argv[1] + "/seen"
if processes.ENGINE in os.environ:  # an engine process
    index = os.environ[processes.ENGINE]

    def stopped(*_):
        with open(seen, "a") as f:
            f.write(f"stopped {index}\\n")
        sys.exit(0)

    signal.signal(signal.SIGTERM, stopped)
    with open(seen, "a") as f:
        f.write(f"{os.environ['CUDA_VISIBLE_DEVICES']} {index}\\n")
    if index == sys.argv[2]:
        # Once the other is up (its handler set), or it would die of the SIGTERM unheard.
        while len(open(seen).read().splitlines()) < 2:
            time.sleep(0.05)
        sys.exit(7)
    time.sleep(120)
    sys.exit(1)
command = [sys.executable, *sys.argv]
sys.exit(processes.run(layout.Layout(2, 2, ""), command))
"""


def test_the_pod_stops_every_engine_when_one_fails_and_reports_its_status(tmp_path) -> None:
    """`processes.run` as a pod runs it: each engine process sees only its devices; one
    exiting nonzero stops the others and becomes the pod's status; SIGTERM reaches all."""
    script, seen = tmp_path / "pod.py", tmp_path / "seen"
    script.write_text(POD)
    pod = [sys.executable, str(script), str(tmp_path)]
    failed = subprocess.run([*pod, "1"], env=_env("4,5,6,7"), timeout=100)
    assert failed.returncode == 7
    assert sorted(seen.read_text().splitlines()) == ["4,5 0", "6,7 1", "stopped 0"]
    seen.unlink()
    running = subprocess.Popen([*pod, "none"], env=_env(None))
    while not seen.exists() or len(seen.read_text().splitlines()) < 2:
        time.sleep(0.1)
    running.send_signal(signal.SIGTERM)
    assert running.wait(timeout=100) == 0
    assert sorted(seen.read_text().splitlines()) == ["0,1 0", "2,3 1", "stopped 0", "stopped 1"]


def _env(visible: str | None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "CUDA_VISIBLE_DEVICES"}
    return env | ({"CUDA_VISIBLE_DEVICES": visible} if visible else {})


STUCK = """
import threading
from rlfleet.rollout.engine.driver import _VllmThread

calls = _VllmThread()
calls.submit(lambda: 1).result(timeout=30)
calls.submit(threading.Event().wait)  # as a call into a vLLM whose engine core died
print(calls.stop(wait_s=0.5))
"""


def test_a_worker_whose_call_into_vllm_never_returns_still_exits() -> None:
    """A rollout worker stopping with a call into vLLM stuck (its engine core died) leaves
    the call and exits, so its pod ends instead of hanging until it is killed."""
    done = subprocess.run(
        [sys.executable, "-c", STUCK], capture_output=True, text=True, timeout=120
    )
    assert (done.returncode, done.stdout.strip()) == (0, "False"), done.stderr[-2000:]
