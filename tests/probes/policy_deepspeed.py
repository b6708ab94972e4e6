"""Builds the trainer's policy (`rlfleet.trainer.policy.Policy`) from a settings file and
writes, as JSON, what its DeepSpeed engine was configured with."""

import json
import sys
from pathlib import Path


def main() -> None:
    from rlfleet.launch import components
    from rlfleet.trainer.policy import Policy

    engine = Policy(components.TRAINER.read(Path(sys.argv[1]))).engine
    Path(sys.argv[2]).write_text(
        json.dumps(
            {
                "zero_stage": engine.zero_optimization_stage(),
                "reduce_bucket_size": engine.zero_reduce_bucket_size(),
                "gradient_clipping": engine.gradient_clipping(),
            }
        )
    )


if __name__ == "__main__":
    main()
