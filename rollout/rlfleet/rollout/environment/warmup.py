"""`python -m rlfleet.rollout.environment.warmup MODEL_DIR SUITE.jsonl`: supervised warm-up
before RL.

A freshly made tiny model never answers in the harness's format, so every attempt scores
zero and GRPO has no signal. A short fine-tune on a suite's answers, written exactly as a
session would see them (the harness's own prompt and turn ending), stopped long before it
learns them, gives RL a start that answers in the right shape and is sometimes right on
most tasks. GRPO learns only from groups whose attempts disagree: a fine-tune on half the
tasks leaves the tiny model at zero on the other half, and RL then learned half as fast.
"""

from __future__ import annotations

import argparse
import random
from pathlib import Path

from rlfleet.api.wire import Task
from rlfleet.models.tiny import Example, fine_tune
from rlfleet.rollout.environment.session import END_TURN, window_text
from rlfleet.rollout.environment.tasks import load_suite, suite_path


def examples(tasks: list[Task], fraction: float, seed: int) -> list[Example]:
    """Prompt as read, answer and turn end as trained, for a `fraction` of the tasks."""
    answered = [t for t in tasks if t.answer is not None]
    chosen = random.Random(seed).sample(answered, round(len(answered) * fraction))
    return [
        [(window_text(t.prompt, tools=t.tools), False), (f"{t.answer}{END_TURN}", True)]
        for t in chosen
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", type=Path, help="checkpoint directory, changed in place")
    parser.add_argument("suite", help="a shipped suite's name (toy) or a JSON Lines path")
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--batch", type=int, default=32, help="examples per step")
    parser.add_argument("--fraction", type=float, default=1.0, help="of the tasks shown")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    chosen = examples(load_suite(suite_path(args.suite)), args.fraction, args.seed)
    batch = min(args.batch, len(chosen))
    fine_tune(args.model, chosen, steps=args.steps, lr=args.lr, batch=batch, seed=args.seed)
    print(f"warmed up {args.model} on {len(chosen)} tasks of {args.suite} in {args.steps} steps")


if __name__ == "__main__":
    main()
