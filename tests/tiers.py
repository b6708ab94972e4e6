"""The suite's tiers: the folder a test lives in says the heaviest thing it starts.

    tests/unit/     starts nothing: no server, no engine, no cluster (the inner loop)
    tests/servers/  NATS servers, EnvPool session servers, HTTP servers a test serves
    tests/engines/  vLLM, DeepSpeed, or whole local runs of the components
    tests/bed/      the four-cluster Kubernetes test bed

Each test is marked with its tier (`pytest -m unit`), derived from its folder, never
written by hand; a fixture that starts something belongs to the tier it starts
(`FIXTURE_TIERS`), and a test that asks for one from a lower tier is a collection error.
The unit tier is also held at run time: a test there that starts a server fails
(`server_in`), so the inner loop stays fast and needs nothing but Python.
"""

from __future__ import annotations

from pathlib import Path

TIERS = ("unit", "servers", "engines", "bed")  # cheapest first: the order the suite runs them
# A parallel run (`pytest -n`, as `make test` runs) hands its workers whole units, the
# longest first so that the last to finish is a short one: the bed tier, then the rest.
PARALLEL_ORDER = ("bed", "engines", "servers", "unit")

# The conftest fixtures that start something, and the tier that is.
FIXTURE_TIERS = {
    "nats_servers": "servers",
    "tiny_moe": "engines",
    "vllm_probe": "engines",
    "image_environments": "engines",
    "testbed": "bed",
    "bed": "bed",
    "kubectl": "bed",
    "crds_installed": "bed",
}

# Programs a unit test must not start: the servers, engines and clusters of the tiers above.
SERVER_PROGRAMS = frozenset(
    {
        "nats-server",
        "etcd",
        "kube-apiserver",
        "kube-controller-manager",
        "kube-scheduler",
        "kwok",
        "versitygw",
        "vllm",
        "deepspeed",
    }
)
# Python modules a unit test must not run: rlfleet's components and runs, vLLM's, DeepSpeed's.
SERVER_MODULES = (
    "rlfleet.rollout",
    "rlfleet.trainer",
    "rlfleet.operator",
    "rlfleet.weightsync",
    "rlfleet.local",
    "rlfleet.testbed",
    "vllm",
    "deepspeed",
)
# `rlfleet` commands that start a run or the bed (the others read and write files).
SERVER_COMMANDS = frozenset({"run", "dev"})


def tier_of(path: Path, tests_root: Path) -> str | None:
    """The tier of a test file, from the first folder under tests/ (None outside a tier)."""
    parts = path.resolve().relative_to(tests_root.resolve()).parts
    return parts[0] if len(parts) > 1 and parts[0] in TIERS else None


def too_low(tier: str, fixtures: list[str]) -> list[str]:
    """The fixtures a test of `tier` asks for that start what a higher tier starts."""
    rank = TIERS.index(tier)
    return [f for f in fixtures if f in FIXTURE_TIERS and TIERS.index(FIXTURE_TIERS[f]) > rank]


def work_unit(nodeid: str) -> str:
    """What a parallel run's worker takes whole: the bed tier in one unit, so one worker
    starts the bed and the others never do, and every other module in one, so its module
    fixtures (an engine, a pool of servers) start once."""
    module = nodeid.split("::", 1)[0]
    return "bed" if module.startswith("tests/bed/") else module


def server_in(argv: list[str]) -> str | None:
    """What server, engine or cluster program `argv` starts, or None when it starts none."""
    if not argv:
        return None
    program = Path(str(argv[0])).name
    if program in SERVER_PROGRAMS:
        return program
    args = [str(arg) for arg in argv]
    command = args[1:]
    if "-m" in args[:-1]:
        module = args[args.index("-m") + 1]
        if module.startswith(SERVER_MODULES):
            return f"python -m {module}"
        if module != "rlfleet.cli":
            return None
        command = args[args.index("-m") + 2 :]
    elif program != "rlfleet":
        return None
    words = [arg for arg in command if not arg.startswith("-")]
    return f"rlfleet {words[0]}" if words and words[0] in SERVER_COMMANDS else None
