"""The hub role: an RLRun becomes trainer objects here and a mirror in each named region.

`reconcile` is level-driven: it applies what the spec wants (server-side apply, so running
it again changes nothing), reads back what each region reports on its mirror and returns
the whole new status with the events worth telling the on-call engineer. A region that
does not answer keeps its last report, marked unreachable, and after
`region_timeout_seconds` the run says so (`RegionUnreachable`); training goes on with
the others, and when the region answers again the mirror is applied once more, which
updates it in place rather than making another.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from datetime import datetime
from functools import partial

from kubernetes.client.exceptions import ApiException

from rlfleet import launch
from rlfleet.api.meta import API_VERSION
from rlfleet.api.rlrun import RLRunSpec
from rlfleet.operator import gate, progress
from rlfleet.operator.config import OperatorConfig
from rlfleet.operator.dataplane import DataPlane, DataPlaneUnavailable
from rlfleet.operator.kube import Kube, Ref, Unreachable
from rlfleet.operator.parallel import at_once
from rlfleet.operator.regions import RegionClients, RegionCredentials
from rlfleet.operator.status import Event, condition, is_present, now, parse_time, timestamp
from rlfleet.operator.workloads import (
    COMPONENT_LABEL,
    ORIGIN_LABEL,
    evaluator_name,
    hub_objects,
    mints_users,
    mirror,
    nats_key,
    nats_user_secret,
)

log = logging.getLogger(__name__)

# While a region answers, its lastSeen is rewritten at most this often: a resync that
# learns nothing new then writes nothing. Silence is timed from the last answer in memory.
LAST_SEEN_REFRESH_S = 60


@dataclass
class Outcome:
    status: dict
    events: list[Event] = field(default_factory=list)


@dataclass
class RegionReport:
    name: str
    reachable: bool
    entry: dict  # the run's status.regions entry for this region
    problem: str = ""  # why it is not reachable: credentials or the network
    credentials: bool = False  # the problem is the kubeconfig Secret, not the network


def _mirror_ref(run: dict) -> Ref:
    meta = run["metadata"]
    return Ref(API_VERSION, "RLRun", meta["name"], meta["namespace"])


class Hub:
    def __init__(
        self,
        local: Kube,
        regions: RegionClients,
        config: OperatorConfig,
        dataplane: DataPlane | None = None,
    ) -> None:
        self.local = local
        self.regions = regions
        self.config = config
        self.dataplane = dataplane
        # (run uid, its regions) whose streams and weight mirrors all exist
        self._streams: set[tuple[str, tuple[str, ...]]] = set()
        self._answered: dict[tuple[str, str], datetime] = {}  # (run uid, region) -> last answer
        self._users: dict[str, str] = {}  # run uid -> the NATS user (.creds) minted for it
        self._placed: set[tuple[str, str]] = set()  # (run uid, cluster) holding its Secret

    def _nats_user(self, run: dict) -> str | None:
        """The run's own NATS user, minted once per operator process and written to the
        hub's Secret unless one is there (its pods may hold that one: both stay valid).
        None without NATS users, or when none can be made (the pods wait for the Secret)."""
        meta = run["metadata"]
        if self.dataplane is None or not mints_users(self.config.nats):
            return None
        if meta["uid"] not in self._users:
            try:
                self._users[meta["uid"]] = self.dataplane.run_user(nats_key(run))
            except DataPlaneUnavailable as error:
                log.warning("run %s/%s: %s", meta["namespace"], meta["name"], error)
                return None
        credentials = self._users[meta["uid"]]
        self._place_user(self.local, run, self.config.cluster, credentials, owned=True)
        return credentials

    def _place_user(
        self, kube: Kube, run: dict, cluster: str, credentials: str | None, owned: bool
    ) -> None:
        """Creates the run's NATS user Secret in a cluster, once per operator process."""
        key = (run["metadata"]["uid"], cluster)
        if credentials is not None and key not in self._placed:
            kube.create(nats_user_secret(run, credentials, owned))
            self._placed.add(key)

    def _report(
        self, run: dict, region: str, previous: dict, resync: bool, held: bool, user: str | None
    ) -> RegionReport:
        try:
            kube = self.regions.client(region)
            self._place_user(kube, run, region, user, owned=False)
            # A resync reads the mirror; it writes only what is missing, was out of reach,
            # or is held (or let go) since.
            wanted = mirror(run, self.config.cluster, self.config.nats, held)
            found = self._listed_mirror(kube, run) if resync and previous.get("reachable") else None
            if found is None or found["spec"].get("suspend") != wanted["spec"].get("suspend"):
                found = kube.apply(wanted)
        except RegionCredentials as error:
            return RegionReport(region, False, previous, str(error), credentials=True)
        except ApiException as error:
            if error.status not in (401, 403):
                raise
            problem = f"region {region} refused the hub's credentials ({error.status})"
            return RegionReport(region, False, previous, problem, credentials=True)
        except Unreachable as error:
            return RegionReport(region, False, previous, str(error))
        reported = next(
            (e for e in found.get("status", {}).get("regions", []) if e.get("name") == region),
            {},
        )
        entry = {"requested": 0, "lent": 0, "running": 0} | reported
        self._answered[(run["metadata"]["uid"], region)] = moment = now()
        seen = parse_time(previous.get("lastSeen"))
        recent = seen and (moment - seen).total_seconds() < LAST_SEEN_REFRESH_S
        last_seen = previous["lastSeen"] if recent and previous.get("reachable") else timestamp()
        return RegionReport(region, True, entry | {"name": region, "lastSeen": last_seen})

    def _fresh_s(self) -> float:
        return self.config.run_resync_seconds / 2

    def _listed_mirror(self, kube: Kube, run: dict) -> dict | None:
        """The run's mirror from a recent list of all this hub's mirrors in the namespace."""
        meta = run["metadata"]
        mirrors = kube.list_recent(
            Ref(API_VERSION, "RLRun", namespace=meta["namespace"]),
            f"{ORIGIN_LABEL}={self.config.cluster}",
            self._fresh_s(),
        )
        return next((m for m in mirrors if m["metadata"]["name"] == meta["name"]), None)

    def _progress(
        self, run: dict, spec: RLRunSpec, training: bool, events: list[Event]
    ) -> progress.Progress | None:
        """Makes the run's streams once (again when its regions change) and folds its
        trainer's newest step report; None when there is no NATS to ask or no answer."""
        if self.dataplane is None:
            return None
        meta, old = run["metadata"], run.get("status") or {}
        key, regions = nats_key(run), tuple(r.name for r in spec.rollout.regions)
        try:
            made = (meta["uid"], regions) in self._streams
            if not made and not self.dataplane.ensure_streams(key, list(regions)):
                self._streams.add((meta["uid"], regions))
            report = self.dataplane.last_step(key)
        except DataPlaneUnavailable as error:
            log.warning("run %s/%s: %s", meta["namespace"], meta["name"], error)
            return None
        was = next((c for c in old.get("conditions", []) if c["type"] == "Training"), {})
        since = parse_time(was.get("lastTransitionTime")) if was.get("status") == "True" else None
        moment = now()
        found = progress.fold(
            report, spec, old, (since or moment) if training else None, moment, meta["generation"]
        )
        events += found.events
        return found

    def _forget(self, run: dict, region: str) -> bool:
        """Deletes the run's mirror in a region; False if the region could not be reached."""
        if region not in self.regions.access:
            return True  # never configured, so the hub never mirrored anything there
        try:
            kube = self.regions.client(region)
            kube.delete(_mirror_ref(run))
            secret = launch.nats_credentials_secret(run["metadata"]["name"])
            kube.delete(Ref("v1", "Secret", secret, run["metadata"]["namespace"]))
        except (RegionCredentials, Unreachable):
            return False
        self._placed.discard((run["metadata"]["uid"], region))
        return True

    def _listed(self, ref: Ref, component: str) -> dict | None:
        """A run's object from a recent list of its namespace's objects of that component."""
        kind = Ref(ref.api_version, ref.kind, namespace=ref.namespace)
        found = self.local.list_recent(kind, f"{COMPONENT_LABEL}={component}", self._fresh_s())
        return next((o for o in found if Ref.of(o) == ref), None)

    def _verdict(self, run: dict, spec: RLRunSpec) -> gate.Verdict:
        """The evaluation gate's verdict on the evaluator's newest report; without NATS,
        on the last one the status holds."""
        meta, old = run["metadata"], run.get("status") or {}
        report = None
        if spec.evaluation is not None and self.dataplane is not None:
            try:
                report = self.dataplane.last_evaluation(nats_key(run))
            except DataPlaneUnavailable as error:
                log.warning("run %s/%s: %s", meta["namespace"], meta["name"], error)
        return gate.judge(report, spec, old, meta.get("generation", 0))

    def _drifted(self, objects: list[dict]) -> bool:
        """A workload of the run missing, or at other replicas than wanted (the run was
        just held or let go): what a resync puts right."""
        for manifest in objects:
            if manifest["kind"] in ("StatefulSet", "Deployment"):
                component = manifest["metadata"]["labels"][COMPONENT_LABEL]
                found = self._listed(Ref.of(manifest), component)
                if found is None or found["spec"].get("replicas") != manifest["spec"]["replicas"]:
                    return True
        return False

    def _apply_hub_objects(self, run: dict, spec: RLRunSpec, held: bool, resync: bool) -> dict:
        """The run's objects in the hub, as wanted; returns its trainer StatefulSet."""
        meta, old = run["metadata"], run.get("status") or {}
        trainer_ref = Ref("apps/v1", "StatefulSet", f"{meta['name']}-trainer", meta["namespace"])
        objects = hub_objects(run, self.config.images, self.config.nats, held)
        if resync and not self._drifted(objects):
            return self._listed(trainer_ref, "trainer") or {}
        # The objects do not refer to each other's existence (a pod waits for a missing
        # ConfigMap), so they go at once; an apply answers with the object, status too.
        applied = at_once([partial(self.local.apply, manifest) for manifest in objects])
        if spec.evaluation is None and is_present(old.get("conditions", []), "Failed"):
            # The gate was removed: its evaluator goes with it.
            evaluator = evaluator_name(meta["name"])
            self.local.delete(Ref("apps/v1", "Deployment", evaluator, meta["namespace"]))
        return next((a for a in applied if Ref.of(a) == trainer_ref), {})

    def reconcile(self, run: dict, resync: bool = False) -> Outcome:
        """The run's new status and events. `resync` (the timer) re-reads the world but
        writes only what is missing or must change; a change or a start applies
        everything."""
        spec = RLRunSpec.model_validate(run["spec"])
        meta, old = run["metadata"], run.get("status") or {}
        generation = meta.get("generation", 0)
        verdict = self._verdict(run, spec)
        held = verdict.held
        user = self._nats_user(run)
        trainer = self._apply_hub_objects(run, spec, held, resync)
        ready = trainer.get("status", {}).get("readyReplicas", 0)

        events: list[Event] = list(verdict.events)
        previous = {e["name"]: e for e in old.get("regions", [])}
        wanted = [r.name for r in spec.rollout.regions]
        reports = at_once(
            [
                partial(
                    self._report, run, name, previous.get(name, {"name": name}), resync, held, user
                )
                for name in wanted
            ]
        )
        # Regions dropped from the spec lose their mirror; one not answering is retried.
        leftover = [n for n in previous if n not in wanted and not self._forget(run, n)]
        entries, lost, refused = [], [], []
        for report in reports:
            entry = dict(report.entry)
            was_reachable = previous.get(report.name, {}).get("reachable", True)
            if report.reachable:
                entry["reachable"] = True
                if not was_reachable:
                    events.append(
                        Event("Normal", "RegionReachable", f"region {report.name} answers again")
                    )
            else:
                last_seen = (
                    self._answered.get((meta["uid"], report.name))
                    or parse_time(entry.get("lastSeen"))
                    or parse_time(meta.get("creationTimestamp"))
                )
                if last_seen:
                    entry["lastSeen"] = timestamp(last_seen)
                silent = (now() - last_seen).total_seconds() if last_seen else 0.0
                if report.credentials:
                    refused.append(report)
                    entry["reachable"] = False
                elif silent >= self.config.region_timeout_seconds:
                    entry["reachable"] = False
                    lost.append((report, silent))
                else:
                    entry["reachable"] = was_reachable  # not yet: within the timeout
                if not entry["reachable"] and was_reachable:
                    reason = (
                        "RegionCredentialsInvalid" if report.credentials else "RegionUnreachable"
                    )
                    gpus = entry.get("running", 0)
                    events.append(
                        Event(
                            "Warning",
                            reason,
                            f"region {report.name}: {report.problem}; silent {silent:.0f}s, "
                            f"its {gpus} rollout GPUs are not counted; training goes on",
                        )
                    )
            entries.append(entry)
        entries += [previous[n] | {"reachable": False} for n in leftover]

        reachable = [e for e in entries if e.get("reachable") and e["name"] in wanted]
        lent = sum(e.get("lent", 0) for e in reachable)
        running = sum(e.get("running", 0) for e in reachable)
        if lent != old.get("gpusLent") and reachable:
            detail = ", ".join(f"{e['name']} {e.get('lent', 0)}" for e in reachable)
            events.append(Event("Normal", "GPUsLent", f"{lent} rollout GPUs lent ({detail})"))

        conditions = old.get("conditions", [])
        stopped = spec.suspend or held
        training = not stopped and ready >= spec.trainer.replicas
        found = self._progress(run, spec, training, events)
        # NATS not answering this time leaves the last word on weight sync standing.
        said = next((c for c in conditions if c["type"] == "WeightSyncStalled"), None)
        synced = found.condition if found is not None else said
        stalled = synced is not None and synced["status"] == "True"
        degraded_why = [f"{r.name} unreachable for {s:.0f}s" for r, s in lost] + [
            f"{r.name}: {r.problem}" for r in refused
        ]
        below_floor = [
            f"{e['name']} runs {e.get('running', 0)} of at least {d.min_gpus} GPUs"
            for d in spec.rollout.regions
            for e in reachable
            if e["name"] == d.name
            and e.get("running", 0) < d.min_gpus
            and not stopped  # a stopped run wants no GPUs
        ]
        degraded = degraded_why + below_floor
        new_conditions = [
            condition(
                conditions,
                "Training",
                training,
                "TrainerReady" if training else "TrainerNotReady",
                f"{ready}/{0 if stopped else spec.trainer.replicas} trainer replicas ready",
                generation,
            ),
            condition(
                conditions,
                "RolloutsDegraded",
                bool(degraded),
                (
                    "RegionUnreachable"
                    if lost
                    else "RegionCredentialsInvalid"
                    if refused
                    else "BelowMinGpus"
                    if below_floor
                    else "AllRegionsServing"
                ),
                "; ".join(degraded)
                or f"{running} rollout GPUs running in {len(reachable)} regions",
                generation,
            ),
            condition(
                conditions,
                "Suspended",
                spec.suspend,
                "SpecSuspend" if spec.suspend else "NotSuspended",
                "spec.suspend is true" if spec.suspend else "",
                generation,
            ),
        ]
        if synced is not None:
            new_conditions.append(synced)
        new_conditions += verdict.conditions
        healthy = training and not degraded and running > 0 and not stalled
        new_conditions.insert(
            0,
            condition(
                conditions,
                "Ready",
                healthy,
                "Healthy" if healthy else "NotReady",
                "training with rollouts in every region"
                if healthy
                else "; ".join(
                    ([verdict.why] if held else [])
                    or degraded
                    or (["no new policy version for stallSeconds"] if stalled else [])
                    or ["waiting for the trainer or rollout GPUs"]
                ),
                generation,
            ),
        )
        phase = (
            "Failed"
            if verdict.failed
            else "Succeeded"
            if verdict.succeeded
            else "Suspended"
            if spec.suspend
            else "Running"
            if training
            else "Pending"
        )
        status = {
            "phase": phase,
            "observedGeneration": generation,
            "conditions": new_conditions,
            "trainerReplicas": ready,
            "gpusLent": lent,
            "gpusRunning": running,
            "regions": entries,
            **(found.fields if found is not None else {}),
            **verdict.fields,
        }
        return Outcome(status, events)

    def delete(self, run: dict) -> list[str]:
        """Deletes every mirror of the run, then its NATS streams (the hub's and each
        region's copy of its weights); returns what is left for a later try."""
        uid = run["metadata"]["uid"]
        named = {r["name"] for r in run["spec"]["rollout"]["regions"]}
        named |= {e["name"] for e in (run.get("status") or {}).get("regions", [])}
        for region in named:
            self._answered.pop((uid, region), None)
        self._users.pop(uid, None)
        self._placed.discard((uid, self.config.cluster))
        left = [f"its mirror in {r}" for r in sorted(named) if not self._forget(run, r)]
        if self.dataplane is not None:
            # Only regions the hub reaches: one never configured has no copy to delete.
            regions = sorted(r for r in named if r in self.regions.access)
            try:
                kept = self.dataplane.delete_streams(nats_key(run), regions)
            except DataPlaneUnavailable as error:
                left.append(f"its NATS streams ({error})")
            else:
                left += [f"its weights' mirror in {r}'s NATS" for r in kept]
                self._streams = {made for made in self._streams if made[0] != uid}
        return left
