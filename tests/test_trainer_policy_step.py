"""The trainer's policy step on its own: the clipped fraction it reports is a fraction of the
step's tokens, and a micro-batch whose loss is not finite never reaches the weights."""

from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path

import pytest

from rlfleet.launch.settings import TrainerConfig, to_json
from rlfleet.local.processes import run_in_session

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_a_step_that_clips_every_token_reports_a_clipped_fraction_of_one(tmp_path: Path) -> None:
    """Two micro-batches, two updates per step, a clip range of almost nothing and a large
    learning rate: the second pass moves every token's ratio out of the range, so the step
    clipped all of its tokens, whatever the micro-batches' share of them."""
    from rlfleet.models.tiny import init_model  # torch: only where an engine runs

    config = TrainerConfig(
        run="clip",
        nats_url="nats://unused:4222",
        model=init_model("tiny-moe", tmp_path / "model"),
        checkpoint_dir=tmp_path / "checkpoints",
        router_replay=False,
        lr=1e-2,
        lr_warmup_steps=0,
        updates_per_step=2,
        clip_low=1e-6,
        clip_high=1e-6,
    )
    report = run_probe("policy_clipped.py", config, tmp_path)
    assert report["clipped_fraction"] > 0.95


def run_probe(probe: str, config: TrainerConfig, tmp_path: Path) -> dict:
    """The probe's JSON report, from a process of its own (DeepSpeed's engine on CPU)."""
    (tmp_path / "trainer.json").write_bytes(to_json(config))
    report = tmp_path / "report.json"
    result = run_in_session(
        [
            sys.executable,
            str(ROOT / "tests" / "probes" / probe),
            str(tmp_path / "trainer.json"),
            str(report),
        ],
        env={**os.environ, "DS_ACCELERATOR": "cpu", "TOKENIZERS_PARALLELISM": "false"},
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    return json.loads(report.read_text())


@pytest.mark.slow
@pytest.mark.parametrize("zero_stage", [0, 2])
def test_a_nan_loss_is_left_out_and_never_reaches_the_weights(
    zero_stage: int, tmp_path: Path
) -> None:
    """A model gone wrong gives NaN log-probs. Without ZeRO, one NaN loss made every weight
    NaN in one step, then every rollout engine's and, in real-time RL, production's; under
    ZeRO, DeepSpeed's overflow check dropped the whole step, the good micro-batches too,
    and the step's report said loss NaN (JSON null, which no reader of it takes). Here the
    behaviour log-probs of some micro-batches are NaN, which makes their loss NaN."""
    from rlfleet.models.tiny import init_model

    config = TrainerConfig(
        run="nan",
        nats_url="nats://unused:4222",
        model=init_model("tiny-moe", tmp_path / "model"),
        checkpoint_dir=tmp_path / "checkpoints",
        router_replay=False,
        lr=1e-3,
        lr_warmup_steps=0,
        zero_stage=zero_stage,
    )
    report = run_probe("policy_nonfinite.py", config, tmp_path)
    # One of two: the step trains on the other, and reports only what it trained on.
    some, everything = report["some"], report["all"]
    assert some["finite"] and everything["finite"]
    assert some["left_out"] == 1 and some["changed"]
    assert math.isfinite(some["loss"]) and math.isfinite(some["mismatch_mean_abs"])
    # Both: no optimiser step at all (AdamW would move weights even on no gradient).
    assert everything["left_out"] == 2 and not everything["changed"]
