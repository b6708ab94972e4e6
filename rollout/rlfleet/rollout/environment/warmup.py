"""`python -m rlfleet.rollout.environment.warmup MODEL_DIR SUITE.jsonl`: supervised warm-up
before RL.

A freshly made tiny model never answers in the harness's format, so every attempt scores
zero and GRPO has no signal. A short fine-tune on a suite's answers, written exactly as a
session would see them (the harness's own prompt and turn ending), stopped long before it
learns them, gives RL a start that answers in the right shape and is sometimes right on
most tasks. GRPO learns only from groups whose attempts disagree: a fine-tune on half the
tasks leaves the tiny model at zero on the other half, and RL then learned half as fast.

A run in an environment of its own (`--environment`) is warmed up on the conversations
that environment demonstrates (`Harness.demonstrations`), rendered with the model's own
chat template and tools, the assistant's turns trained: the format its harness speaks.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

from transformers import AutoTokenizer

from rlfleet.api.wire import Task
from rlfleet.launch.settings import EnvironmentConfig
from rlfleet.models.tiny import Example, fine_tune
from rlfleet.rollout.environment import plugins
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


def rendered(tokenizer, messages: list[dict], tools: list[dict] | None) -> Example:
    """A conversation as the chat template renders it, each assistant turn (up to its end
    of turn) trained and everything else shown."""
    pieces: Example = []
    done = ""
    for index, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        opening = _render(tokenizer, messages[:index], tools, prompt=True)
        whole = _render(tokenizer, messages[: index + 1], tools, prompt=False)
        turn = whole[len(opening) :].rstrip("\n")
        if not (opening.startswith(done) and whole.startswith(opening)):
            raise ValueError("the chat template does not render the conversation as a prefix")
        pieces += [(opening[len(done) :], False), (turn, True)]
        done = opening + turn
    return pieces


def _render(tokenizer, messages: list[dict], tools: list[dict] | None, *, prompt: bool) -> str:
    return tokenizer.apply_chat_template(
        messages, tools=tools, add_generation_prompt=prompt, tokenize=False
    )


def demonstrated(model: Path, environment: EnvironmentConfig) -> list[Example] | None:
    """The environment's demonstrations as examples; None if it gives none."""
    shown = getattr(plugins.load(environment), "demonstrations", lambda: None)()
    if shown is None:
        return None
    tokenizer = AutoTokenizer.from_pretrained(model)
    return [rendered(tokenizer, messages, tools) for messages, tools in shown]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", type=Path, help="checkpoint directory, changed in place")
    parser.add_argument("suite", help="a shipped suite's name (toy) or a JSON Lines path")
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--batch", type=int, default=32, help="examples per step")
    parser.add_argument("--fraction", type=float, default=1.0, help="of the tasks shown")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--environment", help="the run's environment, by name")
    parser.add_argument("--settings", default="{}", help="its settings, as JSON")
    args = parser.parse_args()
    environment = EnvironmentConfig(name=args.environment, settings=json.loads(args.settings))
    chosen = demonstrated(args.model, environment) if args.environment else None
    if chosen is None:
        chosen = examples(load_suite(suite_path(args.suite)), args.fraction, args.seed)
    batch = min(args.batch, len(chosen))
    fine_tune(args.model, chosen, steps=args.steps, lr=args.lr, batch=batch, seed=args.seed)
    source = args.environment if args.environment else args.suite
    print(f"warmed up {args.model} on {len(chosen)} examples of {source} in {args.steps} steps")


if __name__ == "__main__":
    main()
