"""The step's clipped fraction, as the trainer reports it, is a fraction of the step's tokens."""

from __future__ import annotations

import json
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
    (tmp_path / "trainer.json").write_bytes(to_json(config))
    report = tmp_path / "report.json"
    result = run_in_session(
        [
            sys.executable,
            str(ROOT / "tests" / "probes" / "policy_clipped.py"),
            str(tmp_path / "trainer.json"),
            str(report),
        ],
        env={**os.environ, "DS_ACCELERATOR": "cpu", "TOKENIZERS_PARALLELISM": "false"},
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    assert json.loads(report.read_text())["clipped_fraction"] > 0.95
