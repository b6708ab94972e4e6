"""The suite's tiers (`tiers`): which folder a test belongs in, and what a unit test may not
start. The conftest applies them to every test; here they are held to what they promise."""

from __future__ import annotations

from pathlib import Path

import pytest
import tiers
from conftest import TESTS


@pytest.mark.parametrize(
    ("argv", "started"),
    [
        (["/repo/.venv/bin/nats-server", "-c", "hub.conf"], "nats-server"),
        (["/repo/.bin/kube-apiserver", "--etcd-servers=http://127.0.0.1:2379"], "kube-apiserver"),
        (["python", "-m", "rlfleet.rollout", "--rlrun"], "python -m rlfleet.rollout"),
        (
            ["python", "-I", "-m", "rlfleet.rollout.envpool", "{}"],
            "python -m rlfleet.rollout.envpool",
        ),
        (
            ["python", "-m", "vllm.entrypoints.openai.api_server"],
            "python -m vllm.entrypoints.openai.api_server",
        ),
        (["python", "-m", "rlfleet.cli", "run", "examples/local.yaml"], "rlfleet run"),
        (["/repo/.venv/bin/rlfleet", "--quiet", "dev", "up"], "rlfleet dev"),
        (["python", "-m", "rlfleet.cli", "crds", "check"], None),
        (["/repo/.venv/bin/rlfleet", "docs", "generate"], None),
        (["/repo/.bin/helm", "template", "rlfleet", "helm/rlfleet"], None),
        (["git", "init", "-q"], None),
        (["python", "-c", "print(1)"], None),
        ([], None),
    ],
)
def test_a_unit_test_may_run_commands_but_not_start_servers(
    argv: list[str], started: str | None
) -> None:
    assert tiers.server_in(argv) == started


def test_the_tier_is_the_first_folder_under_tests() -> None:
    assert tiers.tier_of(TESTS / "unit" / "test_x.py", TESTS) == "unit"
    assert tiers.tier_of(TESTS / "bed" / "test_x.py", TESTS) == "bed"
    assert tiers.tier_of(TESTS / "test_x.py", TESTS) is None
    assert tiers.tier_of(TESTS / "probes" / "x.py", TESTS) is None


def test_a_fixture_of_a_higher_tier_is_out_of_place_and_one_below_is_not() -> None:
    assert tiers.too_low("unit", ["tmp_path", "nats_servers"]) == ["nats_servers"]
    assert tiers.too_low("servers", ["nats_servers", "vllm_probe"]) == ["vllm_probe"]
    assert tiers.too_low("engines", ["tiny_moe", "nats_servers"]) == []
    assert tiers.too_low("bed", ["testbed", "vllm_probe", "nats_servers"]) == []


def test_every_test_file_is_in_a_tier_and_every_tier_has_tests() -> None:
    outside = [p.name for p in TESTS.glob("test_*.py")]
    assert outside == [], f"test files outside a tier's folder: {outside}"
    for tier in tiers.TIERS:
        assert any((TESTS / tier).glob("test_*.py")), tier
    # One conftest: tests import its helpers by name (`from conftest import ...`).
    assert not any(Path(TESTS, tier, "conftest.py").exists() for tier in tiers.TIERS)


def test_a_parallel_run_keeps_the_bed_tier_on_one_worker_and_each_module_whole() -> None:
    on_the_bed = {
        tiers.work_unit(n) for n in ("tests/bed/test_a.py::t", "tests/bed/test_b.py::t[1]")
    }
    assert on_the_bed == {"bed"}
    assert tiers.work_unit("tests/engines/test_a.py::test_x[a::b]") == "tests/engines/test_a.py"
    assert tiers.work_unit("tests/unit/test_a.py::test_x") == "tests/unit/test_a.py"
    assert tiers.PARALLEL_ORDER[0] == "bed" and set(tiers.PARALLEL_ORDER) == set(tiers.TIERS)
