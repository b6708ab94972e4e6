"""`python -m rlfleet.trainer CONFIG.json`, or `--rlrun [SPEC]` in a pod: run this pod's
trainer ranks (`config.ranks`) until stopped or max_steps."""

import sys

import torch

from rlfleet.launch import components
from rlfleet.trainer.deepspeed_config import deepspeed_config
from rlfleet.trainer.ranks import launch as launch_ranks
from rlfleet.trainer.ranks import too_few_gpus


def main() -> None:
    config = components.component_settings(sys.argv[1:], components.TRAINER)
    try:
        deepspeed_config(config)  # a user's DeepSpeed file is refused before anything loads
    except ValueError as error:
        sys.exit(f"python -m rlfleet.trainer: {error}")
    if (why := too_few_gpus(config.ranks.procs_per_node, torch.cuda.device_count())) is not None:
        sys.exit(f"python -m rlfleet.trainer: {why}")
    launch_ranks(config)


if __name__ == "__main__":
    main()
