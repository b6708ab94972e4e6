"""Reading which RBAC grants the operators used (`rlfleet.testbed.rbac`): the chart's grants
as `helm template` renders them, and the audit log lines that use them. The bed's own
audit logs are read at the end of every session (conftest's summary)."""

from __future__ import annotations

import json

from rlfleet.testbed.rbac import Grant, chart_grants, chart_rbac, unused_grants, used_grants

OPERATOR = "system:serviceaccount:rlfleet-system:rlfleet-operator"


def line(user: str, verb: str, code: int = 200, **ref: str) -> str:
    return json.dumps(
        {
            "user": {"username": user},
            "verb": verb,
            "objectRef": ref,
            "responseStatus": {"code": code},
        }
    )


def test_allowed_requests_of_the_releases_accounts_use_their_grants() -> None:
    lines = [
        line(OPERATOR, "patch", apiGroup="rlfleet.io", resource="rlruns", subresource="status"),
        line(OPERATOR, "get", 404, resource="secrets", name="envpool-key"),  # allowed, absent
        line(OPERATOR, "delete", 403, apiGroup="apps", resource="deployments"),  # refused
        line("kubernetes-admin", "list", resource="pods"),  # not the operator's
        line("system:serviceaccount:other:rlfleet-operator", "list", resource="pods"),
        line(OPERATOR, "patch", 201, apiGroup="apps", resource="deployments"),  # applied new
    ]
    assert used_grants(lines) == {
        Grant("rlfleet-operator", "apps", "deployments", "patch"),
        Grant("rlfleet-operator", "apps", "deployments", "create"),
        Grant("rlfleet-operator", "rlfleet.io", "rlruns/status", "patch"),
        Grant("rlfleet-operator", "", "secrets", "get"),
        Grant("rlfleet-operator", "", "secrets", "get", "envpool-key"),
    }


def test_the_chart_grants_each_role_its_rules_and_an_unused_one_is_named() -> None:
    hub, region = chart_grants("hub"), chart_grants("region")
    status = Grant("rlfleet-operator", "rlfleet.io", "rlruns/status", "patch")
    assert status in hub and status in region
    # The hub's identity in a region, and a region's one named Secret.
    assert Grant("rlfleet-hub", "rlfleet.io", "rlruns", "create") in region - hub
    assert any(g.name and g.verb == "get" and g.resource == "secrets" for g in region)
    assert unused_grants(hub, hub - {status}) == [status]


def test_watched_namespaces_hold_the_operators_rights_and_the_cluster_keeps_none() -> None:
    """With `watchNamespaces`, the operator's rights are the same ones, each a Role's in
    every watched namespace; cluster-wide it keeps what kopf reads (namespaces, CRDs)."""
    watch = ("team-a", "team-b")
    for role in ("hub", "region"):
        assert chart_grants(role, watch) == chart_grants(role), role
        documents = chart_rbac(role, watch)
        rules = {
            (d["kind"], d["metadata"].get("namespace"), d["metadata"]["name"]): d["rules"]
            for d in documents
            if d["kind"] in ("ClusterRole", "Role")
        }
        held: dict[str | None, set[str]] = {}  # namespace (None: cluster-wide) -> resources
        for binding in (d for d in documents if d["kind"].endswith("Binding")):
            if not any(s["name"] == "rlfleet-operator" for s in binding["subjects"]):
                continue
            ref = binding["roleRef"]
            namespace = binding["metadata"].get("namespace") if ref["kind"] == "Role" else None
            for rule in rules[(ref["kind"], namespace, ref["name"])]:
                held.setdefault(namespace, set()).update(rule["resources"])
        assert held[None] == {"namespaces", "customresourcedefinitions"}, role
        for namespace in watch:
            assert {"secrets", "events", "configmaps"} <= held[namespace], role
