"""`python -m rlfleet.operator CONFIG.yaml`: the operator, in the role its config names.

In a cluster it uses its ServiceAccount; outside one, $KUBECONFIG (tests and local mode).
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import kopf

from rlfleet.operator import telemetry
from rlfleet.operator.config import load
from rlfleet.operator.handlers import registry, settings
from rlfleet.operator.kube import Kube


def main() -> None:
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    if len(sys.argv) != 2:
        sys.exit("usage: python -m rlfleet.operator CONFIG.yaml")
    config = load(Path(sys.argv[1]))
    telemetry.start(config.role, config.cluster, config.metrics_port)
    local = Kube.local(config.cluster, config.call_timeout_seconds)
    liveness = f"http://0.0.0.0:{config.health_port}/healthz" if config.health_port else None
    kopf.run(
        registry=registry(config, local),
        settings=settings(config),
        standalone=True,  # one replica; no peering objects to create or watch
        clusterwide=not config.watch_namespaces,
        namespaces=config.watch_namespaces,
        liveness_endpoint=liveness,
    )


if __name__ == "__main__":
    main()
