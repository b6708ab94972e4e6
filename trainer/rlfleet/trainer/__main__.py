"""`python -m rlfleet.trainer CONFIG.json`, or `--rlrun [SPEC]` in a pod: run this pod's
trainer ranks (`config.ranks`) until stopped or max_steps."""

import logging
import sys

from rlfleet import launch
from rlfleet.trainer.deepspeed_config import deepspeed_config
from rlfleet.trainer.ranks import launch as launch_ranks


def main() -> None:
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    config = launch.component_settings(sys.argv[1:], launch.TRAINER)
    try:
        deepspeed_config(config)  # a user's DeepSpeed file is refused before anything loads
    except ValueError as error:
        sys.exit(f"python -m rlfleet.trainer: {error}")
    launch_ranks(config)


if __name__ == "__main__":
    main()
