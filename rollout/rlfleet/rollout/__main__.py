"""`python -m rlfleet.rollout CONFIG.json`: run a rollout worker until SIGTERM."""

import asyncio
import logging
import signal
import sys
from pathlib import Path

import prometheus_client

from rlfleet.rollout.config import load
from rlfleet.rollout.worker import Worker


def main() -> None:
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    if len(sys.argv) != 2:
        sys.exit("usage: python -m rlfleet.rollout CONFIG.json")
    config = load(Path(sys.argv[1]).read_bytes())
    if config.metrics_port is not None:
        prometheus_client.start_http_server(config.metrics_port)
    worker = Worker(config)

    async def run() -> None:
        # SIGTERM stops taking tasks and finishes (and publishes) the groups under way.
        asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, worker.stopping.set)
        await worker.run()

    asyncio.run(run())


if __name__ == "__main__":
    main()
