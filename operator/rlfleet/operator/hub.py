"""The hub role: an RLRun becomes trainer objects here and a mirror in each named region.

`reconcile` is level-driven and reads as observe, decide, apply. Observing applies what
the spec wants (server-side apply, so running it again changes nothing; the answer is the
object as it is, status too), reads back what each region reports on its mirror and the
trainer's newest step from NATS. `runstatus.decide`, a pure function, turns that into the
run's whole new status and the events worth telling the on-call engineer; the handler
writes the one and posts the others. A region that does not answer keeps its last
report; when it answers again the mirror is applied once more, which updates it in place
rather than making another.
"""

from __future__ import annotations

import logging
import time
from datetime import datetime
from functools import partial

from kubernetes.client.exceptions import ApiException

from rlfleet.api.meta import API_VERSION, COMPONENT_LABEL
from rlfleet.api.production import ServingOrder
from rlfleet.api.rlrun import RegionStatus, RLRunSpec, RLRunStatus
from rlfleet.api.wire import BusRole, ServeOrder, StepReport
from rlfleet.bus.permissions import renewal_due
from rlfleet.launch import components, pods
from rlfleet.operator import gate
from rlfleet.operator.config import OperatorConfig
from rlfleet.operator.dataplane import DataPlane, DataPlaneUnavailable, StorageRefused
from rlfleet.operator.kube import Kube, Ref, Unreachable
from rlfleet.operator.parallel import at_once
from rlfleet.operator.production import CycleUpdates
from rlfleet.operator.regions import RegionClients, RegionCredentials
from rlfleet.operator.runstatus import Decision, Observed, RegionReport, decide
from rlfleet.operator.status import is_present, now, parse_time
from rlfleet.operator.workloads.common import ORIGIN_LABEL, mints_users, nats_key
from rlfleet.operator.workloads.hub import (
    evaluator_name,
    hub_objects,
    mirror,
    nats_user_secret,
)

log = logging.getLogger(__name__)


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
        # run uid -> its NATS users (.creds), as last signed
        self._users: dict[str, dict[BusRole, str]] = {}
        # (run uid, cluster, role) whose user's Secret holds them
        self._placed: set[tuple[str, str, BusRole]] = set()
        self._orders: dict[str, ServingOrder] = {}  # run uid -> its order last passed on

    def _nats_users(self, run: dict, spec: RLRunSpec) -> dict[BusRole, str] | None:
        """The run's NATS users, signed once per operator process and again before they
        expire (each time written to every Secret of theirs, where the pods' files follow
        them: the pods reconnect with them); the hub's components' and the observer's are
        written to the hub's Secrets here. None without NATS users, or when none can be
        made (the pods wait for their Secrets)."""
        meta = run["metadata"]
        if self.dataplane is None or self.config.nats is None or not mints_users(self.config.nats):
            return None
        ttl_s = self.config.nats.user_ttl_seconds
        users = self._users.get(meta["uid"])
        if users is None or any(renewal_due(u, time.time(), ttl_s) for u in users.values()):
            try:
                users = self.dataplane.run_users(nats_key(run), meta["uid"], ttl_s)
            except DataPlaneUnavailable as error:
                log.warning("run %s/%s: %s", meta["namespace"], meta["name"], error)
                return None
            self._users[meta["uid"]] = users
            self._placed = {key for key in self._placed if key[0] != meta["uid"]}
        for role in components.hub_roles(spec):
            self._place_user(self.local, run, self.config.cluster, role, users, owned=True)
        return users

    def _place_user(
        self,
        kube: Kube,
        run: dict,
        cluster: str,
        role: BusRole,
        users: dict[BusRole, str] | None,
        owned: bool,
    ) -> None:
        """Writes the Secret of one of the run's users in a cluster, once per signing."""
        key = (run["metadata"]["uid"], cluster, role)
        if users is not None and key not in self._placed:
            kube.apply(nats_user_secret(run, role, users[role], owned))
            self._placed.add(key)

    def _report(
        self,
        run: dict,
        region: str,
        previous: RegionStatus | None,
        resync: bool,
        held: bool,
        users: dict[BusRole, str] | None,
        role: BusRole,  # the user the run's pods in a region log in as
    ) -> RegionReport:
        try:
            kube = self.regions.client(region)
            self._place_user(kube, run, region, role, users, owned=False)
            # A resync reads the mirror; it writes only what is missing, was out of reach,
            # or is held (or let go) since.
            wanted = mirror(run, self.config.cluster, self.config.nats, held)
            reachable = previous is not None and previous.reachable
            found = self._listed_mirror(kube, run) if resync and reachable else None
            if found is None or found["spec"].get("suspend") != wanted["spec"].get("suspend"):
                found = kube.apply(wanted)
        except RegionCredentials as error:
            return RegionReport(region, False, problem=str(error), credentials=True)
        except ApiException as error:
            if error.status not in (401, 403):
                raise
            problem = f"region {region} refused the hub's credentials ({error.status})"
            return RegionReport(region, False, problem=problem, credentials=True)
        except Unreachable as error:
            return RegionReport(region, False, problem=str(error))
        entry = next(
            (e for e in found.get("status", {}).get("regions", []) if e.get("name") == region),
            {},
        )
        reported = RegionStatus.model_validate(
            {"requested": 0, "lent": 0, "running": 0} | entry | {"name": region}
        )
        self._answered[(run["metadata"]["uid"], region)] = moment = now()
        return RegionReport(region, True, reported, moment)

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

    def _ensure_streams(self, run: dict, spec: RLRunSpec, resync: bool) -> list[str]:
        """Makes the run's streams, and its weights' mirror in each region, before its pods
        bind to them (components only bind); again at each resync, so a stream lost since
        (a NATS store wiped, a stream deleted by hand) comes back as a deleted pod would.
        Returns the spec's problems that the hub's JetStream found (each names its field)."""
        if self.dataplane is None:
            return []
        meta = run["metadata"]
        key, regions = nats_key(run), tuple(spec.region_names)
        backlog = spec.trajectory_backlog_mib << 20
        made = (meta["uid"], regions, backlog)
        if made in self._streams and not resync:
            return []
        try:
            missing = self.dataplane.ensure_streams(key, list(regions), backlog)
        except StorageRefused as error:  # the streams stay as they were
            self._streams.discard(made)
            return [
                f"spec.trajectoryBacklogMib: the hub's JetStream cannot reserve "
                f"{spec.trajectory_backlog_mib} MiB for the run's trajectories ({error}); "
                "ask for less, or give the hub's JetStream a larger max_file_store"
            ]
        except DataPlaneUnavailable as error:
            log.warning("run %s/%s: %s", meta["namespace"], meta["name"], error)
            missing = list(regions) or [key]
        if missing:
            self._streams.discard(made)
        else:
            self._streams.add(made)
        return []

    def _step(self, run: dict) -> tuple[bool, StepReport | None]:
        """The trainer's newest step report; (False, None) when there is no NATS or no
        answer."""
        if self.dataplane is None:
            return False, None
        meta = run["metadata"]
        try:
            return True, self.dataplane.last_step(nats_key(run))
        except DataPlaneUnavailable as error:
            log.warning("run %s/%s: %s", meta["namespace"], meta["name"], error)
            return False, None

    def _pass_order(self, run: dict, spec: RLRunSpec) -> None:
        """Passes the spec's on-call order (`rlfleet promote`, `rlfleet rollback`) to the
        run's conductor over NATS, once per order and process."""
        order = spec.production.order if spec.production is not None else None
        meta = run["metadata"]
        if order is None or self.dataplane is None or self._orders.get(meta["uid"]) == order:
            return
        message = ServeOrder(nats_key(run), order.number, order.version)
        try:
            if self.dataplane.pass_order(message):
                log.info(
                    "run %s/%s: order %d passed on", meta["namespace"], meta["name"], order.number
                )
        except DataPlaneUnavailable as error:
            log.warning("run %s/%s: %s", meta["namespace"], meta["name"], error)
            return
        self._orders[meta["uid"]] = order

    def _cycles(self, run: dict, spec: RLRunSpec, old: RLRunStatus) -> CycleUpdates | None:
        """A production run's conductor states since the status's; None when it is not
        one, or NATS did not answer."""
        if spec.production is None or self.dataplane is None:
            return None
        after = old.production.state_sequence if old.production is not None else 0
        try:
            return self.dataplane.cycle_updates(nats_key(run), after)
        except DataPlaneUnavailable as error:
            meta = run["metadata"]
            log.warning("run %s/%s: %s", meta["namespace"], meta["name"], error)
            return None

    def _forget(self, run: dict, region: str, role: BusRole) -> bool:
        """Deletes the run's mirror in a region; False if the region could not be reached."""
        if region not in self.regions.access:
            return True  # never configured, so the hub never mirrored anything there
        try:
            kube = self.regions.client(region)
            kube.delete(_mirror_ref(run))
            secret = pods.nats_credentials_secret(run["metadata"]["name"], role)
            kube.delete(Ref("v1", "Secret", secret, run["metadata"]["namespace"]))
        except (RegionCredentials, Unreachable):
            return False
        except ApiException as error:
            if error.status not in (401, 403):
                raise
            return False  # the region refuses the hub's credentials: try again later
        self._placed.discard((run["metadata"]["uid"], region, role))
        return True

    def _listed(self, ref: Ref, component: str) -> dict | None:
        """A run's object from a recent list of its namespace's objects of that component."""
        kind = Ref(ref.api_version, ref.kind, namespace=ref.namespace)
        found = self.local.list_recent(kind, f"{COMPONENT_LABEL}={component}", self._fresh_s())
        return next((o for o in found if Ref.of(o) == ref), None)

    def _verdict(self, run: dict, spec: RLRunSpec, old: RLRunStatus) -> gate.Verdict:
        """The evaluation gate's verdict on the evaluator's newest report; without NATS,
        on the last one the status holds."""
        meta = run["metadata"]
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

    def _apply_hub_objects(
        self, run: dict, spec: RLRunSpec, old: RLRunStatus, held: bool, resync: bool
    ) -> dict:
        """The run's objects in the hub, as wanted; returns its trainer StatefulSet."""
        meta = run["metadata"]
        trainer_ref = Ref("apps/v1", "StatefulSet", f"{meta['name']}-trainer", meta["namespace"])
        config = self.config
        objects = hub_objects(run, config.images, config.workloads, config.nats, held)
        if resync and not self._drifted(objects):
            return self._listed(trainer_ref, "trainer") or {}
        # The objects do not refer to each other's existence (a pod waits for a missing
        # ConfigMap), so they go at once; an apply answers with the object, status too.
        applied = at_once([partial(self.local.apply, manifest) for manifest in objects])
        if spec.evaluation is None and is_present(old.conditions, "Failed"):
            # The gate was removed: its evaluator goes with it, and so do its credentials.
            evaluator = evaluator_name(meta["name"])
            self.local.delete(Ref("apps/v1", "Deployment", evaluator, meta["namespace"]))
            secret = pods.nats_credentials_secret(meta["name"], BusRole.EVALUATOR)
            self.local.delete(Ref("v1", "Secret", secret, meta["namespace"]))
            self._placed.discard((meta["uid"], config.cluster, BusRole.EVALUATOR))
        return next((a for a in applied if Ref.of(a) == trainer_ref), {})

    def reconcile(self, run: dict, resync: bool = False) -> Decision:
        """Observes, decides, writes the run's new status; returns the decision, whose
        events the caller posts. `resync` (the timer) re-reads the world but writes only
        what is missing or must change; a change or a start applies everything."""
        observed = self.observe(run, resync)
        decision = decide(observed)
        self.local.write_status(run, decision.status)
        return decision

    def observe(self, run: dict, resync: bool = False) -> Observed:
        """Reads the world, applying on the way what the spec wants: the gate's verdict,
        the hub's objects, each region's mirror and report, the trainer's progress."""
        spec = RLRunSpec.model_validate(run["spec"])
        meta = run["metadata"]
        old = RLRunStatus.model_validate(run.get("status") or {})
        verdict = self._verdict(run, spec, old)
        users, role = self._nats_users(run, spec), components.region_role(spec)
        spec_problems = self._ensure_streams(run, spec, resync)
        self._pass_order(run, spec)
        trainer = self._apply_hub_objects(run, spec, old, verdict.held, resync)
        previous = {e.name: e for e in old.regions}
        wanted = spec.region_names
        reports = at_once(
            [
                partial(
                    self._report, run, name, previous.get(name), resync, verdict.held, users, role
                )
                for name in wanted
            ]
        )
        # Regions dropped from the spec lose their mirror; one not answering is retried.
        leftover = [n for n in previous if n not in wanted and not self._forget(run, n, role)]
        stepped, step = self._step(run)
        return Observed(
            spec=spec,
            old=old,
            generation=meta.get("generation", 0),
            created=parse_time(meta.get("creationTimestamp")),
            verdict=verdict,
            ready=trainer.get("status", {}).get("readyReplicas", 0),
            regions=reports,
            leftover=leftover,
            last_answer={
                name: self._answered[(meta["uid"], name)]
                for name in wanted
                if (meta["uid"], name) in self._answered
            },
            stepped=stepped,
            step=step,
            cycles=self._cycles(run, spec, old),
            moment=now(),
            region_timeout_s=self.config.region_timeout_seconds,
            spec_problems=spec_problems,
        )

    def delete(self, run: dict) -> list[str]:
        """Deletes every mirror of the run, then its NATS streams (the hub's and each
        region's copy of its weights); returns what is left for a later try."""
        uid = run["metadata"]["uid"]
        spec = RLRunSpec.model_validate(run["spec"])
        named, role = set(spec.region_names), components.region_role(spec)
        named |= {e["name"] for e in (run.get("status") or {}).get("regions", [])}
        for region in named:
            self._answered.pop((uid, region), None)
        self._users.pop(uid, None)
        self._orders.pop(uid, None)
        # Every cluster's: a Secret left in a region is deleted below whether placed or not.
        self._placed = {key for key in self._placed if key[0] != uid}
        left = [f"its mirror in {r}" for r in sorted(named) if not self._forget(run, r, role)]
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
            left += self._revoke_users(run)
        return left

    def _revoke_users(self, run: dict) -> list[str]:
        """Revokes the deleted run's NATS users everywhere, so that credentials it leaked
        stop working at once, a run made again under its name included (whose users are
        others); returns what is left for a later try."""
        access = self.config.nats
        if self.dataplane is None or access is None or not mints_users(access):
            return []
        servers = 1 + len(self.config.regions)  # the hub's, and each region's leaf node
        try:
            self.dataplane.revoke_users(
                nats_key(run), run["metadata"]["uid"], access.user_ttl_seconds, servers
            )
        except DataPlaneUnavailable as error:
            return [f"its NATS users' revocation ({error})"]
        return []
