"""Benchmark: the environment session server on one machine. Prints one JSON object.

A real server (root, one namespace sandbox per session) with a task of a few files:
`claim_ms_*` a claim from the warm pool (the tree written in, the server started, its
first answer), the pool refilled between claims; `burst_claim_ms_p99` claims twice as
many as are warm at once (the rest start cold); `setup_ms_p50` an environment set up in
a session from scratch (a virtualenv with pip, offline, and a package of `--files`
modules, byte-compiled),
`fork_ms_p50` a claim forking the same environment built once as a snapshot;
`tool_call_ms_p50` a no-op `run` over HTTP; `sessions_concurrent` how many idle sessions
the server held at once, each answering afterwards, with what one costs in memory and how
many the machine's available memory would hold; then every escape attempt of the tests
(`tests/envpool_escapes.py`). `--quick` runs all of it at the smallest counts, to check
the script.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
import envpool_escapes  # the tests' escape attempts: one catalogue for both

from rlfleet.launch.settings import ServerConfig
from rlfleet.rollout.environment.envclient import EnvClient, LocalServer
from rlfleet.rollout.environment.sandbox import DEFAULT_LIMITS

# --quick's defaults: every part once or twice (sessions are claimed eight at a time).
QUICK = {"claims": 2, "warm": 1, "files": 10, "setups": 1, "calls": 10, "sessions": 8}
TOKENS = {"bench": "bench-token-" + "x" * 20, "other": "other-token-" + "y" * 20}


def _available() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) << 10
    raise RuntimeError("no MemAvailable in /proc/meminfo")


def _ms(seconds: list[float], q: float) -> float:
    ordered = sorted(seconds)
    return round(1000 * ordered[min(len(ordered) - 1, int(q * len(ordered)))], 2)


SETUP = (
    "python3 -m venv .venv && mkdir -p pkg && for i in $(seq {files}); do "
    "printf 'def f(x):\\n    return x + %s\\n' $i > pkg/m$i.py; done && "
    ".venv/bin/python -m compileall -q pkg"
)


async def _warm(env: EnvClient, count: int) -> None:
    """Until the pool holds `count` ready sandboxes (within ten seconds)."""
    for _ in range(1000):
        if (await env.health())["ready"] >= count:
            return
        await asyncio.sleep(0.01)


async def _timed(claim) -> float:
    started = time.perf_counter()
    session = await claim
    seconds = time.perf_counter() - started
    await session.close()
    return seconds


async def environments(env: EnvClient, task: Path, args) -> dict:
    setup = SETUP.format(files=args.files)
    setups = []
    for _ in range(args.setups):
        started = time.perf_counter()
        async with await env.create(task) as session:
            reply = await session.call({"tool": "run", "command": setup}, 600)
            assert reply.get("exit_code") == 0, reply
        setups.append(time.perf_counter() - started)
    await env.build_snapshot("env", task, setup)
    forks = []
    for _ in range(args.claims // 2):
        await _warm(env, args.warm)
        forks.append(await _timed(env.create(None, snapshot="env")))
    return {"setup_ms_p50": _ms(setups, 0.5), "fork_ms_p50": _ms(forks, 0.5)}


async def measure(
    server: LocalServer, task: Path, args, tokens_file: Path, snapshots: Path
) -> dict:
    result: dict = {}
    async with EnvClient(server.url, TOKENS["bench"]) as env:
        claims = []
        for _ in range(args.claims):
            await _warm(env, args.warm)
            claims.append(await _timed(env.create(task)))
        result["claim_ms_p50"] = _ms(claims, 0.5)
        result["claim_ms_p99"] = _ms(claims, 0.99)
        await _warm(env, args.warm)
        burst = await asyncio.gather(*(_timed(env.create(task)) for _ in range(2 * args.warm)))
        result["burst_claim_ms_p99"] = _ms(burst, 0.99)
        result |= await environments(env, task, args)
        result["fork_over_setup"] = round(result["fork_ms_p50"] / result["setup_ms_p50"], 4)

        async with await env.create(task) as session:
            calls = []
            for _ in range(args.calls):
                started = time.perf_counter()
                await session.call({"tool": "run", "command": ":"})
                calls.append(time.perf_counter() - started)
        result["tool_call_ms_p50"] = _ms(calls, 0.5)

        before = _available()
        held = []
        for _ in range(0, args.sessions, 8):  # a few at a time, as a burst of claims would
            held += await asyncio.gather(*(env.create(task) for _ in range(8)))
        await asyncio.sleep(1)  # let the new processes settle before reading memory
        per_session = max(1, (before - _available()) // len(held))
        answers = await asyncio.gather(
            *(s.call({"tool": "run", "command": "echo up"}) for s in held)
        )
        result["sessions_concurrent"] = sum(a.get("output") == "up\n" for a in answers)
        result["session_mib"] = round(per_session / (1 << 20), 1)
        result["sessions_fit_in_available_memory"] = before // per_session
        await asyncio.gather(*(s.close() for s in held))

        async with EnvClient(server.url, TOKENS["other"]) as other:
            target = envpool_escapes.Target(
                url=server.url,
                port=int(server.url.rsplit(":", 1)[1]),
                server_pid=server.process.pid,
                tokens_file=tokens_file,
                token=TOKENS["bench"],
                other_token=TOKENS["other"],
                client=env,
                other=other,
                disk_bytes=DEFAULT_LIMITS.disk_bytes,
                snapshots_dir=snapshots,
            )
            escaped = {}
            async with await envpool_escapes.bystander(other) as bystander:
                for name in envpool_escapes.ATTEMPTS:
                    how = await envpool_escapes.attempt(name, target, bystander)
                    if how is not None:
                        escaped[name] = how
        result["escape_attempts"] = len(envpool_escapes.ATTEMPTS)
        result["escapes"] = len(escaped)
        result["escaped"] = escaped
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--claims", type=int, default=100)
    parser.add_argument("--warm", type=int, default=8)
    parser.add_argument("--files", type=int, default=2000, help="modules the set-up writes")
    parser.add_argument("--setups", type=int, default=3, help="environments set up from scratch")
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--sessions", type=int, default=200)
    parser.add_argument("--quick", action="store_true", help="smallest sizes: check the script")
    if parser.parse_known_args()[0].quick:
        parser.set_defaults(**QUICK)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="rlfleet-bench-envpool-") as tmp:
        tokens_file = Path(tmp) / "tokens.json"
        tokens_file.write_text(json.dumps(TOKENS))
        tokens_file.chmod(0o600)
        task = Path(tmp) / "task"
        (task / "src").mkdir(parents=True)
        (task / "README.md").write_text("fix add()\n")
        (task / "src" / "add.py").write_text("def add(a, b):\n    return a - b\n")
        (task / "tests.py").write_text("from src.add import add\nassert add(2, 2) == 4\n")
        snapshots = Path(tempfile.mkdtemp(prefix="bench-snapshots-", dir="/run/rlfleet"))
        config = ServerConfig(
            tokens_file=str(tokens_file),
            snapshots_dir=str(snapshots),
            max_sessions=args.sessions + 8,
            warm=args.warm,
            uid_base=820_000,
        )
        try:
            with LocalServer(config) as server:
                result = asyncio.run(measure(server, task, args, tokens_file, snapshots))
        finally:
            shutil.rmtree(snapshots)
    result["claim_over_target_p99"] = round(result["claim_ms_p99"] / 100, 2)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
