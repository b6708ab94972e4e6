"""Which of the chart's RBAC grants the operators used: evidence that each rule is one the
operator needs, read from the bed's API servers' audit logs after the tests ran.

The bed's kube-apiservers log every request a ServiceAccount makes (`kube.AUDIT_POLICY`, at
Metadata level: who, which verb, which object; never a body, so no Secret's data). The
chart, rendered for each role as a user installs it, grants each of its accounts a set
of (API group, resource, verb) triples; a triple no audited request used is one the
operators' tests never needed.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from rlfleet.testbed.fleet import RELEASE_NAMESPACE, rendered_chart
from rlfleet.testbed.kube import audit_log

_ACCOUNT = f"system:serviceaccount:{RELEASE_NAMESPACE}:"


@dataclass(frozen=True, order=True)
class Grant:
    """One verb on one resource that the chart grants one of its accounts."""

    account: str  # the ServiceAccount, in the release's namespace
    group: str  # the API group; "" is core
    resource: str  # with its subresource: "rlruns/status"
    verb: str
    name: str = ""  # the one object a rule with resourceNames allows

    def __str__(self) -> str:
        where = f"{self.group or 'core'}/{self.resource}" + (f" {self.name}" if self.name else "")
        return f"{self.account}: {self.verb} {where}"


def chart_rbac(role: str, watch: Sequence[str] = ()) -> list[dict]:
    """The RBAC objects of the chart installed with `role` (hub or region), watching the
    namespaces `watch` (none: every namespace)."""
    watched = [f"--set=watchNamespaces={{{','.join(watch)}}}"] if watch else []
    documents = rendered_chart(f"--namespace={RELEASE_NAMESPACE}", f"--set=role={role}", *watched)
    kinds = ("ClusterRole", "Role", "ClusterRoleBinding", "RoleBinding")
    return [d for d in documents if d["kind"] in kinds]


def chart_grants(role: str, watch: Sequence[str] = ()) -> set[Grant]:
    """What the chart, installed with `role` (hub or region), grants its accounts."""
    documents = chart_rbac(role, watch)
    # A Role is one namespace's (a ClusterRole and the Roles of several watched namespaces
    # may share a name); a RoleBinding refers to a Role of its own namespace.
    rules = {
        (d["kind"], d["metadata"].get("namespace"), d["metadata"]["name"]): d["rules"]
        for d in documents
        if d["kind"] in ("ClusterRole", "Role")
    }
    grants = set()
    for binding in (d for d in documents if d["kind"] in ("ClusterRoleBinding", "RoleBinding")):
        ref = binding["roleRef"]
        namespace = binding["metadata"].get("namespace") if ref["kind"] == "Role" else None
        for subject in binding["subjects"]:
            for rule in rules[(ref["kind"], namespace, ref["name"])]:
                grants |= {
                    Grant(subject["name"], group, resource, verb, name)
                    for group in rule["apiGroups"]
                    for resource in rule["resources"]
                    for verb in rule["verbs"]
                    for name in rule.get("resourceNames") or [""]
                }
    return grants


def used_grants(audit_lines: Iterable[str]) -> set[Grant]:
    """The grants the release's accounts' allowed requests used, from audit log lines."""
    used = set()
    for line in audit_lines:
        event = json.loads(line)
        user, ref = event.get("user", {}).get("username", ""), event.get("objectRef")
        status = event.get("responseStatus", {}).get("code", 0)
        if not user.startswith(_ACCOUNT) or ref is None or status == 403:  # 403: not granted
            continue
        resource = ref["resource"] + (f"/{ref['subresource']}" if ref.get("subresource") else "")
        account, group = user.removeprefix(_ACCOUNT), ref.get("apiGroup", "")
        verbs = [event["verb"]]
        if event["verb"] == "patch" and status == 201:  # a server-side apply that created
            verbs.append("create")
        for verb in verbs:
            used.add(Grant(account, group, resource, verb))
            if ref.get("name"):
                used.add(Grant(account, group, resource, verb, ref["name"]))
    return used


def unused_grants(grants: set[Grant], used: set[Grant]) -> list[Grant]:
    return sorted(grants - used)


def bed_usage(logs: Path) -> dict[str, tuple[int, list[Grant]]]:
    """For each role, how many grants the chart makes and those unused, from the audit
    logs of a bed's clusters (`<cluster>-audit.log` in `logs`, and its rotated parts)."""
    found = {}
    for role, clusters in (("hub", "hub"), ("region", "region-*")):
        used: set[Grant] = set()
        for path in sorted(logs.glob(f"{audit_log(Path(), clusters).stem}*.log")):
            with path.open() as lines:
                used |= used_grants(lines)
        grants = chart_grants(role)
        found[role] = (len(grants), unused_grants(grants, used))
    return found
