"""`rlfleet promote RUN VERSION` and `rlfleet rollback RUN`: an on-call engineer's orders
to a production run, written into its spec (`spec.production.order`), so the operator
stays the only writer of everything else. The hub passes the order to the run's
conductor, which carries it out once: every replica set serves the version, and the
cycle under way ends. `kubectl get events` then says what was done.

Only versions whose weights are kept can be named: the serving one, the one before it
(`status.production.previousVersion`), or a candidate under evaluation or in its canary.
`rollback` names, during a canary, the serving version (the canary goes back); otherwise
the one served before.
"""

from __future__ import annotations

import argparse
import sys

from rlfleet.api.meta import GROUP, VERSION
from rlfleet.api.production import ProductionStatus, ServingOrder
from rlfleet.api.rlrun import RLRUN, RLRunSpec, RLRunStatus
from rlfleet.api.wire import CyclePhase, servable


class Refused(Exception):
    """The order cannot be carried out: why, for the engineer."""


def _servable(shown: ProductionStatus) -> list[int]:
    return servable(
        shown.phase, shown.serving_version, shown.previous_version, shown.candidate_version
    )


def order(spec: RLRunSpec, status: RLRunStatus, version: int | None) -> ServingOrder:
    """The next order for `version`, or for a rollback when None."""
    if spec.production is None:
        raise Refused("not a production run: it has no spec.production")
    shown = status.production
    if shown is None:
        raise Refused("its conductor has not started yet: nothing is served")
    if version is None:
        if shown.phase == CyclePhase.CANARY:
            version = shown.serving_version  # the canary set goes back
        elif shown.previous_version is not None:
            version = shown.previous_version
        else:
            raise Refused(
                f"nothing to roll back to: production serves version {shown.serving_version}"
                " and keeps none before it"
            )
    if version not in _servable(shown):
        kept = ", ".join(map(str, _servable(shown)))
        raise Refused(f"version {version} cannot be served: only {kept} are kept")
    last = spec.production.order.number if spec.production.order is not None else 0
    return ServingOrder(number=max(last, shown.orders_done) + 1, version=version)


def _give(args: argparse.Namespace, version: int | None) -> int:
    from kubernetes import client, config  # slow to load: only once the arguments parse

    config.load_kube_config(context=args.context)
    api = client.CustomObjectsApi()
    where = (GROUP, VERSION, args.namespace, RLRUN.plural, args.run)
    run = api.get_namespaced_custom_object(*where)
    try:
        spec = RLRunSpec.model_validate(run["spec"])
        given = order(spec, RLRunStatus.model_validate(run.get("status") or {}), version)
    except Refused as why:
        print(f"rlfleet {args.command}: {args.run}: {why}", file=sys.stderr)
        return 1
    # The run as read, or nothing: an order given meanwhile is not overwritten.
    patch = {
        "metadata": {"resourceVersion": run["metadata"]["resourceVersion"]},
        "spec": {"production": {"order": given.model_dump(by_alias=True)}},
    }
    api.patch_namespaced_custom_object(*where, patch)
    print(
        f"order {given.number}: {args.run} serves version {given.version} on every replica "
        f"set once its conductor reads it (kubectl get events --field-selector "
        f"involvedObject.name={args.run})"
    )
    return 0


def _promote(args: argparse.Namespace) -> int:
    return _give(args, args.version)


def _rollback(args: argparse.Namespace) -> int:
    return _give(args, None)


def _common(command: argparse.ArgumentParser) -> None:
    command.add_argument("run", help="the RLRun's name")
    command.add_argument("-n", "--namespace", default="default")
    command.add_argument("--context", default=None, help="the hub's kubeconfig context")


def register(groups: argparse._SubParsersAction) -> None:
    promote = groups.add_parser(
        "promote", help="a production run serves a version now, on every replica set"
    )
    _common(promote)
    promote.add_argument("version", type=int, help="the version to serve")
    promote.set_defaults(handler=_promote, command="promote")
    rollback = groups.add_parser(
        "rollback", help="a production run goes back: its canary, or its last promotion"
    )
    _common(rollback)
    rollback.set_defaults(handler=_rollback, command="rollback")
