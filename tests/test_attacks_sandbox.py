"""Attacks on the EnvPool sandboxes' trust boundary, each one test, each against the real
parts: a real session server (root, namespace sandboxes) that two runs share, and the
real `sandbox_init`.

An attack succeeds when it reaches what is not its run's: another run's environment, the
pod's filesystem, or root's hand (root writing where a run pointed it). Each test asserts
that it does not.
"""

from __future__ import annotations

import asyncio
import base64
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from rlfleet.launch.settings import Limits, ServerConfig
from rlfleet.rollout import envsessions
from rlfleet.rollout.envclient import EnvClient, EnvServerError, LocalServer

LIMITS = Limits(
    disk_bytes=8 << 20,
    file_bytes=4 << 20,
    memory_bytes=512 << 20,
    processes=32,
    call_seconds=10,
    wall_seconds=120,
)
TOKENS = {"run-a": "a" * 8 + "-attacker-token", "run-b": "b" * 8 + "-victims-token"}
HOME_PARENT = "/run/rlfleet"  # where session servers on this machine keep their state
UID_BASE = 850_000
SANDBOX_INIT = Path(envsessions.__file__).with_name("sandbox_init.py")
ENVSERVER = Path(envsessions.__file__).with_name("envserver.py")
UNTOUCHED = "untouched\n"
PWNED = "pwned\n"


@dataclass
class Pool:
    server: LocalServer
    home: Path
    snapshots: Path  # the server's snapshots_dir
    mounts: Path  # the server's mounts_dir
    tokens_file: Path
    victim: Path  # a folder of the pod's, outside every sandbox: victim.txt in it

    def client(self, run: str) -> EnvClient:
        return EnvClient(self.server.url, TOKENS[run])

    def built(self, run: str, name: str) -> Path:
        """Where the server keeps `run`'s environment `name`."""
        return self.snapshots / ".runs" / base64.urlsafe_b64encode(run.encode()).decode() / name


@pytest.fixture(scope="module")
def pool() -> Iterator[Pool]:
    Path(HOME_PARENT).mkdir(parents=True, exist_ok=True)
    home = Path(tempfile.mkdtemp(prefix="attacks-", dir=HOME_PARENT))  # root's alone
    tokens_file = home / "tokens.json"
    tokens_file.write_text(json.dumps(TOKENS))
    tokens_file.chmod(0o600)
    victim = home / "victim"
    victim.mkdir()
    (victim / "victim.txt").write_text(UNTOUCHED)
    snapshots = home / "snapshots"
    snapshots.mkdir(mode=0o755)
    # A pool's shared environment, as an image may carry one, holding a link out of it.
    (snapshots / "linked").mkdir()
    (snapshots / "linked" / "out").symlink_to(victim)
    config = ServerConfig(
        tokens_file=str(tokens_file),
        snapshots_dir=str(snapshots),
        mounts_dir=str(home / "sandboxes"),
        limits=LIMITS,
        max_sessions=8,
        warm=2,
        max_body_bytes=1 << 20,
        uid_base=UID_BASE,
    )
    try:
        with LocalServer(config) as server:
            yield Pool(server, home, snapshots, home / "sandboxes", tokens_file, victim)
    finally:
        shutil.rmtree(home, ignore_errors=True)


def run(coroutine):
    return asyncio.run(coroutine)


def b64(text: str) -> str:
    return base64.b64encode(text.encode()).decode()


async def build(pool: Pool, run_name: str, name: str, setup: str, files: dict | None = None):
    async with pool.client(run_name) as env:
        await env.build_snapshot(name, {k: v.encode() for k, v in (files or {}).items()}, setup)


async def claim(pool: Pool, run_name: str, files: dict[str, str], snapshot: str) -> str:
    """Claims a fork of `snapshot` with `files`, then lists what the sandbox holds; or the
    server's refusal."""
    async with pool.client(run_name) as env:
        try:
            sandbox = await env.create({p: c.encode() for p, c in files.items()}, snapshot=snapshot)
        except EnvServerError as refused:
            return f"refused: {refused}"
        async with sandbox:
            reply = await sandbox.call({"tool": "run", "command": "ls -laR ."})
            return reply.get("output", "")


def links_out_of(tree: Path) -> list[str]:
    """Links in `tree` that are absolute or lead out of it."""
    found = []
    for directory, folders, files in os.walk(tree):
        for name in folders + files:
            path = Path(directory) / name
            if path.is_symlink():
                target = path.readlink()
                if target.is_absolute() or not path.resolve().is_relative_to(tree.resolve()):
                    found.append(f"{path.relative_to(tree)} -> {target}")
    return found


# --- root following what a run planted ---------------------------------------------------


@pytest.mark.attack("sandbox")
def test_symlink_into_another_runs_environment_claimed_with_files(pool: Pool) -> None:
    """Run A builds an environment holding a link into run B's, then claims it with a file
    at the link: root, writing the claim's files, would overwrite B's grader."""
    grader = "def test_solution():\n    assert solve() == 42\n"
    run(build(pool, "run-b", "grader", "true", {"tests/test_grade.py": grader}))
    b_tests = pool.built("run-b", "grader") / "tests"
    run(build(pool, "run-a", "trojan", f"ln -s {b_tests} hook"))
    run(claim(pool, "run-a", {"hook/test_grade.py": "def test_solution(): pass\n"}, "trojan"))
    assert (b_tests / "test_grade.py").read_text() == grader


@pytest.mark.attack("sandbox")
def test_relative_symlink_out_of_a_snapshot(pool: Pool) -> None:
    """A relative link that climbs out of the environment's tree: kept, it leads a fork's
    claim (root) into the pod's filesystem, here the server's own folder of sandboxes."""
    run(build(pool, "run-a", "climber", "ln -s ../.. up && ln -s ../../../../../../.. top"))
    escaped = "escaped-through-a-relative-link"
    listing = run(claim(pool, "run-a", {f"up/{escaped}": PWNED}, "climber"))
    assert not any(pool.home.rglob(escaped)), listing
    assert links_out_of(pool.built("run-a", "climber")) == []


@pytest.mark.attack("sandbox")
def test_absolute_symlink_in_a_snapshot(pool: Pool) -> None:
    """An absolute link in an environment: root follows it from the pod's root when a
    claim's file lies below it."""
    run(build(pool, "run-a", "absolute", f"ln -s {pool.victim} abs"))
    listing = run(claim(pool, "run-a", {"abs/victim.txt": PWNED}, "absolute"))
    assert (pool.victim / "victim.txt").read_text() == UNTOUCHED, listing
    assert links_out_of(pool.built("run-a", "absolute")) == []


@pytest.mark.attack("sandbox")
def test_link_in_a_shared_environment_is_not_followed_by_root(pool: Pool) -> None:
    """A link out of a pool's shared environment (the image's, which no run's build
    cleaned): a claim's file below it is refused, naming the file, rather than written
    by root wherever the link leads."""

    async def attack() -> str:
        async with pool.client("run-a") as env:
            try:
                await env.create({"out/victim.txt": PWNED.encode()}, snapshot="linked")
            except EnvServerError as refused:
                return f"{refused.status} {refused.param}"
            return "claimed"

    answer = run(attack())
    assert (pool.victim / "victim.txt").read_text() == UNTOUCHED
    assert answer == "422 files.out/victim.txt"


@pytest.mark.attack("sandbox")
def test_hardlink_in_a_snapshot(pool: Pool) -> None:
    """Hard links made in a build (to a file outside the tree, and within it): an
    environment keeps no name of a file that lies outside it, so a fork's write to one
    name reaches nothing but the fork."""
    setup = (
        "echo mine > /tmp/own && ln /tmp/own outside; ln /envserver.py server 2>/dev/null; "
        "ln ../envserver.py server2 2>/dev/null; echo one > a && ln a b; true"
    )
    run(build(pool, "run-a", "hardlinked", setup))
    tree = pool.built("run-a", "hardlinked")
    names: dict[int, int] = {}
    for path in tree.rglob("*"):
        if path.is_file() and not path.is_symlink():
            names[path.stat().st_ino] = names.get(path.stat().st_ino, 0) + 1
    for path in tree.rglob("*"):
        if path.is_file() and not path.is_symlink():
            assert path.stat().st_nlink <= names[path.stat().st_ino], path
    assert not (tree / "server").exists() and not (tree / "server2").exists()

    async def fork() -> str:
        async with (
            pool.client("run-a") as env,
            await env.create({"a": b"two\n"}, snapshot="hardlinked") as sandbox,
        ):
            return (await sandbox.call({"tool": "run", "command": "cat b"}))["output"]

    run(fork())
    assert (tree / "a").read_text() == "one\n" and (tree / "b").read_text() == "one\n"


@pytest.mark.attack("sandbox")
def test_fifo_in_a_snapshot_does_not_hold_a_claim(pool: Pool) -> None:
    """A named pipe left in an environment, then claimed with a file at its name: root
    opening it to write would wait for a reader for ever, holding the claim and a slot."""
    run(build(pool, "run-a", "piped", "mkfifo pipe"))
    started = time.monotonic()
    listing = run(claim(pool, "run-a", {"pipe": "data\n"}, "piped"))
    assert time.monotonic() - started < 20, listing
    assert "refused: 500" not in listing


# --- paths -------------------------------------------------------------------------------


@pytest.mark.attack("sandbox")
@pytest.mark.parametrize("path", ["../x", "a/../../x", "/etc/x", "./x", "a//x", "a/./x"])
def test_dotdot_in_claim_paths(pool: Pool, path: str) -> None:
    """A claim's file path that is not plain and relative is refused, naming it."""

    async def attack() -> EnvServerError:
        async with pool.client("run-a") as env:
            with pytest.raises(EnvServerError) as refused:
                await env.create({path: b"x"})
            return refused.value

    refused = run(attack())
    assert (refused.status, refused.param) == (400, f"files.{path}")


@pytest.mark.attack("sandbox")
def test_dotdot_in_a_claim_that_reaches_sandbox_init(pool: Pool) -> None:
    """`sandbox_init` does not lean on the server's check: a claim whose file path climbs
    out (as a server with a bug might pass one on) writes nothing outside the sandbox."""
    root = Path(tempfile.mkdtemp(prefix="sandbox-", dir=pool.mounts))
    root.chmod(0o755)
    settings = {
        "root": str(root),
        "disk_bytes": 1 << 20,
        "server": str(ENVSERVER),
        "python": "/usr/bin/python3",
        "private_dirs": ["/tmp"],
        "system_dirs": ["/usr", "/bin", "/sbin", "/lib", "/lib64", "/etc"],
    }
    init = subprocess.Popen(
        [
            *("unshare", "--net", "--pid", "--mount", "--ipc", "--uts"),
            *("--fork", "--kill-child", "--mount-proc"),
            *(sys.executable, "-I", str(SANDBOX_INIT), json.dumps(settings)),
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        start_new_session=True,
    )
    escaped = f"escaped-{os.getpid()}"
    try:
        assert init.stdin is not None and init.stdout is not None
        assert json.loads(init.stdout.readline()) == {"ready": True}
        limits = {name: 64 for name in envsessions.RLIMIT_FIELDS} | {"memory_bytes": 1 << 30}
        claimed = {
            "uid": UID_BASE + 999,
            "limits": limits | {"cpu_seconds": 10, "file_bytes": 1 << 20},
            "disk_bytes": 1 << 20,
            "snapshot": None,
            "manifest": None,
            "files": {f"../../{escaped}": b64(PWNED), f"a/../../../{escaped}-2": b64(PWNED)},
        }
        init.stdin.write(json.dumps(claimed) + "\n")
        init.stdin.flush()
        answer = json.loads(init.stdout.readline() or "null")
    finally:
        os.killpg(init.pid, 9)
        init.wait()
        shutil.rmtree(root, ignore_errors=True)
    # Both paths lead from the sandbox's tree to the server's folder of sandboxes.
    assert not (pool.mounts / escaped).exists() and not (pool.mounts / f"{escaped}-2").exists()
    assert answer is not None and answer.get("started") is False, answer
    assert answer["param"] == f"files.../../{escaped}"


# --- the pod's filesystem ----------------------------------------------------------------


@pytest.mark.attack("sandbox")
def test_sandbox_sees_none_of_the_pods_filesystem(pool: Pool) -> None:
    """pivot_root: a session's `/` is its own tmpfs, holding the image's system folders
    read-only and nothing of the pod's state: not the server's environments, sandboxes or
    tokens, by any path."""
    places = [pool.snapshots, pool.mounts, pool.tokens_file, pool.victim, Path(HOME_PARENT)]
    command = (
        f"ls -d {' '.join(map(str, places))} 2>&1; echo ROOT $(stat -f -c %T /); "
        "touch /usr/x /etc/x 2>&1; cat /proc/1/root/etc/hostname 2>&1 | head -1; "
        "ls /proc/1/root/ 2>&1 | head -3"
    )

    async def look() -> str:
        async with pool.client("run-a") as env, await env.create(None) as sandbox:
            return (await sandbox.call({"tool": "run", "command": command}))["output"]

    output = run(look())
    for place in places:
        assert f"{place}: No such file" in output or f"'{place}': No such file" in output, output
    assert "ROOT tmpfs" in output, output
    assert "Read-only file system" in output or "Permission denied" in output, output
