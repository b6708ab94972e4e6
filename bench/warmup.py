"""Benchmark: where the supervised warm-up leaves the tiny MoE for RL, in about 4 minutes.

The same fresh model is warmed up on the rules suite for several step counts (`--steps`;
by default fewer, `rlfleet run`'s and more). Each is then sampled like a rollout group
(8 attempts per task at temperature 1, the session's own prompt and turn ending, Hugging
Face generate) and graded by exact answer. `reward` is where RL starts; `pass_at_8` the
share of tasks some attempt gets right. RL on a tiny model mostly turns "sometimes right"
into "right", so `headroom` (their difference) bounds what a ten-minute run gains, and
`mixed_groups` (groups whose attempts disagree) is what GRPO learns from. A quick way to
try warm-up settings before a ten-minute `make demo`. Prints one JSON object.
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
from rlfleet.local import plan
from rlfleet.models.tiny import init_model
from rlfleet.rollout.session import END_TURN, window_text
from rlfleet.rollout.tasks import load_suite, suite_path

GROUP = 8


def sampled(directory: Path, tasks: list[Task], max_tokens: int = 24) -> dict[str, float]:
    """Reward, pass@8 and the share of mixed groups, sampling `GROUP` attempts per task."""
    tokenizer = AutoTokenizer.from_pretrained(directory)
    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    end = tokenizer.convert_tokens_to_ids(END_TURN)
    torch.manual_seed(0)
    right_per_task = []
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
        right_per_task.append(
            sum(" ".join(t.split(END_TURN)[0].split()) == task.answer for t in texts)
        )
    reward = sum(right_per_task) / (GROUP * len(tasks))
    solved = sum(r > 0 for r in right_per_task) / len(tasks)
    return {
        "reward": round(reward, 4),
        "pass_at_8": round(solved, 4),
        "headroom": round(solved - reward, 4),
        "mixed_groups": round(sum(0 < r < GROUP for r in right_per_task) / len(tasks), 4),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--suite", default="rules")
    default = plan.Tuning.warmup_steps
    parser.add_argument("--steps", type=int, nargs="+", default=[160, default, 280])
    args = parser.parse_args()
    tasks = load_suite(suite_path(args.suite))
    result: dict = {"suite": args.suite, "default_steps": default}
    with tempfile.TemporaryDirectory(prefix="rlfleet-bench-warmup-") as tmp:
        fresh = init_model("tiny-moe", Path(tmp) / "fresh")
        for steps in args.steps:
            model = Path(tmp) / str(steps)
            shutil.copytree(fresh, model)
            subprocess.run(
                [
                    *(sys.executable, "-m", "rlfleet.rollout.warmup", str(model), args.suite),
                    *("--steps", str(steps)),
                ],
                check=True,
                stdout=subprocess.DEVNULL,
            )
            result[f"steps_{steps}"] = sampled(model, tasks)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
