"""A small Kubernetes REST client for the kinds the operator manages, in any cluster.

The operator talks to its own cluster and, from the hub, to regions through kubeconfig
Secrets; both go through `Kube`. Writes of desired state are server-side applies owned by
one field manager, so re-applying after a crash or a lost region converges instead of
duplicating; every call has a timeout, so a region that stops answering cannot hang a
reconcile.
"""

from __future__ import annotations

import json
import threading
import time
from collections import defaultdict
from dataclasses import dataclass
from typing import Any

import kubernetes
import urllib3
from kubernetes.client import ApiClient
from kubernetes.client.exceptions import ApiException
from opentelemetry import trace

from rlfleet.api.meta import API_VERSION, ApiModel
from rlfleet.api.schema import KINDS
from rlfleet.operator import telemetry
from rlfleet.operator.status import differs

FIELD_MANAGER = "rlfleet-operator"
_tracer = trace.get_tracer("rlfleet.operator")

_PLURALS = {
    ("apps/v1", "Deployment"): "deployments",
    ("apps/v1", "StatefulSet"): "statefulsets",
    ("v1", "Pod"): "pods",
    ("v1", "Service"): "services",
    ("v1", "Secret"): "secrets",
    ("v1", "ConfigMap"): "configmaps",
    ("v1", "Namespace"): "namespaces",
    ("policy/v1", "PodDisruptionBudget"): "poddisruptionbudgets",
    ("networking.k8s.io/v1", "NetworkPolicy"): "networkpolicies",
    **{(API_VERSION, kind.kind): kind.plural for kind in KINDS},
}


class Unreachable(Exception):
    """The cluster did not answer: connection refused, timed out, or no credentials."""


# Connections kept open to one cluster: as many as calls may be in flight to it at once
# (the handlers' workers and `parallel.CALLS`). With fewer, urllib3 opens a fresh TLS
# connection for each call over the limit and throws it away afterwards.
CONNECTIONS_PER_CLUSTER = 48


def _configuration() -> kubernetes.client.Configuration:
    configuration = kubernetes.client.Configuration()
    configuration.connection_pool_maxsize = CONNECTIONS_PER_CLUSTER
    return configuration


@dataclass(frozen=True)
class Ref:
    api_version: str
    kind: str
    name: str | None = None
    namespace: str | None = None

    @classmethod
    def of(cls, manifest: dict[str, Any]) -> Ref:
        meta = manifest["metadata"]
        return cls(manifest["apiVersion"], manifest["kind"], meta["name"], meta.get("namespace"))

    def path(self, subresource: str = "") -> str:
        prefix = "/api/v1" if self.api_version == "v1" else f"/apis/{self.api_version}"
        where = f"/namespaces/{self.namespace}" if self.namespace else ""
        path = f"{prefix}{where}/{_PLURALS[(self.api_version, self.kind)]}"
        if self.name:
            path += f"/{self.name}"
        return path + (f"/{subresource}" if subresource else "")


class Kube:
    """One cluster's API server."""

    def __init__(self, client: ApiClient, cluster: str, timeout_s: float = 5.0) -> None:
        self.client = client
        self.cluster = cluster
        self.timeout_s = timeout_s
        self._recent: dict[tuple[str, str | None], tuple[float, list[dict]]] = {}
        self._fetching: defaultdict[tuple[str, str | None], threading.Lock] = defaultdict(
            threading.Lock
        )
        self._guard = threading.Lock()

    @classmethod
    def from_kubeconfig(cls, config: dict, cluster: str, timeout_s: float = 5.0) -> Kube:
        """A client for a cluster described by a kubeconfig document (a region's Secret)."""
        try:
            client = kubernetes.config.new_client_from_config_dict(
                config, persist_config=False, client_configuration=_configuration()
            )
        except (kubernetes.config.ConfigException, KeyError, TypeError, ValueError) as error:
            raise ValueError(f"not a usable kubeconfig: {error}") from error
        return cls(client, cluster, timeout_s)

    @classmethod
    def local(cls, cluster: str, timeout_s: float = 5.0) -> Kube:
        """The cluster the operator runs in: in-cluster credentials, else $KUBECONFIG."""
        configuration = _configuration()
        try:
            kubernetes.config.load_incluster_config(client_configuration=configuration)
        except kubernetes.config.ConfigException:
            kubernetes.config.load_kube_config(client_configuration=configuration)
        return cls(ApiClient(configuration), cluster, timeout_s)

    def request(
        self,
        method: str,
        path: str,
        body: Any = None,
        *,
        query: list[tuple[str, Any]] | None = None,
        content_type: str = "application/json",
    ) -> Any:
        with _tracer.start_as_current_span(
            f"kube {method}", attributes={"k8s.cluster": self.cluster, "http.path": path}
        ):
            method, url, headers, payload, _ = self.client.param_serialize(
                method=method,
                resource_path=path,
                query_params=query or [],
                header_params={"Content-Type": content_type, "Accept": "application/json"},
                body=body,
                auth_settings=["BearerToken"],
            )
            try:
                response = self.client.call_api(
                    method,
                    url,
                    header_params=headers,
                    body=payload,
                    _request_timeout=self.timeout_s,
                )
                raw = response.read()
            except (OSError, urllib3.exceptions.HTTPError) as error:
                raise Unreachable(f"{self.cluster}: {error}") from error
            if response.status in (502, 503, 504):
                raise Unreachable(f"{self.cluster}: HTTP {response.status}")
            if not 200 <= response.status < 300:
                raise ApiException(status=response.status, reason=response.reason, body=raw)
        return json.loads(raw) if raw else None

    def get(self, ref: Ref) -> dict | None:
        try:
            return self.request("GET", ref.path())
        except ApiException as error:
            if error.status == 404:
                return None
            raise

    def list(self, ref: Ref, selector: str | None = None) -> list[dict]:
        query = [("labelSelector", selector)] if selector else []
        # Items of a list carry no apiVersion and kind; put them back so they are refs too.
        return [
            {"apiVersion": ref.api_version, "kind": ref.kind} | item
            for item in self.request("GET", ref.path(), query=query)["items"]
        ]

    def list_recent(self, ref: Ref, selector: str | None, max_age_s: float) -> list[dict]:
        """A list at most `max_age_s` old, shared by every caller: the resyncs of 50 runs
        read one list of their namespace's mirrors or pods instead of 50 objects each."""
        return self.recent(ref, selector, max_age_s)[1]

    def recent(self, ref: Ref, selector: str | None, max_age_s: float) -> tuple[float, list[dict]]:
        """`list_recent`, with the `time.monotonic()` at which the list was asked for."""
        key = (ref.path(), selector)
        with self._guard:
            fetching = self._fetching[key]
        with fetching:  # one fetch at a time per list; the others wait and share it
            fetched = self._recent.get(key)
            if fetched and time.monotonic() - fetched[0] < max_age_s:
                return fetched
            asked = time.monotonic()
            self._recent[key] = (asked, self.list(ref, selector))
            return self._recent[key]

    def apply(self, manifest: dict) -> dict:
        """Server-side apply: the fields in manifest become ours; others are left alone."""
        return self.request(
            "PATCH",
            Ref.of(manifest).path(),
            manifest,
            query=[("fieldManager", FIELD_MANAGER), ("force", "true")],
            content_type="application/apply-patch+yaml",
        )

    def create(self, manifest: dict) -> bool:
        """Creates the object unless one of its name exists (which is left as it is);
        returns whether it created. Needs only the `create` verb, not `get`: the operator
        writes Secrets it may not read."""
        ref = Ref.of(manifest)
        try:
            self.request(
                "POST", Ref(ref.api_version, ref.kind, None, ref.namespace).path(), manifest
            )
        except ApiException as error:
            if error.status == 409:
                return False
            raise
        return True

    def merge_patch(self, ref: Ref, patch: dict, subresource: str = "") -> dict:
        return self.request(
            "PATCH", ref.path(subresource), patch, content_type="application/merge-patch+json"
        )

    def write_status(self, obj: dict, status: ApiModel) -> bool:
        """Merges the fields `status` was given into the object's status unless it already
        says so; returns whether it wrote. A resync that finds nothing new costs no write,
        and no watch event for every operator and controller that watches the kind. The
        conditions given go to `rlfleet_operator_condition` either way."""
        if "conditions" in status.model_fields_set:
            meta = obj["metadata"]
            telemetry.conditions(
                obj["kind"], meta.get("namespace", ""), meta["name"], status.conditions
            )
        patch = status.merge_patch()
        if not differs(obj.get("status"), patch):
            return False
        self.merge_patch(Ref.of(obj), {"status": patch}, "status")
        return True

    def scale(self, ref: Ref, replicas: int) -> bool:
        """Sets a workload's replicas; False if it was gone (deleted since it was read)."""
        try:
            self.merge_patch(ref, {"spec": {"replicas": replicas}})
        except ApiException as error:
            if error.status == 404:
                return False
            raise
        return True

    def delete(self, ref: Ref, grace_seconds: int | None = None) -> bool:
        """Deletes the object (its dependents in the background); False if it was gone."""
        body: dict[str, Any] = {"propagationPolicy": "Background"}
        if grace_seconds is not None:
            body["gracePeriodSeconds"] = grace_seconds
        try:
            self.request("DELETE", ref.path(), body)
        except ApiException as error:
            if error.status == 404:
                return False
            raise
        return True
