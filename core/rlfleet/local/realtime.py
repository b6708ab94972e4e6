"""What `rlfleet run` starts for a production run (`spec.production`) on one machine,
decided without starting it: the whole real-time loop, with production made up of real
parts and simulated users.

- In the hub, as in a cluster: the trainer (following its conductor), the evaluator (the
  gate's versions), the collector and the conductor, each as its own NATS user.
- The pool, in its region behind the region's NATS leaf: vLLM OpenAI-compatible servers
  started by `rlfleet.rollout.production.serving`, `spec.production.canary.replicas` of them in the
  canary set and one in the stable set, capturing what they serve and taking feedback.
- Users (`rlfleet.rollout.production.users`), who speak only HTTP to the servers, spread over them
  as a Service spreads requests, each named in the header the pool's gateway would set
  and posting feedback with the token each answer came with.

The pool's servers share the rollout cores (they generate), the trainer has its own.
"""

from __future__ import annotations

import dataclasses
import json
import os
import secrets
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import matplotlib
import numpy as np
from msgspec.structs import replace

from rlfleet.api.inferencepool import (
    CANARY,
    FEEDBACK_KEY_FILE,
    STABLE,
    USER_HEADER_FILE,
    ServingWorkload,
)
from rlfleet.api.rlrun import RLRunSpec
from rlfleet.api.wire import (
    BusRole,
    CycleOutcome,
    CycleState,
    FinishedCycle,
    capture_stream,
    capture_subject,
    decode_captured,
)
from rlfleet.bus import connection
from rlfleet.bus.connection import CREDENTIALS_ENV
from rlfleet.bus.reading import decoded
from rlfleet.launch import components, from_spec, pods
from rlfleet.launch.production import FEEDBACK_DIR_ENV, UsersConfig
from rlfleet.launch.settings import spec_default
from rlfleet.local import plan
from rlfleet.local.nats import HUB_DOMAIN, NatsBed
from rlfleet.local.processes import free_port

matplotlib.use("Agg")  # files only, no display
import matplotlib.pyplot as plt

USERS = components.Program("rlfleet.rollout.production.users")
SERVED_MODEL = "policy"
API_KEY_FILE = "api-key"  # under the run's NATS folder: the pool's key, for its users too
FEEDBACK_DIR = "feedback"  # under the run's NATS folder: what the pool's Secret would hold
REQUESTS = "requests.jsonl"  # the users' records, in the run's report folder


@dataclass(frozen=True)
class Pace:
    """How fast a cycle turns on this machine: seconds, where production waits minutes.
    What the spec says of cycles (sizes, windows, bounds) is the spec's."""

    settle_s: float = 1.0  # after a completion's feedback window, before it is decided
    poll_s: float = 1.0  # the collector's, the conductor's and the evaluator's
    serving_poll_s: float = 0.5  # how often a server reads its set's version
    attempts: int = 4  # per task, when the gate evaluates a version
    users: int = 12
    max_model_len: int = 512


def api_key(layout: plan.Layout) -> str:
    """The pool's API key (vLLM's `VLLM_API_KEY`), made once per run folder."""
    path = layout.nats / API_KEY_FILE
    if not path.exists():
        path.write_text(secrets.token_urlsafe(24))
        path.chmod(0o600)
    return path.read_text()


def feedback_dir(layout: plan.Layout) -> Path:
    """The pool's feedback key and user header, as its servers read them from the pool's
    Secret in a cluster: the key made once per run folder, the header the API's default
    (these users' gateway is themselves)."""
    folder = layout.nats / FEEDBACK_DIR
    folder.mkdir(mode=0o700, exist_ok=True)
    key = folder / FEEDBACK_KEY_FILE
    if not key.exists():
        key.write_text(secrets.token_urlsafe(32))
        key.chmod(0o600)
    (folder / USER_HEADER_FILE).write_text(spec_default(ServingWorkload, "user_header"))
    return folder


def server_urls(processes: list[plan.Process]) -> dict[str, str]:
    """Each pool server's base URL, by process name."""
    return {
        p.name: f"http://127.0.0.1:{p.argv[p.argv.index('--port') + 1]}"
        for p in processes
        if p.name.startswith("serving-")
    }


def processes(
    name: str,
    spec: RLRunSpec,
    layout: plan.Layout,
    nats: NatsBed,
    tuning: plan.Tuning,
    pace: Pace = Pace(),
    inverted_while: Path | None = None,
) -> list[plan.Process]:
    production = spec.production
    assert production is not None and spec.evaluation is not None
    trainer_cores, pool_cores = plan.split_cores(sorted(os.sched_getaffinity(0)))
    model = str(plan.model_path(spec, layout))
    hub = pods.Placement(nats.hub.url, HUB_DOMAIN)
    region = production.pool.region
    found = _hub_processes(name, spec, layout, model, hub, pace, (trainer_cores, pool_cores))
    key = api_key(layout)
    at = pods.Placement(nats.leaves[region].url, HUB_DOMAIN, region)
    found += _pool_servers(name, spec, layout, model, at, pace, pool_cores, key)
    found.append(_users(spec, layout, server_urls(found), pace, key, inverted_while))
    return found


def _env(
    layout: plan.Layout, role: BusRole, cores: list[int], extra: dict | None = None
) -> dict[str, str]:
    threads = {"OMP_NUM_THREADS": str(len(cores))}
    return threads | (extra or {}) | {CREDENTIALS_ENV: str(layout.credentials(role))}


def _component_process(
    layout: plan.Layout, process: str, component: components.Component, cores: list[int], config
) -> plan.Process:
    """One of the run's components, pinned to `cores`, as its own NATS user."""
    path = layout.configs / f"{process}.json"
    argv = plan.pinned(component, cores, path)
    return plan.Process(process, argv, config, _env(layout, BusRole(component.name), cores))


def _hub_processes(
    name: str,
    spec: RLRunSpec,
    layout: plan.Layout,
    model: str,
    hub: pods.Placement,
    pace: Pace,
    cores: tuple[list[int], list[int]],
) -> list[plan.Process]:
    """The hub's components, at this machine's pace: the trainer and the evaluator on the
    trainer's cores, the collector and the conductor on the pool's."""
    trainer_cores, pool_cores = cores
    trainer = from_spec.trainer_settings(
        name, spec, model, str(layout.checkpoints), plan.metered(hub)
    )
    trainer = replace(trainer, zero_stage=min(trainer.zero_stage, 2))
    evaluator = from_spec.evaluator_settings(name, spec, model, plan.metered(hub))
    evaluator = replace(evaluator, attempts=pace.attempts, poll_seconds=pace.poll_s)
    collector = from_spec.collector_settings(name, spec, plan.metered(hub))
    collector = replace(collector, settle_s=pace.settle_s, poll_s=pace.poll_s)
    conductor = from_spec.conductor_settings(name, spec, plan.metered(hub))
    conductor = replace(conductor, poll_s=pace.poll_s)
    return [
        _component_process(layout, "trainer", components.TRAINER, trainer_cores, trainer),
        # A cycle evaluates only once its candidate is trained: the evaluator has the
        # trainer's cores to itself, and production's servers keep theirs.
        _component_process(layout, "evaluator", components.EVALUATOR, trainer_cores, evaluator),
        _component_process(layout, "collector", components.COLLECTOR, pool_cores, collector),
        _component_process(layout, "conductor", components.CONDUCTOR, pool_cores, conductor),
    ]


def _pool_servers(
    name: str,
    spec: RLRunSpec,
    layout: plan.Layout,
    model: str,
    at: pods.Placement,
    pace: Pace,
    pool_cores: list[int],
    key: str,
) -> list[plan.Process]:
    """The pool's vLLM servers in its region: its canary set's, then one stable."""
    production = spec.production
    assert production is not None
    serving_env = {
        "VLLM_API_KEY": key,
        FEEDBACK_DIR_ENV: str(feedback_dir(layout)),
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "VLLM_CPU_OMP_THREADS_BIND": ",".join(map(str, pool_cores)),
        "TOKENIZERS_PARALLELISM": "false",
    }
    found = []
    sets = [CANARY] * production.canary.replicas + [STABLE]
    for n, replica_set in enumerate(sets):
        process = f"serving-{replica_set}-{n}"
        path = layout.configs / f"{process}.json"
        placed = dataclasses.replace(at, replica_set=replica_set)
        config = replace(from_spec.serving_settings(name, spec, placed), poll_s=pace.serving_poll_s)
        vllm = [
            *("--model", model, "--served-model-name", SERVED_MODEL, "--port", str(free_port())),
            *("--dtype", plan.serving_dtype(plan.cpu_flags())),
            *("--max-model-len", str(pace.max_model_len), "--seed", str(n)),
        ]
        argv = [*plan.pinned(components.SERVING, pool_cores, path), *vllm]
        env = _env(layout, BusRole.SERVING, pool_cores, serving_env)
        found.append(plan.Process(process, argv, config, env, path))
    return found


def _users(
    spec: RLRunSpec,
    layout: plan.Layout,
    servers: dict[str, str],
    pace: Pace,
    key: str,
    inverted_while: Path | None,
) -> plan.Process:
    """The simulated users, who speak only HTTP to the pool's servers."""
    users = UsersConfig(
        servers=servers,
        model=SERVED_MODEL,
        suite=spec.suite,
        record=layout.report / REQUESTS,
        users=pace.users,
        inverted_while=inverted_while,
    )
    path = layout.configs / "users.json"
    argv = [*USERS.command(sys.executable), str(path)]
    return plan.Process("users", argv, users, {"VLLM_API_KEY": key})


def _p99(values: list[float]) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return round(ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))], 2)


def _fitted_rise(rates: list[float], answers: list[int] | None = None) -> float | None:
    """The accept rate's rise from the first cycle to the last along a least-squares line
    through every cycle's: first and last alone are one cycle each, about +-0.025 apart
    from the line at 440 requests a cycle. Each cycle weighs as many answers as its rate
    is over (`answers`; None: alike): a cycle held back ends within seconds, and its rate
    over a few dozen answers is as noisy as it is short."""
    if len(rates) < 2:
        return None
    # polyfit weighs residuals: the square root of a count weighs squared residuals by it.
    weights = np.sqrt(answers) if answers is not None else None
    slope = np.polyfit(np.arange(len(rates)), rates, 1, w=weights)[0]
    return round(float(slope) * (len(rates) - 1), 4)


async def served_versions(run: str, url: str, credentials: Path) -> dict[str, int]:
    """The policy version that answered each captured completion, by response id: what
    no answer tells its user, read from the run's captures (as its observer)."""
    nc = await connection.connect(url, credentials)
    try:
        js = nc.jetstream()
        stream, subject = capture_stream(run), capture_subject(run)
        return {
            capture.response_id: capture.segment.versions[0]
            async for _, capture in decoded(js, stream, subject, decode_captured)
        }
    finally:
        await nc.close()


def _right_rate(records: list[dict]) -> float | None:
    return round(sum(r["right"] for r in records) / len(records), 4) if records else None


def _rollbacks_judged_by_the_suite(records: list[dict], history: list[FinishedCycle]) -> list[dict]:
    """Each rolled-back candidate's answers as the suite judges them (right or wrong, what
    the users think before their noise), beside the stable set's over the same span: a
    rollback of a candidate no worse by the suite's lights is a false one, whatever the
    gate said. The users' records know which version answered (`summary`'s `versions`)."""
    judged = []
    for cycle in history:
        if cycle.outcome != CycleOutcome.ROLLED_BACK or cycle.candidate is None:
            continue
        canary = [r for r in records if r["version"] == cycle.candidate and r["right"] is not None]
        if not canary:
            continue
        # Records are written as answers come back, not in the order they were sent.
        since, until = min(r["at"] for r in canary), max(r["at"] for r in canary)
        stable = [
            r for r in records
            if "stable" in r["server"] and since <= r["at"] <= until and r["right"] is not None
        ]  # fmt: skip
        judged.append(
            {
                "cycle": cycle.number,
                "canary_right": _right_rate(canary),
                "stable_right": _right_rate(stable),
                "answers": [len(canary), len(stable)],
            }
        )
    return judged


def _swaps(records: list[dict]) -> list[tuple[str, float, float]]:
    """(server, from, to): each time a server's answers changed version, the span from
    sending the last request the old version answered to the first new answer's end."""
    found, last = [], {}
    for r in sorted((r for r in records if r.get("version") is not None), key=lambda r: r["at"]):
        before = last.get(r["server"])
        if before is not None and before["version"] != r["version"]:
            found.append((r["server"], before["at"], r["at"] + r["latency_ms"] / 1000))
        last[r["server"]] = r
    return found


def summary(
    records: list[dict],
    state: CycleState | None,
    invert_cycle: int | None,
    versions: Mapping[str, int],
) -> dict:
    """What a production run did, from its users' records of every request, the version
    that answered each captured one (`served_versions`), and the conductor's last state
    (the cycles it finished)."""
    records = [r | {"version": versions.get(r.get("response_id") or "")} for r in records]
    history = state.history if state is not None else []
    ends = [c.finished_at for c in history]
    return (
        _cycle_outcomes(records, history, invert_cycle)
        | _accept_rates(records, history)
        | _requests_served(records, history, invert_cycle)
        | {
            "cycle_seconds_mean": (
                round((ends[-1] - ends[0]) / (len(ends) - 1), 1) if len(ends) > 1 else None
            ),
        }
    )


def _cycle_outcomes(
    records: list[dict], history: list[FinishedCycle], invert_cycle: int | None
) -> dict:
    """How the cycles ended, the canary's rollbacks and the inverted cycle's among them."""
    outcomes = [c.outcome for c in history]
    poisoned_cycles = {invert_cycle - 1, invert_cycle} if invert_cycle is not None else set()
    return {
        "cycles": len(history),
        "promoted": outcomes.count(CycleOutcome.PROMOTED),
        "rejected": outcomes.count(CycleOutcome.REJECTED),
        "rolled_back": outcomes.count(CycleOutcome.ROLLED_BACK),
        "skipped": outcomes.count(CycleOutcome.SKIPPED),
        "timed_out": outcomes.count(CycleOutcome.TIMED_OUT),
        # Each canaried candidate had passed the gate, its suite score within maxRegression
        # of the serving version's: rolled back, its cycle of users' signal was lost. The
        # users say the opposite from the close of the cycle before the inverted one
        # (`inverting`), so that cycle's canary runs on their inverted word: its outcome
        # is the poison's, apart.
        "canary_false_rollbacks": sum(
            c.outcome == CycleOutcome.ROLLED_BACK and c.number not in poisoned_cycles
            for c in history
        ),
        "canary_on_inverted_feedback": next(
            (f"{c.outcome} ({c.why})" for c in history if c.number + 1 == invert_cycle), None
        ),
        # Did the canary roll back candidates that were truly worse? The suite's verdict
        # on what each answered, beside the stable set's then.
        "canary_rollbacks_judged": _rollbacks_judged_by_the_suite(records, history),
        "outcomes": [f"{c.number}: {c.outcome} ({c.why})" for c in history],
        # Held back (skipped), rejected or rolled back: the poison stopped; promoted: not.
        "inverted_cycle_outcome": next(
            (str(c.outcome) for c in history if c.number == invert_cycle), None
        ),
    }


def _accept_rates(records: list[dict], history: list[FinishedCycle]) -> dict:
    """The share of answers users accepted in each cycle's traffic, and its trend."""
    accept, answers, start = [], [], min((r["at"] for r in records), default=0.0)
    for cycle in history:  # a cycle's traffic: from the cycle before's end to its own
        judged = [r["right"] for r in records if start <= r["at"] < cycle.finished_at]
        judged = [right for right in judged if right is not None]
        accept.append(round(sum(judged) / len(judged), 4) if judged else None)
        answers.append(len(judged))
        start = cycle.finished_at
    known, known_answers = [], []
    for rate, count in zip(accept, answers, strict=True):
        if rate is not None:
            known.append(rate)
            known_answers.append(count)
    return {
        "accept_rate_by_cycle": accept,
        "accept_rate_first": known[0] if known else None,
        "accept_rate_last": known[-1] if known else None,
        "answers_by_cycle": answers,
        "accept_rate_fitted_rise": _fitted_rise(known, known_answers),
        # Each cycle alike, as this report fitted before it weighed them by their answers.
        "accept_rate_fitted_rise_per_cycle": _fitted_rise(known),
    }


def _requests_served(
    records: list[dict], history: list[FinishedCycle], invert_cycle: int | None
) -> dict:
    """How the pool served: requests and feedback lost, latency steady and while a server
    swapped versions, and how much the inverted cycle's candidate served."""
    swaps = _swaps(records)

    def during_swap(r: dict) -> bool:
        end = r["at"] + r["latency_ms"] / 1000
        return any(s == r["server"] and r["at"] <= to and end >= since for s, since, to in swaps)

    served = [r for r in records if r["status"] == 200]
    in_swap, steady = [], []
    for r in served:  # one pass: each test scans every switch
        (in_swap if during_swap(r) else steady).append(r)
    poisoned = next((c.candidate for c in history if c.number == invert_cycle), None)
    servers = {r["server"] for r in records}
    return {
        "requests_total": len(records),
        "requests_failed": len(records) - len(served),
        "feedback_lost": sum(
            r["said"] is not None and r["feedback_status"] != 200 for r in records
        ),
        "serving_p99_ms_steady": _p99([r["latency_ms"] for r in steady]),
        "serving_p99_ms_during_swap": _p99([r["latency_ms"] for r in in_swap]),
        "swaps": len(swaps),
        # Tens against thousands: the p99 during swaps is about their slowest request.
        "swap_requests": len(in_swap),
        "poisoned_served_fraction": (
            round(sum(r.get("version") == poisoned for r in served) / max(len(served), 1), 4)
            if poisoned is not None
            else None
        ),
        "canary_fraction": round(sum("canary" in s for s in servers) / max(len(servers), 1), 4),
    }


def write_report(
    layout: plan.Layout,
    state: CycleState | None,
    invert_cycle: int | None,
    versions: Mapping[str, int],
) -> dict:
    """`realtime.json` and a plot of the accept rate per cycle, in the run's report."""
    path = layout.report / REQUESTS
    lines = path.read_text().splitlines() if path.exists() else []
    found = summary([json.loads(line) for line in lines], state, invert_cycle, versions)
    layout.report.mkdir(parents=True, exist_ok=True)
    (layout.report / "realtime.json").write_text(json.dumps(found, indent=2) + "\n")
    rates = found["accept_rate_by_cycle"]
    if rates:
        figure, axes = plt.subplots(figsize=(6, 3.5))
        colours = {"Promoted": "tab:green", "Rejected": "tab:red", "RolledBack": "tab:orange"}
        history = state.history if state is not None else []
        axes.bar(
            [c.number for c in history],
            [rate or 0.0 for rate in rates],
            color=[colours.get(c.outcome, "tab:grey") for c in history],
        )
        axes.set_xlabel("cycle (colour: its candidate promoted, rejected, rolled back)")
        axes.set_ylabel("share of answers users accept")
        axes.set_title("accept rate of what production served, per cycle")
        figure.tight_layout()
        figure.savefig(layout.report / "accept-rate.png", dpi=120)
        plt.close(figure)
    return found
