"""Benchmark: the environment session server on one machine. Prints one JSON object.

A real server (root, one namespace sandbox per session) with a task of a few files:
`create_ms_*` is a session made from scratch (copy the tree in, start the sandbox, first
answer), the stand-in for a claim until the operator keeps warm pools to claim from;
`tool_call_ms_p50` a no-op `run` over HTTP; `sessions_concurrent` how many idle sessions
the server held at once, each answering afterwards, with what one costs in memory and how
many the machine's available memory would hold; then every escape attempt of the tests
(`tests/envpool_escapes.py`). Keys the issue asks for that nothing measures yet are null,
with the reason under `null_because`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
import envpool_escapes  # the tests' escape attempts: one catalogue for both

from rlfleet.rollout.envclient import EnvClient, LocalServer, ServerConfig
from rlfleet.rollout.sandbox import DEFAULT_LIMITS

TOKENS = {"bench": "bench-token-" + "x" * 20, "other": "other-token-" + "y" * 20}


def _available() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) << 10
    raise RuntimeError("no MemAvailable in /proc/meminfo")


def _ms(seconds: list[float], q: float) -> float:
    ordered = sorted(seconds)
    return round(1000 * ordered[min(len(ordered) - 1, int(q * len(ordered)))], 2)


async def measure(server: LocalServer, task: Path, args, tokens_file: Path) -> dict:
    result: dict = {}
    async with EnvClient(server.url, TOKENS["bench"]) as env:
        created = []
        for _ in range(args.creates):
            started = time.perf_counter()
            session = await env.create(task)
            created.append(time.perf_counter() - started)
            await session.close()
        result["create_ms_p50"] = _ms(created, 0.5)
        result["create_ms_p99"] = _ms(created, 0.99)

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
    parser.add_argument("--creates", type=int, default=50)
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--sessions", type=int, default=200)
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
        config = ServerConfig(
            tokens_file=str(tokens_file), max_sessions=args.sessions + 8, uid_base=820_000
        )
        with LocalServer(config) as server:
            result = asyncio.run(measure(server, task, args, tokens_file))
    result |= {
        "claim_ms_p50": None,
        "claim_ms_p99": None,
        "fork_ms_p50": None,
        "setup_ms_p50": None,
        "create_over_claim_target_p99": round(result["create_ms_p99"] / 100, 2),
        "null_because": {
            "claim_ms": "no warm pool to claim from yet (the operator's claims come next): "
            "create_ms_* is a session made from scratch",
            "fork_ms_p50": "no environment snapshots forked from a set-up session yet",
            "setup_ms_p50": "no environment set-up step (install, build) to time yet",
        },
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
