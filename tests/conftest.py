"""Session fixtures: one real four-cluster bed with NATS, shared by every test that needs it,
and a NATS hub with one leaf node alone, for tests that restart servers."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
import tiers
from object_store import ObjectStore
from probe_runs import run_probe
from prometheus_client.parser import text_string_to_metric_families
from xdist.scheduler import LoadScopeScheduling

import images
from rlfleet.api.schema import KINDS
from rlfleet.api.wire import EvaluationReport, StepReport
from rlfleet.bus.streams import run_stream_configs
from rlfleet.launch.caches import CACHE_ROOT_ENV, own_caches
from rlfleet.local.binaries import binary
from rlfleet.local.nats import StandaloneNats
from rlfleet.testbed.bed import Bed, BedInfo
from rlfleet.testbed.kube import audit_log
from rlfleet.testbed.rbac import bed_usage

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent
CLUSTERS = ("hub", "region-a", "region-b", "region-c")


@pytest.fixture(scope="session", autouse=True)
def session_caches(tmp_path_factory: pytest.TempPathFactory, worker_id: str) -> Path:
    """The session's compile caches, under a folder it owns (`rlfleet.launch.caches`): every
    process a test starts inherits them, and nothing is read from, or left in, the user's
    shared defaults. The workers of a parallel run share one, as a machine's processes
    share the defaults, so that each kernel and each model's inspection is made once. A
    test that must own a root of its own drops `CACHE_ROOT_ENV`."""
    if worker_id == "master":
        root = tmp_path_factory.mktemp("caches")
    else:
        root = tmp_path_factory.getbasetemp().parent / "caches"
        root.mkdir(exist_ok=True)
    os.environ.pop(CACHE_ROOT_ENV, None)  # the session owns its root whoever started it
    own_caches(root)
    return root


BED_LOGS = pytest.StashKey[Path]()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Each test marked with its folder's tier (`tiers`), each module kept whole and in
    order. Alone, the tiers run cheapest first: the bed starts at the first test that needs
    it and lives to the session's end, and idle it still takes about 8 % of this 2-core
    machine, which every test after its start would share. In a parallel run each worker
    takes whole units (`tiers.work_unit`), the bed's first."""
    misplaced = []
    parallel = hasattr(config, "workerinput")  # a worker of `pytest -n`
    for item in items:
        tier = tiers.tier_of(item.path, TESTS)
        if tier is None:
            misplaced.append(f"{item.nodeid}: not in a tier's folder {tiers.TIERS}")
            continue
        item.add_marker(tier)
        if wrong := tiers.too_low(tier, item.fixturenames):
            misplaced.append(f"{item.nodeid}: in {tier}/, but {wrong} start a higher tier's")
    if misplaced:
        raise pytest.UsageError("tests outside their tier:\n" + "\n".join(misplaced))
    order = tiers.PARALLEL_ORDER if parallel else tiers.TIERS
    items.sort(key=lambda item: order.index(tiers.tier_of(item.path, TESTS)))


class WorkUnits(LoadScopeScheduling):
    """A parallel run's workers take whole units (`tiers.work_unit`) in the order the
    workers collected them (`make test` asks xdist not to reorder them)."""

    def _split_scope(self, nodeid: str) -> str:
        return tiers.work_unit(nodeid)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log) -> LoadScopeScheduling:
    return WorkUnits(config, log)


_started_in_unit: list[str] = []
_watching_unit = False


def _record_servers(event: str, args: tuple) -> None:
    """An audit hook: what a unit test's subprocesses start that a unit test must not."""
    if not _watching_unit or event not in ("subprocess.Popen", "os.posix_spawn", "os.exec"):
        return
    argv = args[1]
    argv = argv.split() if isinstance(argv, str | bytes) else list(argv or [])
    if started := tiers.server_in([a.decode() if isinstance(a, bytes) else a for a in argv]):
        _started_in_unit.append(started)


sys.addaudithook(_record_servers)


@pytest.fixture(autouse=True)
def unit_tests_start_no_server(request: pytest.FixtureRequest) -> Iterator[None]:
    """A test in tests/unit/ fails if it starts a server, an engine or a cluster: the inner
    loop must run on Python alone, in minutes."""
    global _watching_unit
    if request.node.get_closest_marker("unit") is None:
        yield
        return
    _started_in_unit.clear()
    _watching_unit = True
    try:
        yield
    finally:
        _watching_unit = False
    if _started_in_unit:
        pytest.fail(f"a unit test started {sorted(set(_started_in_unit))}: move it to its tier")


@pytest.fixture(scope="session")
def testbed(tmp_path_factory: pytest.TempPathFactory, pytestconfig: pytest.Config) -> Iterator[Bed]:
    """The bed with its processes' supervisor, for tests that kill and restart them."""
    started = Bed(tmp_path_factory.mktemp("bed"), attached=True)
    pytestconfig.stash[BED_LOGS] = started.supervisor.log_dir
    if hasattr(pytestconfig, "workeroutput"):  # a worker's: for the summary the run prints
        pytestconfig.workeroutput["bed_logs"] = str(started.supervisor.log_dir)
    started.start()
    try:
        yield started
    finally:
        started.stop()


@pytest.fixture(scope="session")
def bed(testbed: Bed) -> BedInfo:
    assert testbed.info is not None
    return testbed.info


@pytest.fixture(scope="session")
def nats_servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[StandaloneNats]:
    servers = StandaloneNats(tmp_path_factory.mktemp("nats-servers"))
    try:
        yield servers
    finally:
        servers.stop()


@pytest.fixture(scope="session")
def object_store(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ObjectStore]:
    store = ObjectStore(tmp_path_factory.mktemp("object-store"))
    try:
        yield store
    finally:
        store.stop()


@pytest.fixture(scope="session")
def image_environments(tmp_path_factory: pytest.TempPathFactory) -> images.Environments:
    return images.Environments(tmp_path_factory.mktemp("images"))


def rules_suite(path: Path, tasks: int) -> Path:
    """The first `tasks` of the shipped rules suite, written to `path`: a suite a run's
    whole-suite evaluations get through in seconds."""
    rules = ROOT / "rollout" / "rlfleet" / "rollout" / "environment" / "suites" / "rules.jsonl"
    path.write_text("".join(rules.read_text().splitlines(keepends=True)[:tasks]))
    return path


def run_streams(key: str) -> list[str]:
    """Every stream a run has on the hub."""
    return [config.name for config in run_stream_configs(key)]


def step_report(run: str, version: int, finished_at: float, dropped_stale: int) -> StepReport:
    """A trainer's report of the step that made `version`, as it publishes one."""
    return StepReport(
        run=run,
        step=version,
        policy_version=version,
        trajectories=["g1/0", "g1/1"],
        groups=1,
        tokens=96,
        reward_mean=0.5,
        loss=0.1,
        staleness_mean=1.0,
        staleness_max=2,
        mismatch_mean_abs=0.0,
        mismatch_max_abs=0.0,
        mismatch_kl=0.0,
        clipped_fraction=0.0,
        dropped_stale_total=dropped_stale,
        rejected_total=0,
        step_seconds=1.0,
        finished_at=finished_at,
        weight_bytes=12345,
        weight_seconds=0.25,
    )


def evaluation_report(
    version: int, reward: float, finished_at: float, pass_at_k: float = 0.7
) -> EvaluationReport:
    """The evaluator's report on `version`, as it publishes one."""
    return EvaluationReport(
        run="r",
        suite="rules",
        policy_version=version,
        reward=reward,
        pass_at_k=pass_at_k,
        attempts=8,
        tasks=80,
        finished_at=finished_at,
    )


def wait_for(what: str, check, timeout: float = 90.0, interval: float = 0.5):
    """Polls check until it returns something true, and returns that."""
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        last = check()
        if last:
            return last
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout}s waiting for {what} (last: {last!r})")


def scrape(url: str) -> dict[str, float]:
    """A Prometheus endpoint's samples, as a scraper reads them: name{labels} -> value
    (labels in the order served, `name` alone when there are none)."""
    with urllib.request.urlopen(url, timeout=5) as response:
        text = response.read().decode()
    samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sample.labels.items())
            samples[f"{sample.name}{{{labels}}}" if labels else sample.name] = sample.value
    return samples


class Kubectl:
    """The real kubectl against one context of the bed's merged kubeconfig."""

    def __init__(self, kubeconfig: Path, cache_dir: Path) -> None:
        self.kubeconfig = kubeconfig
        self.cache_dir = cache_dir
        self.path = binary("kubectl")

    def forget_discovery(self) -> None:
        """kubectl caches API discovery; new CRDs are not seen by category until it is dropped."""
        shutil.rmtree(self.cache_dir, ignore_errors=True)

    def run(
        self, context: str, *args: str, stdin: str | None = None, check: bool = True
    ) -> subprocess.CompletedProcess[str]:
        result = subprocess.run(
            [
                self.path,
                f"--kubeconfig={self.kubeconfig}",
                f"--cache-dir={self.cache_dir}",
                f"--context={context}",
                *args,
            ],
            input=stdin,
            capture_output=True,
            text=True,
            timeout=120,
        )
        if check and result.returncode != 0:
            raise AssertionError(f"kubectl {' '.join(args)} failed:\n{result.stderr}")
        return result


@pytest.fixture(scope="session")
def kubectl(bed: BedInfo) -> Kubectl:
    return Kubectl(bed.kubeconfig, bed.state_dir / "kubectl-cache")


@pytest.fixture(scope="session")
def crds_installed(kubectl: Kubectl) -> None:
    for context in CLUSTERS:
        kubectl.run(context, "apply", "--server-side", "-f", str(ROOT / "crds"))
    for context in CLUSTERS:
        kubectl.run(
            context,
            "wait",
            "--for=condition=Established",
            "--timeout=60s",
            *(f"crd/{kind.crd_name}" for kind in KINDS),
        )
    kubectl.forget_discovery()


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error: object | None) -> None:
    """A parallel run's worker is done: where its bed's logs are, if it started the bed."""
    if logs := getattr(node, "workeroutput", {}).get("bed_logs"):
        node.config.stash[BED_LOGS] = Path(logs)


def pytest_terminal_summary(terminalreporter, config: pytest.Config) -> None:
    """Which of the chart's RBAC grants the operators used in this session's bed
    (`rlfleet.testbed.rbac`): those unused are ones no test needed."""
    logs = config.stash.get(BED_LOGS, None)
    if logs is None or not any(logs.glob(f"{audit_log(Path(), '*').stem}*.log")):
        return
    terminalreporter.section("RBAC grants the operators used")
    try:
        usage = bed_usage(logs)
    except Exception as error:  # a report: it must not turn the session's outcome
        terminalreporter.write_line(f"not read: {error!r}")
        return
    for role, (granted, unused) in usage.items():
        terminalreporter.write_line(f"{role}: {granted - len(unused)} of {granted} used")
        for grant in unused:
            terminalreporter.write_line(f"  unused: {grant}")


@pytest.fixture(scope="session")
def tiny_moe(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny MoE as `rlfleet model init` makes it."""
    directory = tmp_path_factory.mktemp("tiny-moe")
    init = ["model", "init", "--kind", "tiny-moe", str(directory)]
    subprocess.run([sys.executable, "-m", "rlfleet.cli", *init], check=True)
    return directory


@pytest.fixture(scope="session")
def vllm_probe(tiny_moe: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """What one vLLM engine, made as a rollout worker makes it, did with the tiny MoE
    (`probes/vllm_engine.py`): the tests of its experts, log-probs and prefill share it."""
    return run_probe("vllm_engine.py", tiny_moe, tmp_path_factory.mktemp("vllm"))
