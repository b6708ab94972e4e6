"""Tiny models made locally run in the real engines: vLLM (CPU) and DeepSpeed (CPU accelerator)."""

from __future__ import annotations

import json
import math
from pathlib import Path

from probe_runs import run_probe


def test_checkpoint_is_a_qwen3_moe_in_hugging_face_format(tiny_moe: Path) -> None:
    config = json.loads((tiny_moe / "config.json").read_text())
    assert config["architectures"] == ["Qwen3MoeForCausalLM"]
    assert (
        config["num_local_experts"],
        config["num_experts_per_tok"],
        config["num_hidden_layers"],
    ) == (
        8,
        2,
        2,
    )
    assert config["head_dim"] == 32
    assert {"model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= {
        p.name for p in tiny_moe.iterdir()
    }


def test_vllm_generates_with_logprobs(vllm_probe: dict) -> None:
    out = vllm_probe["generated"]
    assert len(out["token_ids"]) == out["max_tokens"]
    assert len(out["logprobs"]) == len(out["token_ids"])
    assert all(math.isfinite(lp) and lp <= 0.0 for lp in out["logprobs"])


def test_deepspeed_takes_a_training_step(tiny_moe: Path, tmp_path: Path) -> None:
    out = run_probe("deepspeed_step.py", tiny_moe, tmp_path)
    assert out["accelerator"] == "cpu"
    assert math.isfinite(out["loss_before"]) and math.isfinite(out["loss_after"])
    assert out["changed_parameters"] > 0
    assert out["global_steps"] == 1


def test_seeded_prompts_beyond_a_steps_budget_all_complete(vllm_probe: dict) -> None:
    """A step that runs part of a seeded request's prompt makes vLLM rewind that request's
    generator, which torch's CPU generator cannot do, and the engine dies: the rollout
    engine's options never split a prompt on CPU."""
    out = vllm_probe["seeded_batch"]
    assert out["prompt_tokens"] > out["step_tokens"]
    assert out["completed"] == out["requests"]
