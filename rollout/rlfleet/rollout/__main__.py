"""`python -m rlfleet.rollout CONFIG.json`, or `--rlrun [SPEC]` in a pod: run a rollout
worker until SIGTERM."""

import asyncio
import logging
import signal
import sys

import prometheus_client

from rlfleet import launch
from rlfleet.rollout.worker import Worker


def main() -> None:
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    config = launch.component_settings(sys.argv[1:], launch.ROLLOUT)
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
