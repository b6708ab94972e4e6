"""`rlfleet run` of a production run: what it starts, decided without starting it, and
the figures it reports from its users' records and its conductor's last state."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import yaml
from conftest import ROOT

from rlfleet.api.rlrun import RLRunSpec
from rlfleet.api.wire import BusRole, CycleOutcome, CyclePhase, CycleState, FinishedCycle
from rlfleet.bus.connection import CREDENTIALS_ENV
from rlfleet.launch import components
from rlfleet.launch.production import FEEDBACK_DIR_ENV, ServingConfig, UsersConfig
from rlfleet.launch.settings import to_json
from rlfleet.local import plan, realtime
from rlfleet.local.watch import inverting
from rlfleet.rollout.production.feedback import PoolFeedback


def _spec() -> RLRunSpec:
    document = yaml.safe_load((ROOT / "examples" / "realtime.yaml").read_text())
    return RLRunSpec.model_validate(document["spec"])


def test_a_production_run_starts_the_hubs_components_its_pool_and_its_users(tmp_path):
    spec = _spec()
    nats = SimpleNamespace(
        hub=SimpleNamespace(url="nats://hub:4222"),
        leaves={"region-a": SimpleNamespace(url="nats://region-a:4222")},
    )
    layout = plan.Layout(tmp_path)
    layout.nats.mkdir(parents=True)
    processes = {
        p.name: p
        for p in realtime.processes("rt", spec, layout, nats, plan.Tuning())  # type: ignore[arg-type]
    }
    assert set(processes) == {
        "trainer", "evaluator", "collector", "conductor",
        "serving-canary-0", "serving-stable-1", "users",
    }  # fmt: skip
    for name in ("trainer", "evaluator", "collector", "conductor"):
        component = components.COMPONENTS[name]
        process = processes[name]
        assert process.env[CREDENTIALS_ENV] == str(layout.credentials(BusRole(name)))
        process.settings_path.parent.mkdir(parents=True, exist_ok=True)
        process.settings_path.write_bytes(to_json(process.config))
        assert component.read(process.settings_path) == process.config
    assert processes["trainer"].config.production and processes["trainer"].config.router_replay
    assert processes["evaluator"].config.on_request
    # The evaluator works while the trainer waits for its verdict: it shares the
    # trainer's cores, and leaves the pool's to production's servers.
    assert processes["evaluator"].argv[:3] == processes["trainer"].argv[:3]  # taskset -c
    canary: ServingConfig = processes["serving-canary-0"].config
    assert (canary.replica_set, canary.weights_domain, canary.jetstream_domain) == (
        "canary", "region-a", "hub"
    )  # fmt: skip
    assert canary.feedback_window_s == spec.production.feedback.window_seconds
    # Each server reads its settings from the file its command names, and its pool's key
    # is in its environment, never in its arguments.
    serving = processes["serving-stable-1"]
    assert serving.argv[serving.argv.index("rlfleet.rollout.production.serving") + 1] == str(
        serving.settings_path
    )
    key = realtime.api_key(layout)
    assert serving.env["VLLM_API_KEY"] == key and key not in " ".join(serving.argv)
    # Every server signs feedback tokens with the pool's one key, read from its folder as
    # a pod reads the pool's Secret: feedback on any server's answer is taken by any.
    folder = Path(serving.env[FEEDBACK_DIR_ENV])
    assert {p.env[FEEDBACK_DIR_ENV] for n, p in processes.items() if "serving" in n} == {
        str(folder)
    }
    pool = PoolFeedback.from_dir(folder)
    assert pool.key.decode() not in " ".join(serving.argv) + str(serving.config)
    users: UsersConfig = processes["users"].config
    assert set(users.servers) == {"serving-canary-0", "serving-stable-1"}
    # The users name themselves in the header the servers take a user from, as a gateway.
    assert users.user_header.encode() == pool.user_header
    assert processes["users"].env == {"VLLM_API_KEY": key}  # no feedback key: tokens only


def _state(*outcomes: tuple[int, CycleOutcome, int, float]) -> CycleState:
    history = [FinishedCycle(n, o, c, "why", at) for n, o, c, at in outcomes]
    return CycleState("rt", len(history) + 1, CyclePhase.COLLECTING, 0.0, 0, history=history)


def _request(at: float, server: str, right: bool, latency_ms=10.0, **fields):
    return {
        "at": at, "server": server, "user": "user-1", "task": "t", "status": 200,
        "latency_ms": latency_ms, "response_id": f"r{at}",
        "right": right, "said": "accepted", "inverted": False, "feedback_status": 200,
    } | fields  # fmt: skip


def test_a_rolled_back_candidate_is_judged_by_the_suite_beside_the_stable_set_then():
    state = _state((1, CycleOutcome.PROMOTED, 4, 5.0), (2, CycleOutcome.ROLLED_BACK, 5, 30.0))
    records = [
        _request(10, "serving-canary-0", False),
        _request(10.5, "serving-stable-1", True),
        _request(11, "serving-canary-0", False),
        _request(11.5, "serving-stable-1", True),
        _request(12, "serving-canary-0", True),
        _request(20, "serving-stable-1", False),  # after the canary's last answer
    ]
    versions = {"r10": 5, "r10.5": 4, "r11": 5, "r11.5": 4, "r12": 5, "r20": 4}
    found = realtime.summary(records, state, None, versions)
    assert found["canary_rollbacks_judged"] == [
        {"cycle": 2, "canary_right": 0.3333, "stable_right": 1.0, "answers": [3, 2]}
    ]


def test_the_report_counts_cycles_accept_rates_losses_and_the_poisoned_share():
    state = _state(
        (1, CycleOutcome.PROMOTED, 3, 100.0),
        (2, CycleOutcome.REJECTED, 6, 200.0),
        (3, CycleOutcome.ROLLED_BACK, 9, 300.0),
    )
    records = [
        _request(10, "serving-stable-1", False),
        _request(20, "serving-canary-0", True),
        _request(150, "serving-stable-1", True),
        _request(160, "serving-canary-0", True),
        _request(250, "serving-canary-0", False, latency_ms=40.0),
        _request(260, "serving-stable-1", None, status=500, said=None, response_id=None),
        _request(270, "serving-stable-1", True, feedback_status=503),
    ]
    # Which version answered each, as the run's captures say: no answer tells its user.
    versions = {"r10": 0, "r20": 0, "r150": 3, "r160": 3, "r250": 9, "r270": 3}
    found = realtime.summary(records, state, 3, versions)
    assert (found["cycles"], found["promoted"], found["rejected"], found["rolled_back"]) == (
        3, 1, 1, 1
    )  # fmt: skip
    # Cycle 3's rollback stopped the inverted cycle's candidate; any other would be lost.
    assert found["canary_false_rollbacks"] == 0
    assert realtime.summary(records, state, 2, versions)["canary_false_rollbacks"] == 1
    # Inverting cycle 4, users say the opposite from cycle 3's close: cycle 3's canary ran
    # on their inverted word, and its rollback is the poison's, apart.
    before_inverted = realtime.summary(records, state, 4, versions)
    assert before_inverted["canary_false_rollbacks"] == 0
    assert before_inverted["canary_on_inverted_feedback"].startswith("RolledBack (")
    assert found["canary_on_inverted_feedback"].startswith("Rejected (")
    assert found["inverted_cycle_outcome"] == "RolledBack"
    # Cycle 3's candidate (9) answered one request, wrong; the stable set answered none
    # in that span.
    assert found["canary_rollbacks_judged"] == [
        {"cycle": 3, "canary_right": 0.0, "stable_right": None, "answers": [1, 0]}
    ]
    assert found["accept_rate_by_cycle"] == [0.5, 1.0, 0.5]
    assert found["answers_by_cycle"] == [2, 2, 2]
    assert found["accept_rate_fitted_rise"] == 0.0  # up and down again: no trend
    # A short cycle's rate weighs its few answers: an early jump over 2 answers of 38
    # tilts the line down by a fifth as much as if it weighed as much as each other cycle.
    assert realtime._fitted_rise([0.5, 1.0, 0.5, 0.5], [12, 2, 12, 12]) == -0.0333
    assert realtime._fitted_rise([0.5, 1.0, 0.5, 0.5]) == -0.15
    assert (found["requests_total"], found["requests_failed"], found["feedback_lost"]) == (7, 1, 1)
    assert found["poisoned_served_fraction"] == round(1 / 6, 4)  # cycle 3's candidate: 9
    assert found["canary_fraction"] == 0.5
    assert found["cycle_seconds_mean"] == 100.0
    # The canary server went 0 -> 3 -> 9: two switches; the stable one 0 -> 3.
    assert found["swaps"] == 3
    # Served while its server switched: all but the stable server's last.
    assert found["swap_requests"] == 5


def test_users_misreport_what_the_inverted_cycle_collects():
    """From the cycle before's close (it trains, it is judged) until the cycle closes."""
    states = [
        (2, CyclePhase.COLLECTING, False),
        (2, CyclePhase.TRAINING, True),
        (2, CyclePhase.CANARY, True),
        (3, CyclePhase.COLLECTING, True),
        (3, CyclePhase.TRAINING, False),
        (4, CyclePhase.COLLECTING, False),
    ]
    for number, phase, inverted in states:
        state = CycleState("rt", number, phase, 0.0, 0)
        assert inverting(state, 3) is inverted, (number, phase)


def test_the_example_is_a_run_the_api_takes(tmp_path: Path):
    spec = _spec()
    assert spec.production is not None and spec.rollout is None
    assert spec.region_names == ["region-a"] and spec.suite == "rules"
