"""Trains two steps of the trainer's policy (`rlfleet.trainer.policy.Policy`) where some
micro-batches' losses are NaN, and writes what each step left out and did to the weights
as JSON. Their behaviour log-probs are made NaN after the wire's checks (which refuse
them), standing in for a model whose own log-probs went NaN."""

import json
import sys
from pathlib import Path


def main() -> None:
    import torch

    from rlfleet import launch
    from rlfleet.api.wire import Segment
    from rlfleet.trainer.policy import Policy
    from rlfleet.trainer.rows import make_rows

    policy = Policy(launch.TRAINER.read(Path(sys.argv[1])))
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
            "left_out": result.nonfinite_micro_batches,
            "loss": result.loss,
            "mismatch_mean_abs": result.mismatch.mean_abs,
            "finite": all(bool(torch.isfinite(t.float()).all()) for t in after.values()),
            "changed": any(not torch.equal(before[n], t) for n, t in after.items()),
        }

    report = {"some": step([rows(), rows(poisoned=True)]), "all": step([rows(True), rows(True)])}
    Path(sys.argv[2]).write_text(json.dumps(report))


if __name__ == "__main__":
    main()
