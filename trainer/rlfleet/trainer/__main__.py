"""`python -m rlfleet.trainer CONFIG.json`, or `--rlrun [SPEC]` in a pod: run the trainer
until stopped or max_steps."""

import asyncio
import logging
import signal
import sys

from rlfleet import launch
from rlfleet.trainer.loop import Trainer


def main() -> None:
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    config = launch.component_settings(sys.argv[1:], launch.TRAINER)
    trainer = Trainer(config)

    async def run() -> None:
        # SIGTERM finishes the step under way (checkpoint, publish, ack) and exits.
        asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, trainer.stopping.set)
        await trainer.run()

    asyncio.run(run())


if __name__ == "__main__":
    main()
