"""`python -m rlfleet.rollout CONFIG.json`, or `--rlrun [SPEC]` in a pod: run a rollout
worker until SIGTERM; one per engine where the pod's GPUs hold several (`layout`)."""

import asyncio
import logging
import os
import signal
import sys

import prometheus_client

from rlfleet.launch import components
from rlfleet.rollout.worker import processes
from rlfleet.rollout.worker.loop import Worker, engine_layout, start_failure

log = logging.getLogger("rlfleet.rollout")


def main() -> None:
    config = components.component_settings(sys.argv[1:], components.ROLLOUT)
    try:
        chosen = engine_layout(config)
    except (OSError, ValueError) as error:  # no model to read, or a tensor_parallel that can't be
        log.error("vLLM engine did not start: %s", start_failure(error))  # as Worker.run says it
        sys.exit(1)
    if chosen.engines > 1:
        log.info(
            "%d engines of %d workers: %s", chosen.engines, chosen.tensor_parallel, chosen.reason
        )
        sys.exit(processes.run(chosen, [sys.executable, "-m", "rlfleet.rollout", *sys.argv[1:]]))
    if processes.ENGINE in os.environ:
        config = processes.engine_config(config, int(os.environ[processes.ENGINE]))
    if config.metrics_port is not None:
        prometheus_client.start_http_server(config.metrics_port)
    worker = Worker(config, chosen)

    async def run() -> None:
        # SIGTERM stops taking tasks and finishes (and publishes) the groups under way.
        asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, worker.stopping.set)
        await worker.run()

    asyncio.run(run())


if __name__ == "__main__":
    main()
