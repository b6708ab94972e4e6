"""Engines run in processes of their own (vLLM and DeepSpeed each own global state): a
probe script in `probes/` is run on a checkpoint and its JSON read back."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from rlfleet.local.processes import run_in_session

ENGINE_ENV = {
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "DS_ACCELERATOR": "cpu",
    "TOKENIZERS_PARALLELISM": "false",
}


def run_probe(script: str, checkpoint: Path, tmp_path: Path) -> dict:
    """Runs `probes/SCRIPT CHECKPOINT OUT_JSON` and returns what it wrote."""
    report = tmp_path / f"{script}.json"
    result = run_in_session(
        [
            sys.executable,
            str(Path(__file__).parent / "probes" / script),
            str(checkpoint),
            str(report),
        ],
        env={**os.environ, **ENGINE_ENV},
        timeout=900,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    return json.loads(report.read_text())
