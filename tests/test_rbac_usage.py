"""Reading which RBAC grants the operators used (`rlfleet.testbed.rbac`): the chart's grants
as `helm template` renders them, and the audit log lines that use them. The bed's own
audit logs are read at the end of every session (conftest's summary)."""

from __future__ import annotations

import json

from rlfleet.testbed.rbac import Grant, chart_grants, unused_grants, used_grants

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
