"""Upgrading: the previous release's chart and operator, with a run going, upgraded with
`helm upgrade` to this tree's chart and operator on the bed; and this tree's CRDs held
against the previous release's, field by field, with the upgrading guide's conversion
notes (docs/guides/upgrading.md).

The previous release is read from git (`PREVIOUS_RELEASE`): its chart, its CRDs and its
operator's code, which runs from the extracted tree under the development environment.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import threading
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml
from conftest import ROOT, wait_for

import images
from rlfleet.api.schema import KINDS, crd
from rlfleet.testbed.bed import BedInfo
from rlfleet.testbed.fleet import (
    CHART,
    HUB,
    RELEASE,
    RELEASE_NAMESPACE,
    Fleet,
    TrafficServer,
    serving_deployment,
)
from rlfleet.testbed.traces import TraceReceiver

# The commit of the last released chart (0.1.0); move it to the new release's when
# Chart.yaml's version is bumped again.
PREVIOUS_RELEASE = "1e76325e68a227cb02423c6a60897d45b219f5ae"

REGION = "region-a"
RUN = "tiny-moe-arith"
POOL = "chat-prod"
SERVING = "chat-vllm"
REMOVED = {"model.format": "hf-safetensors", "environments": ["arith-sandbox"]}
# What the upgrading guide tells users to run in each cluster.
UPGRADE = (
    "upgrade",
    RELEASE,
    str(CHART),
    f"--namespace={RELEASE_NAMESPACE}",
    "--reset-then-reuse-values",
)


def git(*args: str) -> subprocess.CompletedProcess[bytes]:
    done = subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True)
    if done.returncode != 0:
        pytest.fail(
            f"git {' '.join(args)}: {done.stderr.decode()}: the upgrade tests need the "
            f"history back to {PREVIOUS_RELEASE[:7]} (a shallow clone: git fetch --unshallow)"
        )
    return done


# --- CRD compatibility ------------------------------------------------------------------

# A new bound in these directions refuses values the previous schema took.
RAISED = ("minimum", "exclusiveMinimum", "minLength", "minItems", "minProperties")
LOWERED = ("maximum", "exclusiveMaximum", "maxLength", "maxItems", "maxProperties")
FIXED = ("type", "pattern", "format", "x-kubernetes-list-type", "x-kubernetes-list-map-keys")


def narrowings(old: dict, new: dict, path: str) -> dict[str, str]:
    """Fields of a schema (`path`, dotted) whose stored or applied values the new schema
    drops or refuses, and how: removed, retyped, bounded tighter, newly required without
    a default, or under a new CEL rule that reads a field the old schema had (a rule on
    added fields alone only bounds what old objects never set). Added fields are not
    among them."""
    if new.get("x-kubernetes-preserve-unknown-fields"):
        return {}
    found: dict[str, str] = {}

    def note(at: str, what: str) -> None:
        found[at] = f"{found[at]}; {what}" if at in found else what

    for key in FIXED:
        if key in new and old.get(key) != new[key]:
            note(path, f"{key} {old.get(key)!r} -> {new[key]!r}")
    for key in RAISED:
        if key in new and (key not in old or new[key] > old[key]):
            note(path, f"{key} {old.get(key)} -> {new[key]}")
    for key in LOWERED:
        if key in new and (key not in old or new[key] < old[key]):
            note(path, f"{key} {old.get(key)} -> {new[key]}")
    if "enum" in new and set(old.get("enum", [None])) - set(new["enum"]):
        note(path, f"enum {old.get('enum')} -> {new['enum']}")
    if old.get("nullable") and not new.get("nullable"):
        note(path, "no longer nullable")
    properties = new.get("properties", {})
    for name in set(new.get("required", [])) - set(old.get("required", [])):
        if "default" not in properties.get(name, {}):
            note(f"{path}.{name}", "newly required")
    rules = {r["rule"] for r in old.get("x-kubernetes-validations", [])}
    for rule in new.get("x-kubernetes-validations", []):
        read = set(re.findall(r"\b(?:self|oldSelf)\.(\w+)", rule["rule"]))
        if rule["rule"] not in rules and (not read or read & set(old.get("properties", {}))):
            note(path, f"new rule {rule['rule']!r}")
    for name, child in old.get("properties", {}).items():
        if name in properties:
            found |= narrowings(child, properties[name], f"{path}.{name}")
        else:
            note(f"{path}.{name}", "removed")
    for key, suffix in (("items", "[]"), ("additionalProperties", "[*]")):
        if isinstance(old.get(key), dict) and isinstance(new.get(key), dict):
            found |= narrowings(old[key], new[key], path + suffix)
    return found


def crd_narrowings(previous: dict, current: dict | None) -> dict[str, str]:
    """What a CRD of the previous release loses in the current one, named `Kind.field`
    (`Kind` alone for a kind or a version gone)."""
    kind = previous["spec"]["names"]["kind"]
    if current is None:
        return {kind: "kind removed"}
    versions = {v["name"]: v for v in current["spec"]["versions"]}
    found = {}
    for version in previous["spec"]["versions"]:
        if version["name"] not in versions:
            found[kind] = f"version {version['name']} removed"
            continue
        old = version["schema"]["openAPIV3Schema"]
        new = versions[version["name"]]["schema"]["openAPIV3Schema"]
        found |= {f"{kind}{path}": what for path, what in narrowings(old, new, "").items()}
    return found


def upgrading_notes() -> str:
    """The upgrading guide, its conversion notes included."""
    return (ROOT / "docs" / "guides" / "upgrading.md").read_text()


def test_a_removed_or_narrowed_field_is_found_and_an_added_one_is_not() -> None:
    old = {
        "type": "object",
        "properties": {
            "a": {"type": "string"},
            "n": {"type": "integer", "maximum": 10},
            "e": {"type": "string", "enum": ["x", "y"]},
            "l": {"type": "array", "items": {"type": "object", "properties": {"k": {}}}},
        },
    }
    added = {
        **old,
        "properties": {**old["properties"], "b": {"type": "string"}, "c": {"default": 1}},
        "required": ["c"],
        "x-kubernetes-validations": [{"rule": "self.b != 'x'"}],
    }
    assert narrowings(old, added, "") == {}
    narrowed = {
        "type": "object",
        "required": ["b"],
        "properties": {
            "b": {"type": "string"},
            "n": {"type": "integer", "maximum": 5},
            "e": {"type": "string", "enum": ["x"]},
            "l": {"type": "array", "items": {"type": "object", "properties": {}}},
        },
        "x-kubernetes-validations": [{"rule": "self.n > 2"}],
    }
    assert set(narrowings(old, narrowed, "")) == {"", ".a", ".b", ".n", ".e", ".l[].k"}


def test_the_crds_only_add_fields_or_the_guide_says_how_to_convert_what_they_drop() -> None:
    listed = git("ls-tree", "--name-only", PREVIOUS_RELEASE, "crds/").stdout.decode().split()
    current = {kind.kind: crd(kind) for kind in KINDS}
    found = {}
    for path in listed:
        previous = yaml.safe_load(git("show", f"{PREVIOUS_RELEASE}:{path}").stdout)
        found |= crd_narrowings(previous, current.get(previous["spec"]["names"]["kind"]))
    notes = upgrading_notes()
    unexplained = {name: what for name, what in found.items() if f"`{name}`" not in notes}
    assert not unexplained, (
        f"changed since {PREVIOUS_RELEASE[:7]} in a way stored objects or old manifests "
        f"may not survive, with no conversion note in docs/guides/upgrading.md "
        f"(name each as `Kind.path`): {unexplained}"
    )


# --- helm upgrade on the bed ------------------------------------------------------------


def field_paths(schema: dict, path: str = "") -> set[str]:
    """Every field a schema declares, dotted."""
    found = {path} if path else set()
    for name, child in schema.get("properties", {}).items():
        found |= field_paths(child, f"{path}.{name}")
    if isinstance(schema.get("items"), dict):
        found |= field_paths(schema["items"], f"{path}[]")
    return found


def chart_crds() -> dict[str, dict]:
    """The working tree chart's CRDs (a template that is YAML once its `if` is dropped)."""
    text = (CHART / "templates" / "crds.yaml").read_text()
    body = "\n".join(line for line in text.splitlines() if not line.startswith("{{"))
    return {d["metadata"]["name"]: d for d in yaml.safe_load_all(body) if d}


@dataclass
class State:
    """What the upgrade must keep: each workload's pod template and its pods' UIDs."""

    templates: dict[str, dict]  # cluster/kind/name -> spec.template
    pods: dict[str, set[str]]  # cluster/kind/name -> its pods' UIDs


@dataclass
class Upgrade:
    fleet: Fleet
    ns: str
    old_run: dict  # the manifest as applied under the previous release
    stored: dict[str, dict]  # the run's spec by cluster, read before any operator wrote it
    before: State
    after: State
    serving_replicas: list[int]  # sampled through the upgrade
    logs: dict[str, str]  # what this release's operators logged

    def get(self, cluster: str, *what: str) -> dict:
        return json.loads(self.fleet.kubectl(cluster, "-n", self.ns, "get", *what, "-o", "json"))


def owning_workload(cluster: str, pod: dict, replica_sets: dict[str, dict]) -> str | None:
    """`cluster/Kind/name` of the Deployment or StatefulSet a pod belongs to."""
    for ref in pod["metadata"].get("ownerReferences", []):
        if ref["kind"] == "StatefulSet":
            return f"{cluster}/StatefulSet/{ref['name']}"
        if ref["kind"] == "ReplicaSet" and ref["name"] in replica_sets:
            for owner in replica_sets[ref["name"]]["metadata"].get("ownerReferences", []):
                if owner["kind"] == "Deployment":
                    return f"{cluster}/Deployment/{owner['name']}"
    return None


def state(fleet: Fleet, ns: str) -> State:
    templates, pods = {}, {}
    for cluster in (HUB, REGION):

        def items(what: str, cluster: str = cluster) -> list[dict]:
            return json.loads(fleet.kubectl(cluster, "-n", ns, "get", what, "-o", "json"))["items"]

        for workload in items("deployments,statefulsets"):
            name = f"{cluster}/{workload['kind']}/{workload['metadata']['name']}"
            templates[name] = workload["spec"]["template"]
            pods[name] = set()
        replica_sets = {r["metadata"]["name"]: r for r in items("replicasets")}
        for pod in items("pods"):
            owner = owning_workload(cluster, pod, replica_sets)
            if owner in pods and not pod["metadata"].get("deletionTimestamp"):
                pods[owner].add(pod["metadata"]["uid"])
    return State(templates, pods)


def rolled_out(fleet: Fleet, ns: str) -> bool:
    """Every workload runs its current template on all its replicas, and nothing else."""
    for cluster in (HUB, REGION):
        listed = fleet.kubectl(cluster, "-n", ns, "get", "deployments,statefulsets", "-o", "json")
        for workload in json.loads(listed)["items"]:
            spec, status = workload["spec"], workload.get("status", {})
            wanted = spec.get("replicas", 1)
            if status.get("observedGeneration") != workload["metadata"]["generation"]:
                return False
            if not (status.get("replicas", 0) == status.get("updatedReplicas", 0) == wanted):
                return False
            if status.get("readyReplicas", 0) != wanted:
                return False
            if workload["kind"] == "StatefulSet" and (
                status.get("currentRevision") != status.get("updateRevision")
            ):
                return False
    return True


def running(fleet: Fleet, cluster: str, ns: str, selector: str) -> int:
    pods = json.loads(fleet.kubectl(cluster, "-n", ns, "get", "pods", "-l", selector, "-o", "json"))
    return sum(
        1
        for p in pods["items"]
        if p["status"].get("phase") == "Running" and not p["metadata"].get("deletionTimestamp")
    )


def previous_manifest(tree: Path, name: str) -> dict:
    return yaml.safe_load((tree / "examples" / name).read_text())


def previous_run(tree: Path) -> dict:
    """The previous release's example run, in region-a alone, with the fields this
    release removed set as its users set them."""
    run = previous_manifest(tree, "rlrun.yaml")
    spec = run["spec"]
    spec["rollout"]["regions"] = [r for r in spec["rollout"]["regions"] if r["name"] == REGION]
    sync = spec["weightSync"]
    sync["endpoints"] = [e for e in sync["endpoints"] if e["region"] == REGION]
    spec["model"]["format"] = REMOVED["model.format"]
    spec["environments"] = REMOVED["environments"]
    return run


def settled(fleet: Fleet, ns: str) -> bool:
    return (
        running(fleet, HUB, ns, f"rlfleet.io/run={RUN},rlfleet.io/component=trainer") == 1
        and running(fleet, HUB, ns, f"rlfleet.io/run={RUN},rlfleet.io/component=feed") == 1
        # The pool lends half its four replicas: two rollout workers.
        and running(fleet, REGION, ns, f"rlfleet.io/run={RUN},rlfleet.io/component=rollout") == 2
        and rolled_out(fleet, ns)
    )


class Sampler:
    """The serving Deployment's replicas, read every half second: a reclaim shows."""

    def __init__(self, fleet: Fleet, ns: str) -> None:
        self.fleet, self.ns = fleet, ns
        self.samples: list[int] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.5):
            deployment = self.fleet.kubectl(
                REGION, "-n", self.ns, "get", "deployment", SERVING, "-o", "json"
            )
            self.samples.append(json.loads(deployment)["spec"]["replicas"])

    def stop(self) -> list[int]:
        self._stop.set()
        self._thread.join()
        return self.samples


@pytest.fixture(scope="module")
def upgrade(
    bed: BedInfo,
    image_environments: images.Environments,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Upgrade]:
    tree = tmp_path_factory.mktemp("previous-release")
    archive = git("archive", PREVIOUS_RELEASE).stdout
    subprocess.run(["tar", "-x", "-C", str(tree)], input=archive, check=True)
    # This release's operator runs from its image's environment: built before the upgrade.
    operator_python = str(image_environments.python("operator"))
    ns = f"up-{uuid.uuid4().hex[:6]}"
    fleet = Fleet(bed, tmp_path_factory.mktemp("upgrade-fleet"), [ns], [REGION])
    fleet.values = {
        "resyncSeconds": 1,
        "runResyncSeconds": 1,
        "regionTimeoutSeconds": 5,
        "callTimeoutSeconds": 2,
    }
    # The previous operator: its own code, from the extracted tree's source roots.
    fleet.chart = tree / "helm" / "rlfleet"
    # The session may have applied this tree's CRDs with kubectl (`crds_installed`): the
    # previous chart takes their fields over, as it owns them where it was installed first.
    fleet.install_flags = ("--force-conflicts",)
    roots = sorted(str(d) for d in tree.iterdir() if (d / "rlfleet").is_dir())
    fleet.python = sys.executable
    fleet.operator_env = {"PYTHONPATH": ":".join(roots)}
    traffic, traces = TrafficServer(), TraceReceiver()
    sampler = None
    try:
        for cluster in (HUB, REGION):
            fleet.kubectl(cluster, "create", "namespace", ns)
        fleet.setup()
        for cluster in (HUB, REGION):
            fleet.kubectl(cluster, "wait", "--for=condition=Established", "crd", "--all")
        traffic.load[REGION] = 0.0
        pool = previous_manifest(tree, "inferencepool.yaml")
        pool["spec"]["traffic"]["metricsUrl"] = traffic.url(REGION)
        for document in (serving_deployment(SERVING, replicas=4, gpus=8), pool):
            fleet.kubectl(REGION, "-n", ns, "apply", "-f", "-", stdin=json.dumps(document))
        fleet.start_all()
        old_run = previous_run(tree)
        fleet.kubectl(HUB, "-n", ns, "apply", "-f", "-", stdin=json.dumps(old_run))
        wait_for("the run going under the previous release", lambda: settled(fleet, ns), 180)
        before = state(fleet, ns)

        sampler = Sampler(fleet, ns)
        for cluster in (HUB, REGION):
            fleet.supervisor.stop(f"operator-{cluster}")
        for cluster in (REGION, HUB):  # as the upgrading guide says: regions first
            upgraded = fleet.helm(cluster, *UPGRADE)
            assert upgraded.returncode == 0, upgraded.stderr
        stored = {
            cluster: json.loads(
                fleet.kubectl(cluster, "-n", ns, "get", "rlrun", RUN, "-o", "json")
            )["spec"]
            for cluster in (HUB, REGION)
        }
        fleet.python = operator_python
        fleet.operator_env = traces.env
        logged = {cluster: len(fleet.log(cluster)) for cluster in (HUB, REGION)}
        fleet.start_all()

        def reconciled(service: str, kind: str, name: str) -> bool:
            return any(
                s.service == service
                and s.name == f"reconcile {kind}"
                and s.attributes.get("rlfleet.name") == name
                for s in list(traces.spans)
            )

        wait_for(
            "this release's operators to reconcile the run and the pool",
            lambda: (
                reconciled("rlfleet-operator-hub", "RLRun", RUN)
                and reconciled("rlfleet-operator-region", "RLRun", RUN)
                and reconciled("rlfleet-operator-region", "InferencePool", POOL)
            ),
        )
        wait_for("the run going under this release", lambda: settled(fleet, ns), 180)
        after = state(fleet, ns)
        logs = {cluster: fleet.log(cluster)[logged[cluster] :] for cluster in logged}
        result = Upgrade(fleet, ns, old_run, stored, before, after, sampler.stop(), logs)
        sampler = None
        yield result
        # The upgraded run is deleted as any: its mirror and streams go with it.
        fleet.kubectl(HUB, "-n", ns, "delete", "rlrun", RUN, "--timeout=90s")
    finally:
        if sampler is not None:
            sampler.stop()
        fleet.release()
        fleet.stop()
        traffic.close()
        traces.close()
        for link in fleet.links.values():
            link.listener.close()


def test_helm_upgrade_applies_this_releases_crds(upgrade: Upgrade) -> None:
    history = upgrade.fleet.helm(HUB, "history", RELEASE, "-n", RELEASE_NAMESPACE, "-o", "json")
    newest = json.loads(history.stdout)[-1]
    version = yaml.safe_load((CHART / "Chart.yaml").read_text())["version"]
    assert (newest["status"], newest["chart"]) == ("deployed", f"rlfleet-{version}")
    for name, shipped in chart_crds().items():
        for cluster in (HUB, REGION):
            live = json.loads(upgrade.fleet.kubectl(cluster, "get", "crd", name, "-o", "json"))
            [served] = live["spec"]["versions"]
            [wanted] = shipped["spec"]["versions"]
            assert field_paths(served["schema"]["openAPIV3Schema"]) == field_paths(
                wanted["schema"]["openAPIV3Schema"]
            ), f"{name} in {cluster} is not the chart's"


def test_a_stored_run_reads_without_the_removed_fields_and_an_old_manifest_is_refused(
    upgrade: Upgrade,
) -> None:
    # Read back under the new schema before anything wrote them: the API server prunes
    # what the schema no longer has, in the hub's run and in the region's mirror.
    for spec in upgrade.stored.values():
        assert "format" not in spec["model"] and "environments" not in spec
    # Applied again as it was written for the previous release, the manifest is refused
    # with the field it must lose.
    with pytest.raises(RuntimeError, match=r"spec\.model\.format"):
        upgrade.fleet.kubectl(
            HUB, "-n", upgrade.ns, "apply", "-f", "-", stdin=json.dumps(upgrade.old_run)
        )


def test_the_run_keeps_running_and_only_pods_of_changed_templates_are_replaced(
    upgrade: Upgrade,
) -> None:
    before, after = upgrade.before, upgrade.after
    assert set(after.templates) == set(before.templates)
    kept = [w for w in before.templates if after.templates[w] == before.templates[w]]
    for workload in kept:
        assert after.pods[workload] == before.pods[workload], f"{workload} was recreated"
    # The pool's serving fleet kept its replicas and pods: no GPU was reclaimed and lent
    # again across the upgrade.
    assert f"{REGION}/Deployment/{SERVING}" in kept
    assert set(upgrade.serving_replicas) == {2}, upgrade.serving_replicas
    assert upgrade.get(HUB, "rlrun", RUN)["status"]["phase"] == "Running"
    # This release's operators took the pruned spec as a spec change, handled it once,
    # and went on without an error.
    for cluster, log in upgrade.logs.items():
        assert "Traceback" not in log, f"operator-{cluster}:\n{log[-3000:]}"
