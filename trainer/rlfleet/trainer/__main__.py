"""`python -m rlfleet.trainer CONFIG.json`: run the trainer until stopped or max_steps."""

import asyncio
import logging
import signal
import sys
from pathlib import Path

from rlfleet.trainer.config import load
from rlfleet.trainer.loop import Trainer


def main() -> None:
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    if len(sys.argv) != 2:
        sys.exit("usage: python -m rlfleet.trainer CONFIG.json")
    trainer = Trainer(load(Path(sys.argv[1])))

    async def run() -> None:
        # SIGTERM finishes the step under way (checkpoint, publish, ack) and exits.
        asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, trainer.stopping.set)
        await trainer.run()

    asyncio.run(run())


if __name__ == "__main__":
    main()
