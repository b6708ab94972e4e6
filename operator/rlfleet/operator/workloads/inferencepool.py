"""What the region operator adds to a production InferencePool: its canary set and its
feedback Secret, both owned by the pool (pure).

The serving Deployment itself is the user's; the operator only scales it. The canary set
is a copy of its pods told to serve the canary version, and the feedback Secret holds the
key the pool's servers sign feedback tokens with.
"""

from __future__ import annotations

import copy

from rlfleet.api.inferencepool import (
    CANARY,
    FEEDBACK_KEY_FILE,
    REPLICA_SET_LABEL,
    USER_HEADER_FILE,
    InferencePoolSpec,
    feedback_secret,
)
from rlfleet.api.meta import COMPONENT_LABEL
from rlfleet.launch import pods
from rlfleet.operator.workloads.common import POOL_LABEL, object_meta, secret_data


def canary_name(deployment: str) -> str:
    return f"{deployment}-canary"


def canary_deployment(pool: dict, serving: dict, replicas: int) -> dict:
    """A pool's canary set (`lending.canary_set`): the serving Deployment's own pods, told
    to serve the canary set's version and labelled so, owned by the pool. Its pods still
    match the serving selector: a Service sends them their share of the requests, and the
    operator counts them as serving (they are never lent)."""
    spec = InferencePoolSpec.model_validate(pool["spec"])
    template = copy.deepcopy(serving["spec"]["template"])
    template["metadata"]["labels"] = template["metadata"].get("labels", {}) | {
        REPLICA_SET_LABEL: CANARY
    }
    for container in template["spec"]["containers"]:
        env = [e for e in container.get("env", []) if e["name"] != pods.REPLICA_SET_ENV]
        container["env"] = [*env, {"name": pods.REPLICA_SET_ENV, "value": CANARY}]
    selector = copy.deepcopy(serving["spec"]["selector"])
    selector["matchLabels"] = selector.get("matchLabels", {}) | {REPLICA_SET_LABEL: CANARY}
    labels = {POOL_LABEL: pool["metadata"]["name"], COMPONENT_LABEL: CANARY}
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": object_meta(pool, canary_name(spec.serving.deployment_name), labels),
        "spec": {
            "replicas": replicas,
            "selector": selector,
            "template": template,
        },
    }


def pool_feedback(pool: dict, key: str) -> dict:
    """A pool's feedback Secret, owned by the pool: the `key` its servers sign feedback
    tokens with and the header its gateway names users in. Its serving pods mount it (the
    canary set's, copied from them, too) where `RLFLEET_FEEDBACK_DIR` says."""
    spec = InferencePoolSpec.model_validate(pool["spec"])
    name = pool["metadata"]["name"]
    values = {FEEDBACK_KEY_FILE: key, USER_HEADER_FILE: spec.serving.user_header}
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": object_meta(pool, feedback_secret(name), {POOL_LABEL: name}),
        "type": "Opaque",
        "data": secret_data(values),
    }
