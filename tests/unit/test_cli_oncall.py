"""`rlfleet promote` and `rlfleet rollback` decide their order from the run as read
(`rlfleet.cli.oncall.order`); the bed's fleet test gives one to a running hub."""

from __future__ import annotations

import pytest
import yaml
from conftest import ROOT

from rlfleet.api.production import ServingOrder
from rlfleet.api.rlrun import RLRunSpec, RLRunStatus
from rlfleet.cli.oncall import Refused, order

SPEC = RLRunSpec.model_validate(
    yaml.safe_load((ROOT / "examples" / "realtime.yaml").read_text())["spec"]
)


def status(phase: str, serving: int, previous: int | None, candidate: int | None = None):
    production = {
        "cycle": 4,
        "phase": phase,
        "since": "2026-11-26T10:00:00Z",
        "servingVersion": serving,
        "previousVersion": previous,
        "candidateVersion": candidate,
        "ordersDone": 3,
        "stateSequence": 40,
    }
    return RLRunStatus.model_validate({"production": production})


def test_rollback_sends_a_canary_back_or_else_goes_to_the_version_before() -> None:
    assert order(SPEC, status("Canary", 5, 3, 8), None) == ServingOrder(number=4, version=5)
    assert order(SPEC, status("Collecting", 5, 3), None) == ServingOrder(number=4, version=3)
    with pytest.raises(Refused, match="nothing to roll back to"):
        order(SPEC, status("Collecting", 5, None), None)


def test_promote_names_a_kept_version_only() -> None:
    assert order(SPEC, status("Evaluating", 5, 3, 8), 8).version == 8
    with pytest.raises(Refused, match="version 8 cannot be served: only 3, 5 are kept"):
        order(SPEC, status("Collecting", 5, 3, 8), 8)  # its cycle ended: its weights are gone
    rollout = RLRunSpec.model_validate(
        yaml.safe_load((ROOT / "examples" / "rlrun.yaml").read_text())["spec"]
    )
    with pytest.raises(Refused, match="not a production run"):
        order(rollout, status("Collecting", 5, 3), 5)


def test_each_order_counts_past_the_spec_and_what_was_carried_out() -> None:
    given = SPEC.model_copy(
        update={
            "production": SPEC.production.model_copy(
                update={"order": ServingOrder(number=7, version=1)}
            )
        }
    )
    assert order(given, status("Collecting", 5, 3), 3).number == 8
