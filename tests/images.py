"""Each image's Python environment, built as its Dockerfile builds it, without a container
engine: the Dockerfile's `COPY`s staged into a source folder, a fresh virtualenv with
only the dependency sets its `pip install -r` lines name (pinned by the lock), and the
project installed from that folder without dependencies. uv's cache makes it fast.

What a base image brings is stood in for by the set that pins the same release
(`BASE_STANDINS`): the rollout image's vLLM is CUDA's, its environment here takes the
CPU build of that release.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
IMAGES = ROOT / "images"
REQUIREMENTS = ROOT / "requirements"

# A base image's Python packages -> the dependency set that pins the same release.
BASE_STANDINS = {"vllm/vllm-openai": "engine-cpu"}
# Where a COPY into the base image's interpreter lands: the environment's own site-packages.
BASE_SITE = "/usr/local/lib/python3.11/site-packages/"


@dataclass(frozen=True)
class Dockerfile:
    path: Path
    base: str  # the final stage's FROM
    copies: list[tuple[str, str]]  # (source in the repository, destination)
    installs: list[list[str]]  # each `pip install`'s arguments
    entrypoint: list[str]

    @property
    def name(self) -> str:
        return self.path.name.removesuffix(".Dockerfile")

    @property
    def sets(self) -> list[str]:
        """The dependency sets the image installs (`pip install -r requirements/SET.txt`)."""
        found = []
        for args in self.installs:
            found += [Path(args[i + 1]).stem for i, a in enumerate(args) if a == "-r"]
        return found

    @property
    def standins(self) -> list[str]:
        image = self.base.split(":")[0]
        return [BASE_STANDINS[image]] if image in BASE_STANDINS else []


def parse(path: Path) -> Dockerfile:
    lines = re.sub(r"\\\n", " ", path.read_text()).splitlines()
    instructions = [line.strip() for line in lines if line.strip() and not line.startswith("#")]
    base, copies, installs, entrypoint = "", [], [], []
    for line in instructions:
        word, _, rest = line.partition(" ")
        if word == "FROM":
            base = rest.split(" AS ")[0].strip()
        elif word == "COPY" and not rest.startswith("--from"):
            *sources, destination = shlex.split(rest)
            copies += [(source, destination) for source in sources]
        elif word == "ENTRYPOINT":
            entrypoint = json.loads(rest)
        elif word == "RUN":
            for command in rest.split("&&"):
                args = shlex.split(command)
                if args[:2] == ["pip", "install"]:
                    installs.append(args[2:])
    return Dockerfile(path, base, copies, installs, entrypoint)


def dockerfiles() -> list[Dockerfile]:
    return [parse(path) for path in sorted(IMAGES.glob("*.Dockerfile"))]


def pins(path: Path) -> dict[str, str]:
    """`name==version` lines of a requirements file, by normalised name."""
    found = {}
    for line in path.read_text().splitlines():
        name, sep, version = line.split("#")[0].strip().partition("==")
        if sep:
            found[re.sub(r"[-_.]+", "-", name.split(";")[0].strip().lower())] = version.strip()
    return found


def uv() -> str:
    """The uv `make setup` installed (its version is pinned in versions.env)."""
    version = re.search(r"^UV_VERSION=(\S+)", (ROOT / "versions.env").read_text(), re.M)
    assert version, "versions.env names no UV_VERSION"
    cache = os.environ.get("RLFLEET_CACHE") or str(
        Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "rlfleet"
    )
    return str(Path(cache) / f"uv-{version[1]}" / "bin" / "uv")


def stage(dockerfile: Dockerfile, folder: Path) -> Path:
    """The files the Dockerfile copies, where it copies them, relative to its WORKDIR."""
    for source, destination in dockerfile.copies:
        target = folder / destination.lstrip("/")
        if destination.endswith("/") or destination == "./":
            target = target / Path(source).name
        target.parent.mkdir(parents=True, exist_ok=True)
        if (ROOT / source).is_dir():
            ignore = shutil.ignore_patterns("__pycache__", "*.egg-info")
            shutil.copytree(ROOT / source, target, ignore=ignore, dirs_exist_ok=True)
        else:
            shutil.copy2(ROOT / source, target)
    return folder


def environment(dockerfile: Dockerfile, folder: Path) -> Path:
    """A fresh virtualenv as the image has it; returns its python."""
    source = stage(dockerfile, folder / "src")
    venv = folder / "venv"
    python = venv / "bin" / "python"
    tool = uv()

    def run(*args: str | Path) -> None:
        done = subprocess.run([tool, *map(str, args)], capture_output=True, text=True)
        assert done.returncode == 0, f"uv {' '.join(map(str, args))}:\n{done.stderr[-3000:]}"

    run("venv", "--quiet", "--python", "3.11", venv)
    sets = [*dockerfile.standins, *dockerfile.sets]
    requirements = [arg for s in sets for arg in ("-r", REQUIREMENTS / f"{s}.txt")]
    if requirements:
        # Set files are whole closures (`make lock`): nothing comes from outside them.
        run("pip", "install", "--quiet", "--no-deps", "--python", python, *requirements)
    if (source / "pyproject.toml").exists():
        run("pip", "install", "--quiet", "--python", python, "--no-deps", source)
    site = venv / "lib" / "python3.11" / "site-packages"
    for _, destination in dockerfile.copies:
        if destination.startswith(BASE_SITE):
            shutil.copytree(source / destination.lstrip("/"), site / destination[len(BASE_SITE) :])
    return python


class Environments:
    """Each image's Python environment (`environment`), built when first asked for."""

    def __init__(self, work: Path) -> None:
        self.work = work
        self.built: dict[str, Path] = {}

    def python(self, image: str) -> Path:
        if image not in self.built:
            dockerfile = parse(IMAGES / f"{image}.Dockerfile")
            self.built[image] = environment(dockerfile, self.work / image)
        return self.built[image]
