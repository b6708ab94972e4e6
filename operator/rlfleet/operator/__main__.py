"""`python -m rlfleet.operator CONFIG.yaml`: the operator, in the role its config names.

In a cluster it uses its ServiceAccount; outside one, $KUBECONFIG (tests and local mode).
"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

import kopf

from rlfleet.operator import telemetry
from rlfleet.operator.config import load
from rlfleet.operator.handlers import registry, settings
from rlfleet.operator.kube import Kube


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m rlfleet.operator", description=__doc__)
    parser.add_argument("config", type=Path, help="the operator's config (the chart's ConfigMap)")
    args = parser.parse_args()
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    config = load(args.config)
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
