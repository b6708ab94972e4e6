"""The hub's clients for region clusters, built from kubeconfig Secrets in its namespace.

A Secret that is missing or does not hold a usable kubeconfig is a `RegionCredentials`
error the run's status and events report; the operator keeps going. A client is rebuilt
when its Secret changes, so rotating credentials needs no restart; the Secret is re-read
at most every `SECRET_RECHECK_S`, not on every call (50 runs x 3 regions every resync).
"""

from __future__ import annotations

import base64
import threading
import time

import yaml

from rlfleet.operator.config import OperatorConfig
from rlfleet.operator.kube import Kube, Ref

SECRET_RECHECK_S = 10.0


class RegionCredentials(Exception):
    """The region's kubeconfig Secret is missing or unusable."""


class RegionClients:
    def __init__(self, local: Kube, config: OperatorConfig) -> None:
        self.local = local
        self.config = config
        self.access = {region.name: region for region in config.regions}
        self._clients: dict[str, tuple[str, Kube]] = {}  # region -> (Secret version, client)
        self._checked: dict[str, float] = {}  # region -> when its Secret was last read
        self._lock = threading.Lock()

    def client(self, region: str) -> Kube:
        access = self.access.get(region)
        if access is None:
            raise RegionCredentials(
                f"region {region} is not configured in the hub's values (regions[])"
            )
        with self._lock:
            cached = self._clients.get(region)
            if cached and time.monotonic() - self._checked[region] < SECRET_RECHECK_S:
                return cached[1]
        secret = self.local.get(
            Ref("v1", "Secret", access.kubeconfig_secret, self.config.namespace)
        )
        if secret is None:
            raise RegionCredentials(
                f"Secret {self.config.namespace}/{access.kubeconfig_secret} for region "
                f"{region} does not exist"
            )
        version = secret["metadata"]["resourceVersion"]
        with self._lock:
            cached = self._clients.get(region)
            if cached and cached[0] == version:
                self._checked[region] = time.monotonic()
                return cached[1]
        encoded = (secret.get("data") or {}).get(access.kubeconfig_key)
        if not encoded:
            raise RegionCredentials(
                f"Secret {access.kubeconfig_secret} has no key {access.kubeconfig_key!r}"
            )
        try:
            document = yaml.safe_load(base64.b64decode(encoded))
            if not isinstance(document, dict):
                raise ValueError("not a kubeconfig document")
            kube = Kube.from_kubeconfig(document, region, self.config.call_timeout_seconds)
        except (ValueError, yaml.YAMLError) as error:
            raise RegionCredentials(
                f"Secret {access.kubeconfig_secret} for region {region}: {error}"
            ) from error
        with self._lock:
            self._clients[region] = (version, kube)
            self._checked[region] = time.monotonic()
        return kube
