"""The trainer's policy step on its own (`tests/probes/policy_step.py`, in a process of its
own: DeepSpeed's engine on CPU): the clipped fraction it reports is a fraction of the
step's tokens, a micro-batch whose loss is not finite never reaches the weights, and
its held-out gain says whether it learnt with or against what users said elsewhere."""

from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path

import pytest

from rlfleet.launch.settings import TrainerConfig, to_json
from rlfleet.local.processes import run_in_session

ROOT = Path(__file__).resolve().parents[2]


def run_probe(kind: str, tmp_path: Path, **settings) -> dict:
    """The probe's report on `kind` of step, with a tiny MoE and the trainer `settings`."""
    from rlfleet.models.tiny import init_model  # torch: only where an engine runs

    config = TrainerConfig(
        run=kind,
        nats_url="nats://unused:4222",
        model=init_model("tiny-moe", tmp_path / "model"),
        checkpoint_dir=tmp_path / "checkpoints",
        router_replay=False,
        learning_rate_warmup_steps=0,
        **settings,
    )
    (tmp_path / "trainer.json").write_bytes(to_json(config))
    report = tmp_path / "report.json"
    result = run_in_session(
        [
            sys.executable,
            str(ROOT / "tests" / "probes" / "policy_step.py"),
            *(str(tmp_path / "trainer.json"), str(report), kind),
        ],
        env={**os.environ, "DS_ACCELERATOR": "cpu", "TOKENIZERS_PARALLELISM": "false"},
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    return json.loads(report.read_text())


def test_a_step_that_clips_every_token_reports_a_clipped_fraction_of_one(tmp_path: Path) -> None:
    """Two micro-batches, two updates per step, a clip range of almost nothing and a large
    learning rate: the second pass moves every token's ratio out of the range, so the step
    clipped all of its tokens, whatever the micro-batches' share of them."""
    clipped = {"learning_rate": 1e-2, "updates_per_step": 2, "clip_low": 1e-6, "clip_high": 1e-6}
    assert run_probe("clipped", tmp_path, **clipped)["clipped_fraction"] > 0.95


@pytest.mark.parametrize("zero_stage", [0, 2])
def test_a_nan_loss_is_left_out_and_never_reaches_the_weights(
    zero_stage: int, tmp_path: Path
) -> None:
    """A model gone wrong gives NaN log-probs. Without ZeRO, one NaN loss made every weight
    NaN in one step, then every rollout engine's and, in real-time RL, production's; under
    ZeRO, DeepSpeed's overflow check dropped the whole step, the good micro-batches too,
    and the step's report said loss NaN (JSON null, which no reader of it takes). Here the
    behaviour log-probs of some micro-batches are NaN, which makes their loss NaN."""
    report = run_probe("nonfinite", tmp_path, learning_rate=1e-3, zero_stage=zero_stage)
    # One of two: the step trains on the other, and reports only what it trained on.
    some, everything = report["some"], report["all"]
    assert some["finite"] and everything["finite"]
    assert some["left_out"] == 1 and some["changed"]
    assert math.isfinite(some["loss"]) and math.isfinite(some["mismatch_mean_abs"])
    # Both: no optimiser step at all (AdamW would move weights even on no gradient).
    assert everything["left_out"] == 2 and not everything["changed"]


@pytest.mark.parametrize(
    ("inverted", "precision", "kl_coef"),
    [(False, "fp32", 0.0), (True, "bf16", 0.1)],
    ids=["agreeing-fp32", "inverted-bf16-with-reference"],
)
def test_a_step_against_what_users_said_has_a_negative_held_out_gain(
    inverted: bool, precision: str, kl_coef: float, tmp_path: Path
) -> None:
    """The signal a production run's candidate is held to (`rlfleet.trainer.held_out`): a
    step on feedback that agrees with the held-out trajectories' raises the policy's
    preference for what they rewarded; the same step on inverted feedback, as a broken
    client's, lowers it. With nothing held out there is no gain to report. The inverted
    step trains in bf16 over float32 master weights, with a reference model beside it:
    a GPU's precision learns (and is scored) as float32 does."""
    kind = "held_out_inverted" if inverted else "held_out"
    report = run_probe(kind, tmp_path, learning_rate=1e-3, kl_coef=kl_coef, precision=precision)
    assert (report["gain"] < 0) if inverted else (report["gain"] > 0)
    assert report["without"] is None
