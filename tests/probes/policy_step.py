"""Trains steps of the trainer's policy (`rlfleet.trainer.policy.Policy`) on made-up
micro-batches and writes what they did as JSON. `policy_step.py CONFIG REPORT KIND`:
- `clipped`: one step on two micro-batches (with the config's updates per step), its
  clipped fraction;
- `nonfinite`: a step where one of two micro-batches' loss is NaN, then one where both
  are, each with what it left out and did to the weights. The behaviour log-probs are
  made NaN after the wire's checks (which refuse them), standing in for a model whose
  own log-probs went NaN;
- `held_out` and `held_out_inverted`: users prefer answers of one token to answers of
  another; one step on such answers, rewarded as users said (or the opposite), scored on
  other prompts' answers it did not train on: its held-out gain, and that of a step
  with none held out."""

import json
import sys
from pathlib import Path


def main() -> None:
    import torch

    from rlfleet.api.wire import Segment
    from rlfleet.launch import components
    from rlfleet.trainer.policy import Policy
    from rlfleet.trainer.rows import make_rows

    policy = Policy(components.TRAINER.read(Path(sys.argv[1])))
    gen = torch.Generator().manual_seed(0)

    def rows(poisoned: bool = False):
        segments = [
            Segment(
                tokens=torch.randint(0, 256, (24,), generator=gen).tolist(),
                prompt_len=4,
                generated=[1] * 20,
                logprobs=[-1.0] * 20,
                versions=[0] * 20,
            )
            for _ in range(2)
        ]
        made = make_rows(segments, [1.0, -1.0], pad_id=0)
        if poisoned:
            made.behaviour.fill_(float("nan"))
        return made

    def step(micro_batches) -> dict:
        before = {name: t.clone() for name, t in policy.weights().items()}
        result = policy.train_step(micro_batches, sum(r.tokens for r in micro_batches))
        after = policy.weights()
        return {
            "clipped_fraction": result.clipped_fraction,
            "left_out": result.nonfinite_micro_batches,
            "loss": result.loss,
            "mismatch_mean_abs": result.mismatch.mean_abs,
            "finite": all(bool(torch.isfinite(t.float()).all()) for t in after.values()),
            "changed": any(not torch.equal(before[n], t) for n, t in after.items()),
        }

    def preferred(sign: float):
        """Answers of token 7, rewarded `sign`, beside answers of token 9, the opposite."""
        segments, advantages = [], []
        for answer, advantage in ((7, sign), (9, -sign)):
            for _ in range(4):
                prompt = torch.randint(10, 256, (4,), generator=gen).tolist()
                segments.append(
                    Segment(
                        tokens=prompt + [answer] * 12,
                        prompt_len=4,
                        generated=[1] * 12,
                        logprobs=[-1.0] * 12,
                        versions=[0] * 12,
                    )
                )
                advantages.append(advantage)
        return make_rows(segments, advantages, pad_id=0)

    if sys.argv[3] == "clipped":
        report = step([rows(), rows()])
    elif sys.argv[3].startswith("held_out"):
        sign = -1.0 if sys.argv[3].endswith("inverted") else 1.0
        train = [preferred(sign), preferred(sign)]
        tokens = sum(r.tokens for r in train)
        report = {
            "gain": policy.train_step(train, tokens, [preferred(1.0)]).held_out_gain,
            "without": policy.train_step(train, tokens).held_out_gain,
        }
    else:
        some = step([rows(), rows(poisoned=True)])
        report = {"some": some, "all": step([rows(poisoned=True), rows(poisoned=True)])}
    Path(sys.argv[2]).write_text(json.dumps(report))


if __name__ == "__main__":
    main()
