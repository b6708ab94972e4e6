"""How good a policy is on a whole suite: every task attempted alike, graded as rollouts are.

A run's batch reward is what its rollouts earned on the tasks the feed chose. With the
curriculum those are mostly the tasks still being learnt, so the batch reward says little
about the suite. An evaluation samples every task of an exact-answer suite `attempts`
times at temperature 1, the policy's own distribution whatever temperature the run's
rollouts explore at, and reports the mean reward, the share
of tasks some attempt gets right (pass@k: what RL can still turn into reward) and the
share of groups that disagree (what GRPO learns from). The weights are a version read
off the run's weight stream, as a rollout worker reads them. Generation is Hugging Face
`generate` on the host: fine for the tiny models of a local run, not for production sizes.
Tasks go to it a batch at a time, their prompts left-padded: faster than one task at a
time, and greedy answers are the same either way. A production run's gate waits on this,
for every candidate.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import msgspec
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from rlfleet.api.wire import AnswerStats, Task
from rlfleet.bus import connection
from rlfleet.rollout.environment.rewards import matches
from rlfleet.rollout.environment.session import END_TURN, window_text
from rlfleet.rollout.environment.tasks import load_suite, suite_path
from rlfleet.weightsync import Receiver, SyncConfig, WeightState, WeightStream, write_checkpoint

# Sequences (tasks x attempts) per `generate` call: memory grows with it, and past about
# 400 the batches stop getting cheaper per sequence.
SEQUENCES_PER_BATCH = 400


@dataclass(frozen=True)
class Evaluation:
    version: int  # the policy version evaluated; 0 is the model the run started from
    reward: float
    pass_at_k: float
    mixed_groups: float
    attempts: int  # per task: the k of pass@k
    tasks: int
    task_rewards: dict[str, float]  # each task's share of right attempts, by id
    answers: AnswerStats

    def record(self) -> dict:
        """As JSON takes it."""
        return asdict(self) | {"answers": msgspec.to_builtins(self.answers)}

    def write(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.record(), indent=2) + "\n")


def evaluable(tasks: list[Task]) -> bool:
    """Bare questions with exact answers: what the host can grade without sandboxes."""
    return all(task.answer is not None and not task.tools for task in tasks)


def evaluate(
    model: Path,
    tasks: list[Task],
    weights: Mapping[str, torch.Tensor] | None = None,
    *,
    version: int = 0,
    attempts: int = 8,
    max_tokens: int = 24,  # a rollout turn's budget in `rlfleet run`
    seed: int = 0,
) -> Evaluation:
    """`model`'s folder with `weights` (a published version) in place of its own."""
    if not evaluable(tasks):
        raise ValueError("only bare exact-answer tasks can be evaluated here")
    tokenizer, policy = _policy(model, weights)
    torch.manual_seed(seed)
    right_per_task, empty, generated = [], 0, 0
    per_batch = max(1, SEQUENCES_PER_BATCH // attempts)
    for first in range(0, len(tasks), per_batch):
        batch = tasks[first : first + per_batch]
        right, batch_empty, batch_tokens = _attempt(tokenizer, policy, batch, attempts, max_tokens)
        right_per_task += right
        empty += batch_empty
        generated += batch_tokens
    count = len(tasks)
    return Evaluation(
        version=version,
        reward=round(sum(right_per_task) / (attempts * count), 4),
        pass_at_k=round(sum(r > 0 for r in right_per_task) / count, 4),
        mixed_groups=round(sum(0 < r < attempts for r in right_per_task) / count, 4),
        attempts=attempts,
        tasks=count,
        task_rewards={
            task.id: right / attempts for task, right in zip(tasks, right_per_task, strict=True)
        },
        answers=AnswerStats(answers=attempts * count, empty=empty, tokens=generated),
    )


def _policy(model: Path, weights: Mapping[str, torch.Tensor] | None) -> tuple[Any, Any]:
    """The tokenizer, padding on the left, and the model with `weights` in place."""
    tokenizer = AutoTokenizer.from_pretrained(model)
    tokenizer.padding_side = "left"  # every prompt ends where its answer begins
    tokenizer.pad_token = tokenizer.pad_token or END_TURN  # masked out: any token will do
    with tempfile.TemporaryDirectory(prefix="rlfleet-evaluation-") as tmp:
        if weights is not None:
            write_checkpoint(weights, model, Path(tmp))
            model = Path(tmp)
        policy = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    return tokenizer, policy


def _attempt(
    tokenizer: Any, policy: Any, batch: list[Task], attempts: int, max_tokens: int
) -> tuple[list[int], int, int]:
    """One `generate` call over a batch of tasks, `attempts` each: the right attempts of
    each task, the empty answers, and the tokens generated."""
    end = tokenizer.convert_tokens_to_ids(END_TURN)
    prompts = [window_text(task.prompt, tools=False) for task in batch]
    encoded = tokenizer(prompts, return_tensors="pt", add_special_tokens=False, padding=True)
    with torch.no_grad():
        out = policy.generate(
            encoded.input_ids.repeat_interleave(attempts, 0),
            attention_mask=encoded.attention_mask.repeat_interleave(attempts, 0),
            do_sample=True,
            temperature=1.0,
            top_k=0,
            max_new_tokens=max_tokens,
            eos_token_id=end,
            pad_token_id=end,
        )
    new_tokens = out[:, encoded.input_ids.shape[1] :]
    answers = [t.split(END_TURN)[0] for t in tokenizer.batch_decode(new_tokens)]
    right = []
    for index, task in enumerate(batch):
        assert task.answer is not None
        own = answers[index * attempts : (index + 1) * attempts]
        right.append(sum(matches(answer, task.answer) for answer in own))
    empty = sum(not answer.strip() for answer in answers)
    # Tokens up to and with the end of the turn (padding after it is the same token).
    ended = new_tokens == end
    generated = int(torch.where(ended.any(1), ended.int().argmax(1) + 1, ended.shape[1]).sum())
    return right, empty, generated


async def published_weights(
    url: str, run: str, config: SyncConfig, domain: str | None = None
) -> WeightState:
    """The newest version of `run`'s weights on the stream, verified."""
    nc = await connection.connect(url)
    try:
        receiver = Receiver(WeightStream(nc, run, config, domain))
        await receiver.sync()
        return receiver.state
    finally:
        await nc.close()


def main() -> None:
    parser = argparse.ArgumentParser(
        prog="python -m rlfleet.rollout.evaluation.suite", description=__doc__.splitlines()[0]
    )
    parser.add_argument("model", type=Path, help="the run's model folder (its starting weights)")
    parser.add_argument("suite", help="a shipped suite's name, or a path to a JSON Lines file")
    parser.add_argument("out", type=Path, help="where the evaluation's JSON goes")
    parser.add_argument("--run", help="evaluate the newest version this run published")
    parser.add_argument("--nats-url", help="where the run's weight stream is (with --run)")
    parser.add_argument("--domain", help="the stream's JetStream domain (with --run)")
    parser.add_argument("--attempts", type=int, default=8)
    args = parser.parse_args()
    tasks = load_suite(suite_path(args.suite))
    if not evaluable(tasks):
        sys.exit(f"suite {args.suite}: only bare exact-answer tasks can be evaluated here")
    weights, version = None, 0
    if args.run:
        if not args.nats_url:
            parser.error("--run needs --nats-url")
        state = asyncio.run(published_weights(args.nats_url, args.run, SyncConfig(), args.domain))
        if state.version is None:
            sys.exit(f"run {args.run} has published no weights")
        weights, version = state.tensors, state.version
    found = evaluate(args.model, tasks, weights, version=version, attempts=args.attempts)
    found.write(args.out)
    print(json.dumps(found.record()))


if __name__ == "__main__":
    main()
