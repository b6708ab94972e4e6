"""The operators' Kubernetes client against a real API server: what a reconcile relies on
when the objects it read a moment ago have changed since."""

from __future__ import annotations

import uuid

import yaml

from rlfleet.operator.kube import Kube, Ref
from rlfleet.testbed.bed import BedInfo


def test_scaling_a_workload_deleted_since_it_was_read_says_so_and_raises_nothing(
    bed: BedInfo,
) -> None:
    kube = Kube.from_kubeconfig(yaml.safe_load(bed.kubeconfigs["hub"].read_text()), "hub")
    labels = {"app": f"scaled-{uuid.uuid4().hex[:6]}"}
    deployment = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": labels["app"], "namespace": "default"},
        "spec": {
            "replicas": 0,
            "selector": {"matchLabels": labels},
            "template": {
                "metadata": {"labels": labels},
                "spec": {"containers": [{"name": "main", "image": "busybox"}]},
            },
        },
    }
    ref = Ref.of(kube.apply(deployment))
    assert kube.scale(ref, 2)
    assert kube.get(ref)["spec"]["replicas"] == 2
    # A run's rollout Deployment goes with its mirror between a pool's list and its patch.
    assert kube.delete(ref)
    assert not kube.scale(ref, 0)
    assert kube.get(ref) is None
