"""`python -m rlfleet.trainer CONFIG.json`, or `--rlrun [SPEC]` in a pod: run the trainer
until stopped or max_steps."""

import asyncio
import logging
import signal
import sys

from rlfleet import launch
from rlfleet.trainer.deepspeed_config import deepspeed_config
from rlfleet.trainer.loop import Trainer


def main() -> None:
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    config = launch.component_settings(sys.argv[1:], launch.TRAINER)
    try:
        deepspeed_config(config)  # a user's DeepSpeed file is refused before anything loads
    except ValueError as error:
        sys.exit(f"python -m rlfleet.trainer: {error}")
    trainer = Trainer(config)

    async def run() -> None:
        # SIGTERM finishes the step under way (checkpoint, publish, ack) and exits.
        asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, trainer.stopping.set)
        await trainer.run()

    asyncio.run(run())


if __name__ == "__main__":
    main()
