"""Benchmark: where the supervised warm-up leaves the tiny MoE for RL, in about 4 minutes.

The same fresh model is warmed up twice with `rlfleet run`'s default steps: on half of
the rules suite (the old default) and on all of it (the default now). Each is then
sampled like a rollout group (8 attempts per task at temperature 1, the session's own
prompt and turn ending, Hugging Face generate) and graded by exact answer. GRPO learns
only from groups whose attempts disagree, so `*_mixed_groups` (their share) is what RL
has to work with; `*_reward` is the starting reward. A quick way to try warm-up settings
before a ten-minute `make demo`. Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from rlfleet.api.wire import Task
from rlfleet.models.tiny import init_model
from rlfleet.rollout.session import END_TURN, window_text
from rlfleet.rollout.tasks import load_suite, suite_path

GROUP = 8


def sampled(directory: Path, tasks: list[Task], max_tokens: int = 24) -> tuple[float, float]:
    """The mean reward and the share of groups that disagree, sampling `GROUP` per task."""
    tokenizer = AutoTokenizer.from_pretrained(directory)
    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    end = tokenizer.convert_tokens_to_ids(END_TURN)
    torch.manual_seed(0)
    rewards, mixed = [], 0
    for task in tasks:
        prompt = window_text(task.prompt, tools=task.tools)
        ids = tokenizer(prompt, return_tensors="pt", add_special_tokens=False).input_ids
        with torch.no_grad():
            out = model.generate(
                ids.repeat(GROUP, 1),
                attention_mask=torch.ones_like(ids).repeat(GROUP, 1),
                do_sample=True,
                temperature=1.0,
                top_k=0,
                max_new_tokens=max_tokens,
                eos_token_id=end,
                pad_token_id=end,
            )
        texts = tokenizer.batch_decode(out[:, ids.shape[1] :])
        right = [" ".join(t.split(END_TURN)[0].split()) == task.answer for t in texts]
        rewards += right
        mixed += 0 < sum(right) < GROUP
    return sum(rewards) / len(rewards), mixed / len(tasks)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--suite", default="rules")
    parser.add_argument("--steps", type=int, default=160, help="rlfleet run's default")
    args = parser.parse_args()
    tasks = load_suite(suite_path(args.suite))
    result: dict[str, float | int | str] = {"suite": args.suite, "warmup_steps": args.steps}
    with tempfile.TemporaryDirectory(prefix="rlfleet-bench-warmup-") as tmp:
        fresh = init_model("tiny-moe", Path(tmp) / "fresh")
        for name, fraction in (("half", 0.5), ("all", 1.0)):
            model = Path(tmp) / name
            shutil.copytree(fresh, model)
            warmup = ["--steps", str(args.steps), "--fraction", str(fraction)]
            subprocess.run(
                [sys.executable, "-m", "rlfleet.rollout.warmup", str(model), args.suite, *warmup],
                check=True,
                stdout=subprocess.DEVNULL,
            )
            reward, mixed = sampled(model, tasks)
            result |= {f"{name}_reward": round(reward, 4), f"{name}_mixed_groups": round(mixed, 4)}
    result["mixed_groups_ratio"] = round(
        float(result["all_mixed_groups"]) / max(float(result["half_mixed_groups"]), 1e-9), 2
    )
    print(json.dumps(result))


if __name__ == "__main__":
    main()
