"""Attacks on the EnvPool sandboxes' trust boundary, each one test, each against the real
parts: a real session server (root, namespace sandboxes) that two runs share, the real
`sandbox_init`, and for the pool's Kubernetes side the bed's API server with the chart's
own admission policy and the region operator's own reconcile.

An attack succeeds when it reaches what is not its run's: another run's environment, the
pod's filesystem, root's hand (root writing where a run pointed it), a container on a
shared kernel, or a sandbox pod's port. Each test asserts that it does not.
"""

from __future__ import annotations

import asyncio
import base64
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml
from conftest import ROOT, Kubectl
from kubernetes.client.exceptions import ApiException

from rlfleet.api.inferencepool import InferencePoolSpec
from rlfleet.api.meta import API_VERSION
from rlfleet.launch.settings import Limits, ServerConfig
from rlfleet.operator.config import OperatorConfig, Workloads
from rlfleet.operator.kube import Kube, Ref
from rlfleet.operator.region.envpool_reconciler import EnvPoolReconciler as RegionOperator
from rlfleet.operator.workloads.envpool import ENVPOOL_PORT
from rlfleet.operator.workloads.hub import mirror
from rlfleet.operator.workloads.rollout import rollout_deployment
from rlfleet.rollout.environment.envclient import EnvClient, EnvServerError, LocalServer
from rlfleet.rollout.envpool import sandboxes
from rlfleet.testbed.bed import BedInfo
from rlfleet.testbed.fleet import rendered_chart

LIMITS = Limits(
    disk_bytes=8 << 20,
    file_bytes=4 << 20,
    memory_bytes=512 << 20,
    processes=32,
    call_seconds=10,
    wall_seconds=120,
)
TOKENS = {"run-a": "a" * 8 + "-attacker-token", "run-b": "b" * 8 + "-victims-token"}
HOME_PARENT = "/run/rlfleet"  # where session servers on this machine keep their state
UID_BASE = 850_000
SANDBOX_INIT = Path(sandboxes.__file__).with_name("sandbox_init.py")
ENVSERVER = Path(sandboxes.__file__).with_name("envserver.py")
UNTOUCHED = "untouched\n"
PWNED = "pwned\n"


@dataclass
class Pool:
    server: LocalServer
    home: Path
    snapshots: Path  # the server's snapshots_dir
    mounts: Path  # the server's mounts_dir
    tokens_file: Path
    victim: Path  # a folder of the pod's, outside every sandbox: victim.txt in it

    def client(self, run: str) -> EnvClient:
        return EnvClient(self.server.url, TOKENS[run])

    def built(self, run: str, name: str) -> Path:
        """Where the server keeps `run`'s environment `name`."""
        return self.snapshots / ".runs" / base64.urlsafe_b64encode(run.encode()).decode() / name


@pytest.fixture(scope="module")
def pool() -> Iterator[Pool]:
    Path(HOME_PARENT).mkdir(parents=True, exist_ok=True)
    home = Path(tempfile.mkdtemp(prefix="attacks-", dir=HOME_PARENT))  # root's alone
    tokens_file = home / "tokens.json"
    tokens_file.write_text(json.dumps(TOKENS))
    tokens_file.chmod(0o600)
    victim = home / "victim"
    victim.mkdir()
    (victim / "victim.txt").write_text(UNTOUCHED)
    snapshots = home / "snapshots"
    snapshots.mkdir(mode=0o755)
    # A pool's shared environment, as an image may carry one, holding a link out of it.
    (snapshots / "linked").mkdir()
    (snapshots / "linked" / "out").symlink_to(victim)
    config = ServerConfig(
        tokens_file=str(tokens_file),
        snapshots_dir=str(snapshots),
        mounts_dir=str(home / "sandboxes"),
        limits=LIMITS,
        max_sessions=8,
        warm=2,
        max_body_bytes=1 << 20,
        uid_base=UID_BASE,
    )
    try:
        with LocalServer(config) as server:
            yield Pool(server, home, snapshots, home / "sandboxes", tokens_file, victim)
    finally:
        shutil.rmtree(home, ignore_errors=True)


def run(coroutine):
    return asyncio.run(coroutine)


def b64(text: str) -> str:
    return base64.b64encode(text.encode()).decode()


async def build(pool: Pool, run_name: str, name: str, setup: str, files: dict | None = None):
    async with pool.client(run_name) as env:
        await env.build_snapshot(name, {k: v.encode() for k, v in (files or {}).items()}, setup)


async def claim(pool: Pool, run_name: str, files: dict[str, str], snapshot: str) -> str:
    """Claims a fork of `snapshot` with `files`, then lists what the sandbox holds; or the
    server's refusal."""
    async with pool.client(run_name) as env:
        try:
            sandbox = await env.create({p: c.encode() for p, c in files.items()}, snapshot=snapshot)
        except EnvServerError as refused:
            return f"refused: {refused}"
        async with sandbox:
            reply = await sandbox.call({"tool": "run", "command": "ls -laR ."})
            return reply.get("output", "")


def links_out_of(tree: Path) -> list[str]:
    """Links in `tree` that are absolute or lead out of it."""
    found = []
    for directory, folders, files in os.walk(tree):
        for name in folders + files:
            path = Path(directory) / name
            if path.is_symlink():
                target = path.readlink()
                if target.is_absolute() or not path.resolve().is_relative_to(tree.resolve()):
                    found.append(f"{path.relative_to(tree)} -> {target}")
    return found


# --- root following what a run planted ---------------------------------------------------


@pytest.mark.attack("sandbox")
def test_symlink_into_another_runs_environment_claimed_with_files(pool: Pool) -> None:
    """Run A builds an environment holding a link into run B's, then claims it with a file
    at the link: root, writing the claim's files, would overwrite B's grader."""
    grader = "def test_solution():\n    assert solve() == 42\n"
    run(build(pool, "run-b", "grader", "true", {"tests/test_grade.py": grader}))
    b_tests = pool.built("run-b", "grader") / "tests"
    run(build(pool, "run-a", "trojan", f"ln -s {b_tests} hook"))
    run(claim(pool, "run-a", {"hook/test_grade.py": "def test_solution(): pass\n"}, "trojan"))
    assert (b_tests / "test_grade.py").read_text() == grader


@pytest.mark.attack("sandbox")
def test_relative_symlink_out_of_a_snapshot(pool: Pool) -> None:
    """A relative link that climbs out of the environment's tree: kept, it leads a fork's
    claim (root) into the pod's filesystem, here the server's own folder of sandboxes."""
    run(build(pool, "run-a", "climber", "ln -s ../.. up && ln -s ../../../../../../.. top"))
    escaped = "escaped-through-a-relative-link"
    listing = run(claim(pool, "run-a", {f"up/{escaped}": PWNED}, "climber"))
    assert not any(pool.home.rglob(escaped)), listing
    assert links_out_of(pool.built("run-a", "climber")) == []


@pytest.mark.attack("sandbox")
def test_absolute_symlink_in_a_snapshot(pool: Pool) -> None:
    """An absolute link in an environment: root follows it from the pod's root when a
    claim's file lies below it."""
    run(build(pool, "run-a", "absolute", f"ln -s {pool.victim} abs"))
    listing = run(claim(pool, "run-a", {"abs/victim.txt": PWNED}, "absolute"))
    assert (pool.victim / "victim.txt").read_text() == UNTOUCHED, listing
    assert links_out_of(pool.built("run-a", "absolute")) == []


@pytest.mark.attack("sandbox")
def test_link_in_a_shared_environment_is_not_followed_by_root(pool: Pool) -> None:
    """A link out of a pool's shared environment (the image's, which no run's build
    cleaned): a claim's file below it is refused, naming the file, rather than written
    by root wherever the link leads."""

    async def attack() -> str:
        async with pool.client("run-a") as env:
            try:
                await env.create({"out/victim.txt": PWNED.encode()}, snapshot="linked")
            except EnvServerError as refused:
                return f"{refused.status} {refused.param}"
            return "claimed"

    answer = run(attack())
    assert (pool.victim / "victim.txt").read_text() == UNTOUCHED
    assert answer == "422 files.out/victim.txt"


@pytest.mark.attack("sandbox")
def test_hardlink_in_a_snapshot(pool: Pool) -> None:
    """Hard links made in a build (to a file outside the tree, and within it): an
    environment keeps no name of a file that lies outside it, so a fork's write to one
    name reaches nothing but the fork."""
    setup = (
        "echo mine > /tmp/own && ln /tmp/own outside; ln /envserver.py server 2>/dev/null; "
        "ln ../envserver.py server2 2>/dev/null; echo one > a && ln a b; true"
    )
    run(build(pool, "run-a", "hardlinked", setup))
    tree = pool.built("run-a", "hardlinked")
    names: dict[int, int] = {}
    for path in tree.rglob("*"):
        if path.is_file() and not path.is_symlink():
            names[path.stat().st_ino] = names.get(path.stat().st_ino, 0) + 1
    for path in tree.rglob("*"):
        if path.is_file() and not path.is_symlink():
            assert path.stat().st_nlink <= names[path.stat().st_ino], path
    assert not (tree / "server").exists() and not (tree / "server2").exists()

    async def fork() -> str:
        async with (
            pool.client("run-a") as env,
            await env.create({"a": b"two\n"}, snapshot="hardlinked") as sandbox,
        ):
            return (await sandbox.call({"tool": "run", "command": "cat b"}))["output"]

    run(fork())
    assert (tree / "a").read_text() == "one\n" and (tree / "b").read_text() == "one\n"


@pytest.mark.attack("sandbox")
def test_fifo_in_a_snapshot_does_not_hold_a_claim(pool: Pool) -> None:
    """A named pipe left in an environment, then claimed with a file at its name: root
    opening it to write would wait for a reader for ever, holding the claim and a slot."""
    run(build(pool, "run-a", "piped", "mkfifo pipe"))
    started = time.monotonic()
    listing = run(claim(pool, "run-a", {"pipe": "data\n"}, "piped"))
    assert time.monotonic() - started < 20, listing
    assert "refused: 500" not in listing


# --- paths -------------------------------------------------------------------------------


@pytest.mark.attack("sandbox")
@pytest.mark.parametrize("path", ["../x", "a/../../x", "/etc/x", "./x", "a//x", "a/./x"])
def test_dotdot_in_claim_paths(pool: Pool, path: str) -> None:
    """A claim's file path that is not plain and relative is refused, naming it."""

    async def attack() -> EnvServerError:
        async with pool.client("run-a") as env:
            with pytest.raises(EnvServerError) as refused:
                await env.create({path: b"x"})
            return refused.value

    refused = run(attack())
    assert (refused.status, refused.param) == (400, f"files.{path}")


@pytest.mark.attack("sandbox")
def test_dotdot_in_a_claim_that_reaches_sandbox_init(pool: Pool) -> None:
    """`sandbox_init` does not lean on the server's check: a claim whose file path climbs
    out (as a server with a bug might pass one on) writes nothing outside the sandbox."""
    root = Path(tempfile.mkdtemp(prefix="sandbox-", dir=pool.mounts))
    root.chmod(0o755)
    settings = {
        "root": str(root),
        "disk_bytes": 1 << 20,
        "server": str(ENVSERVER),
        "python": "/usr/bin/python3",
        "private_dirs": ["/tmp"],
        "system_dirs": ["/usr", "/bin", "/sbin", "/lib", "/lib64", "/etc"],
    }
    init = subprocess.Popen(
        [
            *("unshare", "--net", "--pid", "--mount", "--ipc", "--uts"),
            *("--fork", "--kill-child", "--mount-proc"),
            *(sys.executable, "-I", str(SANDBOX_INIT), json.dumps(settings)),
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        start_new_session=True,
    )
    escaped = f"escaped-{os.getpid()}"
    try:
        assert init.stdin is not None and init.stdout is not None
        assert json.loads(init.stdout.readline()) == {"ready": True}
        limits = {name: 64 for name in sandboxes.RLIMIT_FIELDS} | {"memory_bytes": 1 << 30}
        claimed = {
            "uid": UID_BASE + 999,
            "limits": limits | {"cpu_seconds": 10, "file_bytes": 1 << 20},
            "disk_bytes": 1 << 20,
            "snapshot": None,
            "manifest": None,
            "files": {f"../../{escaped}": b64(PWNED), f"a/../../../{escaped}-2": b64(PWNED)},
        }
        init.stdin.write(json.dumps(claimed) + "\n")
        init.stdin.flush()
        answer = json.loads(init.stdout.readline() or "null")
    finally:
        os.killpg(init.pid, 9)
        init.wait()
        shutil.rmtree(root, ignore_errors=True)
    # Both paths lead from the sandbox's tree to the server's folder of sandboxes.
    assert not (pool.mounts / escaped).exists() and not (pool.mounts / f"{escaped}-2").exists()
    assert answer is not None and answer.get("started") is False, answer
    assert answer["param"] == f"files.../../{escaped}"


# --- the pod's filesystem ----------------------------------------------------------------


@pytest.mark.attack("sandbox")
def test_sandbox_sees_none_of_the_pods_filesystem(pool: Pool) -> None:
    """pivot_root: a session's `/` is its own tmpfs, holding the image's system folders
    read-only and nothing of the pod's state: not the server's environments, sandboxes or
    tokens, by any path."""
    places = [pool.snapshots, pool.mounts, pool.tokens_file, pool.victim, Path(HOME_PARENT)]
    command = (
        f"ls -d {' '.join(map(str, places))} 2>&1; echo ROOT $(stat -f -c %T /); "
        "touch /usr/x /etc/x 2>&1; cat /proc/1/root/etc/hostname 2>&1 | head -1; "
        "ls /proc/1/root/ 2>&1 | head -3"
    )

    async def look() -> str:
        async with pool.client("run-a") as env, await env.create(None) as sandbox:
            return (await sandbox.call({"tool": "run", "command": command}))["output"]

    output = run(look())
    for place in places:
        assert f"{place}: No such file" in output or f"'{place}': No such file" in output, output
    assert "ROOT tmpfs" in output, output
    assert "Read-only file system" in output or "Permission denied" in output, output


# --- the pool's Kubernetes side, on the bed ----------------------------------------------

REGION = "region-a"
POOL = "sandboxes"


def chart(namespace: str, *values: str, release: str = "rlfleet") -> list[dict]:
    """The chart as the real helm renders it for a region in `namespace`."""
    return rendered_chart(
        *("-n", namespace, "--set", "role=region", "--set", f"cluster={REGION}"),
        *("--set", "crds.install=false", *values),
        release=release,
    )


def operator_config(documents: list[dict]) -> OperatorConfig:
    (config_map,) = [d for d in documents if d["kind"] == "ConfigMap"]
    return OperatorConfig.model_validate(yaml.safe_load(config_map["data"]["config.yaml"]))


def envpool(name: str, runtime_class: str, image: str = "ghcr.io/rlfleet/env-sandbox:0.1.0"):
    document = yaml.safe_load((ROOT / "examples" / "envpool.yaml").read_text())
    document["metadata"] = {"name": name}
    document["spec"]["template"] = {"image": image, "runtimeClassName": runtime_class}
    return document


@dataclass
class Region:
    kube: Kube
    namespace: str  # the pools' and runs'
    operator_namespace: str
    documents: list[dict]  # the chart, rendered for this region

    def reconcile(self, name: str, config: OperatorConfig | None = None) -> list:
        """The region operator's reconcile of the pool, as its handler runs it."""
        region = RegionOperator(self.kube, config or operator_config(self.documents))
        return region.reconcile_envpool(
            self.kube.get(Ref(API_VERSION, "EnvPool", name, self.namespace))
        )

    def create(self, document: dict, dry: bool = False) -> str | None:
        """The API server's refusal of the pool, or None if it took it."""
        path = f"/apis/{API_VERSION}/namespaces/{self.namespace}/envpools"
        try:
            self.kube.request("POST", path, document, query=[("dryRun", "All")] if dry else None)
        except ApiException as error:
            return f"{error.status} {json.loads(error.body).get('message', '')}"
        return None

    def get(self, kind: str, name: str, api_version: str = "v1") -> dict | None:
        return self.kube.get(Ref(api_version, kind, name, self.namespace))


@pytest.fixture(scope="module")
def region(bed: BedInfo, kubectl: Kubectl, crds_installed: None) -> Iterator[Region]:
    """A namespace of pools in a region of the bed, and the chart's admission policy for
    EnvPools, applied as `helm install` would. One pool is stored before the policy is,
    with a RuntimeClass it refuses: as a pool made before the chart's upgrade was."""
    kube = Kube.from_kubeconfig(yaml.safe_load(bed.kubeconfigs[REGION].read_text()), REGION)
    suffix = uuid.uuid4().hex[:6]
    namespace, operators = f"attacks-{suffix}", f"attacks-operator-{suffix}"
    for each in (namespace, operators):
        kubectl.run(REGION, "create", "namespace", each)
    # A release of its own, watching the pools' namespace alone: the policy is cluster-
    # scoped and named after the release, and the bed's other modules install the chart as
    # `rlfleet` watching their own namespaces. Applied over theirs, the binding kept their
    # namespace selector (apply removes only what it set itself) and matched no pool here.
    documents = chart(
        operators, "--set-json", f'watchNamespaces=["{namespace}"]', release=f"attacks-{suffix}"
    )
    admission = [d for d in documents if d["kind"].startswith("ValidatingAdmissionPolicy")]
    world = Region(kube, namespace, operators, documents)
    assert world.create(envpool("stored-before", "runc")) is None
    if admission:
        kubectl.run(REGION, "apply", "-f", "-", stdin=yaml.safe_dump_all(admission))
    try:
        yield world
    finally:
        for document in admission:
            kubectl.run(
                REGION, "delete", document["kind"], document["metadata"]["name"], check=False
            )
        for each in (namespace, operators):
            kubectl.run(REGION, "delete", "namespace", each, "--wait=false", check=False)


def refused_in_time(region: Region, document: dict) -> str | None:
    """The API server's refusal of the pool (dry run), once the admission policy is live
    (the API server loads it within seconds); None if it still takes it then."""
    deadline = time.monotonic() + 20
    while (refusal := region.create(document, dry=True)) is None and time.monotonic() < deadline:
        time.sleep(0.5)
    return refusal


@pytest.mark.attack("sandbox")
def test_runtime_class_runc_is_refused(region: Region) -> None:
    """An EnvPool under runc: a root container with SYS_ADMIN on the node's shared kernel,
    for whoever may create an EnvPool. The API server refuses it, naming the field."""
    refusal = refused_in_time(region, envpool("on-runc", "runc"))
    assert refusal is not None and refusal.startswith("422 "), refusal
    assert "spec.template.runtimeClassName: runc is not a RuntimeClass" in refusal
    assert region.create(envpool("on-gvisor", "gvisor"), dry=True) is None  # the honest case


@pytest.mark.attack("sandbox")
def test_pool_switched_to_an_unlisted_runtime_class_is_refused(region: Region) -> None:
    """A pool made under gVisor, then patched to a RuntimeClass of the attacker's choosing:
    the update is refused as a new pool would be."""
    assert region.create(envpool("switched", "gvisor")) is None
    assert refused_in_time(region, envpool("probe", "runc")) is not None  # the policy is live
    patch = {"spec": {"template": {"runtimeClassName": "runc-unconfined"}}}
    with pytest.raises(ApiException) as refused:
        region.kube.merge_patch(Ref(API_VERSION, "EnvPool", "switched", region.namespace), patch)
    assert refused.value.status == 422
    assert "spec.template.runtimeClassName" in json.loads(refused.value.body)["message"]


@pytest.mark.attack("sandbox")
def test_pool_with_an_unlisted_runtime_class_gets_the_condition_and_no_pods(
    region: Region,
) -> None:
    """A pool stored before the policy (or before the allowlist narrowed), under runc: the
    region operator runs no session server for it, and says why on the pool, naming the
    field, with a Warning event."""
    events = region.reconcile("stored-before")
    assert region.get("Deployment", "stored-before-sandbox", "apps/v1") is None
    pool = region.get("EnvPool", "stored-before", API_VERSION)
    (ready,) = [c for c in pool["status"]["conditions"] if c["type"] == "Ready"]
    assert (ready["status"], ready["reason"]) == ("False", "InvalidSpec"), ready
    assert ready["message"].startswith("spec.template.runtimeClassName: 'runc'"), ready
    assert [(e.type, e.reason) for e in events] == [("Warning", "InvalidSpec")]
    assert "spec.template.runtimeClassName" in events[0].message
    assert region.reconcile("stored-before") == []  # said once, not every resync


@pytest.mark.attack("sandbox")
def test_pool_image_from_an_unlisted_registry_gets_no_pods(region: Region) -> None:
    """With the chart's registry allowlist set, a pool whose image comes from elsewhere
    (stored before the list was set) runs nothing, and says why, naming the field."""
    documents = chart(
        region.operator_namespace, "--set-json", 'envPoolImageRegistries=["ghcr.io/rlfleet"]'
    )
    config = operator_config(documents)
    pool = envpool("elsewhere", "gvisor", image="ghcr.io/rlfleet-lookalike/env-sandbox:1")
    assert region.create(pool) is None  # the bed's policy lists no registries
    events = region.reconcile("elsewhere", config)
    assert region.get("Deployment", "elsewhere-sandbox", "apps/v1") is None
    assert [e.reason for e in events] == ["InvalidSpec"]
    assert events[0].message.startswith("spec.template.image: 'ghcr.io/rlfleet-lookalike/")


def selects(selector: dict, labels: dict[str, str]) -> bool:
    """A Kubernetes label selector's verdict on `labels`."""
    if any(labels.get(key) != value for key, value in selector.get("matchLabels", {}).items()):
        return False
    for expression in selector.get("matchExpressions", []):
        key, values = expression["key"], expression.get("values", [])
        verdict = {
            "In": key in labels and labels[key] in values,
            "NotIn": key not in labels or labels[key] not in values,
            "Exists": key in labels,
            "DoesNotExist": key not in labels,
        }[expression["operator"]]
        if not verdict:
            return False
    return True


def admits(policy: dict, namespace: dict, pod_labels: dict[str, str], port: int) -> bool:
    """Whether the NetworkPolicy lets a pod (its labels, and its namespace as the API
    server holds it) connect to the pods it selects on `port`, by the API's rules: a peer
    with a podSelector alone means pods of the policy's namespace; with both selectors,
    pods so labelled in namespaces so labelled."""
    spec = policy["spec"]
    for rule in spec.get("ingress", []):
        ports = rule.get("ports")
        if ports and not any(p.get("port") in (None, port) for p in ports):
            continue
        for peer in rule.get("from") or [{"namespaceSelector": {}}]:
            if "namespaceSelector" in peer:
                in_namespace = selects(peer["namespaceSelector"], namespace["metadata"]["labels"])
            else:
                in_namespace = namespace["metadata"]["name"] == policy["metadata"]["namespace"]
            if in_namespace and selects(peer.get("podSelector", {}), pod_labels):
                return True
    return False


@pytest.mark.attack("sandbox")
def test_network_policy_admits_only_the_pools_rollout_pods(region: Region) -> None:
    """Who may open a connection to a pool's session servers: the rollout pods of the runs
    that name the pool, and the region operator's pod (its /healthz reads); not any pod of
    the operator's namespace, nor another run's rollout pods, nor a pod that wears a
    rollout pod's labels in another namespace, nor anything on another port."""
    run = yaml.safe_load((ROOT / "examples" / "rlrun.yaml").read_text())
    for name, names_pool in (("solver", POOL), ("bystander", "another-pool")):
        run["metadata"] = {"name": name, "namespace": region.namespace, "uid": f"{name}-uid"}
        run["spec"]["rollout"]["envPool"] = names_pool
        region.kube.apply(mirror(run, "hub", None) | {"apiVersion": API_VERSION})
    assert region.create(envpool(POOL, "gvisor")) is None
    region.reconcile(POOL)
    policy = region.get("NetworkPolicy", f"{POOL}-sandbox", "networking.k8s.io/v1")
    assert policy is not None
    pods, operators = (
        region.kube.get(Ref("v1", "Namespace", n))
        for n in (region.namespace, region.operator_namespace)
    )
    pool_spec = InferencePoolSpec.model_validate(
        yaml.safe_load((ROOT / "examples" / "inferencepool.yaml").read_text())["spec"]
    )

    def rollout_labels(name: str) -> dict[str, str]:
        mirrored = region.kube.get(Ref(API_VERSION, "RLRun", name, region.namespace))
        deployment = rollout_deployment(
            mirrored, "chat-prod", pool_spec, 1, "img", Workloads(), REGION
        )
        return deployment["spec"]["template"]["metadata"]["labels"]

    (operator,) = [d for d in region.documents if d["kind"] == "Deployment"]
    operator_labels = operator["spec"]["template"]["metadata"]["labels"]
    port = ENVPOOL_PORT
    assert admits(policy, pods, rollout_labels("solver"), port)
    assert admits(policy, operators, operator_labels, port)
    assert not admits(policy, pods, rollout_labels("solver"), port + 1)
    assert not admits(policy, pods, rollout_labels("bystander"), port)
    assert not admits(policy, operators, {"app": "debug-shell"}, port)
    assert not admits(policy, operators, operator_labels | {"rlfleet.io/role": "hub"}, port)
    assert not admits(policy, operators, rollout_labels("solver"), port)
    assert not admits(
        policy, pods, {"rlfleet.io/envpool": POOL, "rlfleet.io/component": "sandbox"}, port
    )
