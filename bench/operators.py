"""Benchmark: the operator on the four-cluster bed.

- apply_to_running_seconds: `kubectl apply` of examples/rlrun.yaml in the hub until its
  rollout pods run on lent GPUs in all three regions.
- reclaim_seconds: a traffic spike on region-b's pool (through its metrics endpoint) until
  serving is back to its whole size with no rollout pod left; against the pool's
  reclaim_deadline_seconds.
- reconcile_p50/p99_seconds: the operators' own reconcile-duration histograms (every kind,
  all four clusters) with 50 RLRuns and 12 InferencePools, after a spec change to every run;
  spec_to_status_p50/p99_seconds: from that change to the run's status showing it.
- kube_call_p50/p99_seconds and kube_calls_per_reconcile: from the operators' traces over
  the same window, what a reconcile's time is made of (calls times their latency).

Prints one JSON object. `--quick` measures the same with 2 RLRuns and 6 InferencePools,
to check the script.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
import urllib.request
import uuid
from pathlib import Path

import yaml

from rlfleet.testbed.bed import Bed
from rlfleet.testbed.fleet import GVISOR, HUB, Fleet, TrafficServer, serving_deployment
from rlfleet.testbed.traces import Span, TraceReceiver

ROOT = Path(__file__).resolve().parent.parent
REGIONS = ["region-a", "region-b", "region-c"]
RUNS = 50
POOLS_PER_REGION = 4  # 12 in all
RECLAIM_DEADLINE_S = 20
SETTLE_S = 10  # before and after the measured window: every object reconciled a few times
QUICK = {"RUNS": 2, "POOLS_PER_REGION": 2, "SETTLE_S": 2}  # still a run on a batch pool


def wait(check, timeout: float = 180.0, interval: float = 0.1) -> float:
    started = time.monotonic()
    while not check():
        if time.monotonic() - started > timeout:
            raise TimeoutError(check)
        time.sleep(interval)
    return time.monotonic() - started


def quantile_from_histogram(buckets: list[tuple[float, float]], q: float) -> float:
    """Prometheus' histogram_quantile over cumulative (upper bound, count) buckets."""
    total = buckets[-1][1]
    rank = q * total
    lower_bound, lower_count = 0.0, 0.0
    for bound, count in buckets:
        if count >= rank:
            if bound == float("inf"):
                return lower_bound
            share = (rank - lower_count) / max(count - lower_count, 1e-9)
            return lower_bound + (bound - lower_bound) * share
        lower_bound, lower_count = bound, count
    return lower_bound


def reconcile_buckets(ports: dict[str, int]) -> dict[str, list[tuple[float, float]]]:
    """Cumulative buckets per "<role> <kind>" (hub or region), and "all"."""
    summed: dict[str, dict[float, float]] = {}
    for cluster, port in ports.items():
        role = "hub" if cluster == HUB else "region"
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
            for line in response.read().decode().splitlines():
                if line.startswith("rlfleet_operator_reconcile_seconds_bucket"):
                    kind = line.split('kind="', 1)[1].split('"', 1)[0]
                    le = line.split('le="', 1)[1].split('"', 1)[0]
                    bound = float("inf") if le == "+Inf" else float(le)
                    count = float(line.rsplit(" ", 1)[1])
                    for key in (f"{role} {kind}", "all"):
                        buckets = summed.setdefault(key, {})
                        buckets[bound] = buckets.get(bound, 0.0) + count
    return {key: sorted(buckets.items()) for key, buckets in summed.items()}


def minus(after: dict, before: dict) -> dict:
    windows = {}
    for key, buckets in after.items():
        earlier = dict(before.get(key, []))
        windows[key] = [(bound, count - earlier.get(bound, 0.0)) for bound, count in buckets]
    return windows


def call_breakdown(spans: list[Span]) -> dict:
    """Kubernetes call latency, and calls per reconcile by "<role> <kind>", from spans."""
    by_id = {s.span_id: s for s in spans}

    def reconcile_of(span: Span) -> Span | None:
        while span.parent_id in by_id:
            span = by_id[span.parent_id]
        return span if span.name.startswith("reconcile ") else None

    def key(reconcile: Span) -> str:
        return f"{reconcile.service.rsplit('-', 1)[-1]} {reconcile.name.split(' ', 1)[1]}"

    calls = [s for s in spans if s.name.startswith("kube ")]
    reconciles: dict[str, int] = {}
    for span in spans:
        if span.name.startswith("reconcile "):
            reconciles[key(span)] = reconciles.get(key(span), 0) + 1
    counted: dict[str, int] = {}
    for call in calls:
        if (reconcile := reconcile_of(call)) is not None:
            counted[key(reconcile)] = counted.get(key(reconcile), 0) + 1
    seconds = sorted(c.seconds for c in calls) or [0.0]
    return {
        "kube_calls": len(calls),
        "kube_call_p50_seconds": round(seconds[len(seconds) // 2], 4),
        "kube_call_p99_seconds": round(seconds[min(len(seconds) - 1, int(0.99 * len(seconds)))], 4),
        "kube_calls_per_reconcile": {
            k: round(counted.get(k, 0) / n, 2) for k, n in sorted(reconciles.items())
        },
    }


class Bench:
    def __init__(
        self, fleet: Fleet, namespace: str, traffic: TrafficServer, traces: TraceReceiver
    ) -> None:
        self.fleet, self.ns, self.traffic, self.traces = fleet, namespace, traffic, traces

    def items(self, cluster: str, *what: str) -> list[dict]:
        out = self.fleet.kubectl(cluster, "-n", self.ns, "get", *what, "-o", "json")
        return json.loads(out)["items"]

    def apply(self, cluster: str, document: dict) -> None:
        self.fleet.kubectl(cluster, "-n", self.ns, "apply", "-f", "-", stdin=json.dumps(document))

    def running(self, cluster: str, selector: str) -> int:
        return sum(
            1
            for p in self.items(cluster, "pods", "-l", selector)
            if p["status"].get("phase") == "Running" and not p["metadata"].get("deletionTimestamp")
        )

    def pool(self, region: str, name: str, replicas: int, gpus: int) -> None:
        self.apply(region, serving_deployment(name, replicas, gpus))
        document = yaml.safe_load((ROOT / "examples" / "inferencepool.yaml").read_text())
        document["metadata"]["name"] = name
        spec = document["spec"]
        spec["serving"] |= {"deploymentName": name, "replicas": replicas, "gpusPerReplica": gpus}
        spec["traffic"]["metricsUrl"] = self.traffic.url(f"{region}-{name}")
        spec["reclaimDeadlineSeconds"] = RECLAIM_DEADLINE_S
        self.traffic.load[f"{region}-{name}"] = 0.0
        self.apply(region, document)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smallest sizes: check the script")
    if parser.parse_args().quick:
        globals().update(QUICK)
    with tempfile.TemporaryDirectory(prefix="rlfleet-bench-operator-") as state:
        bed = Bed(Path(state) / "bed", attached=True)
        info = bed.start()
        namespace = f"bench-{uuid.uuid4().hex[:6]}"
        fleet = Fleet(info, Path(state), [namespace], REGIONS)
        fleet.values = {"regionTimeoutSeconds": 10}  # the chart's default resync: 2 s
        traffic = TrafficServer()
        traces = TraceReceiver()
        fleet.operator_env = traces.env
        try:
            for cluster in [HUB, *REGIONS]:
                fleet.kubectl(cluster, "apply", "--server-side", "-f", str(ROOT / "crds"))
                fleet.kubectl(cluster, "create", "namespace", namespace)
            fleet.setup()
            bench = Bench(fleet, namespace, traffic, traces)
            for region in REGIONS:
                fleet.kubectl(region, "apply", "-f", "-", stdin=json.dumps(GVISOR))
                bench.pool(region, "chat-prod", replicas=4, gpus=8)
            fleet.start_all()
            result = measure(bench, fleet)
        finally:
            fleet.stop()
            traffic.close()
            traces.close()
            bed.stop()
    print(json.dumps({"bench": "operator", **result}))


def measure(bench: Bench, fleet: Fleet) -> dict:
    run = "tiny-moe-arith"
    selector = f"rlfleet.io/run={run},rlfleet.io/component=rollout"
    lent = {"region-a": 2, "region-b": 2, "region-c": 1}
    started = time.monotonic()
    fleet.kubectl(HUB, "-n", bench.ns, "apply", "-f", str(ROOT / "examples" / "rlrun.yaml"))
    wait(lambda: all(bench.running(r, selector) == n for r, n in lent.items()), interval=0.05)
    apply_to_running = time.monotonic() - started

    bench.traffic.load["region-b-chat-prod"] = 200.0
    reclaim = wait(
        lambda: (
            bench.running("region-b", "app=chat-prod") == 4
            and bench.running("region-b", selector) == 0
        ),
        interval=0.05,
    )
    bench.traffic.load["region-b-chat-prod"] = 0.0

    # Scale: 12 pools (the three above and three more per region) and 50 runs, by default.
    for region in REGIONS:
        for index in range(1, POOLS_PER_REGION):
            bench.pool(region, f"batch-{index}", replicas=2, gpus=1)
    example = yaml.safe_load((ROOT / "examples" / "rlrun.yaml").read_text())
    for index in range(1, RUNS):
        document = json.loads(json.dumps(example))
        document["metadata"]["name"] = f"run-{index:02d}"
        for demand in document["spec"]["rollout"]["regions"]:
            pool = f"batch-{1 + index % (POOLS_PER_REGION - 1)}"
            demand |= {"minGpus": 0, "maxGpus": 2, "inferencePools": [pool]}
        bench.apply(HUB, document)
    names = [run] + [f"run-{i:02d}" for i in range(1, RUNS)]
    wait(
        lambda: (
            all(
                (r.get("status") or {}).get("observedGeneration") == r["metadata"]["generation"]
                for r in bench.items(HUB, "rlruns")
            )
            and len(bench.items(HUB, "rlruns")) == RUNS
        ),
        timeout=600,
        interval=1.0,
    )
    time.sleep(SETTLE_S)
    ports = dict(fleet.metrics_ports)
    before = reconcile_buckets(ports)
    first_span = len(bench.traces.spans)
    changed_at = {}
    for name in names:
        patch = {"spec": {"maxStaleness": 3}}
        fleet.kubectl(
            HUB, "-n", bench.ns, "patch", "rlrun", name, "--type=merge", "-p", json.dumps(patch)
        )
        changed_at[name] = time.monotonic()
    seen: dict[str, float] = {}
    deadline = time.monotonic() + 300
    while len(seen) < len(names) and time.monotonic() < deadline:
        for item in bench.items(HUB, "rlruns"):
            name = item["metadata"]["name"]
            if (
                name not in seen
                and (item.get("status") or {}).get("observedGeneration")
                == item["metadata"]["generation"]
            ):
                seen[name] = time.monotonic() - changed_at[name]
        time.sleep(0.2)
    time.sleep(SETTLE_S)
    windows = minus(reconcile_buckets(ports), before)
    spans = bench.traces.spans[first_span:]
    window = windows.pop("all")
    lags = sorted(seen.values())
    return {
        "apply_to_running_seconds": round(apply_to_running, 2),
        "reclaim_seconds": round(reclaim, 2),
        "reclaim_deadline_seconds": RECLAIM_DEADLINE_S,
        "runs": RUNS,
        "inference_pools": POOLS_PER_REGION * len(REGIONS),
        "reconciles_measured": int(window[-1][1]),
        "reconcile_p50_seconds": round(quantile_from_histogram(window, 0.5), 4),
        "reconcile_p99_seconds": round(quantile_from_histogram(window, 0.99), 4),
        "reconcile_p99_seconds_by_kind": {
            key: round(quantile_from_histogram(buckets, 0.99), 4)
            for key, buckets in sorted(windows.items())
            if buckets[-1][1] > 0
        },
        "reconciles_by_kind": {key: int(b[-1][1]) for key, b in sorted(windows.items())},
        "spec_to_status_p50_seconds": round(statistics.median(lags), 3),
        "spec_to_status_p99_seconds": round(lags[min(len(lags) - 1, int(0.99 * len(lags)))], 3),
        "status_missing": len(names) - len(seen),
        **call_breakdown(spans),
    }


if __name__ == "__main__":
    main()
