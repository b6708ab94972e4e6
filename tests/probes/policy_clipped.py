"""Trains one step of the trainer's policy (`rlfleet.trainer.policy.Policy`) on two
micro-batches with two updates per step, and writes the step's result as JSON."""

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

    def rows():
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
        return make_rows(segments, [1.0, -1.0], pad_id=0)

    micro_batches = [rows(), rows()]
    result = policy.train_step(micro_batches, sum(r.tokens for r in micro_batches))
    Path(sys.argv[2]).write_text(json.dumps({"clipped_fraction": result.clipped_fraction}))


if __name__ == "__main__":
    main()
