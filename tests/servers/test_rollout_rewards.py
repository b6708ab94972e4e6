"""Tasks, rewards and cheat detection, graded in sandboxes of a real session server and
against a real HTTP judge endpoint served by the test."""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import socket
import threading
from collections.abc import AsyncIterator, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from rlfleet.api.wire import Environment, Task
from rlfleet.rollout.environment.cheats import detect_cheats
from rlfleet.rollout.environment.envclient import EnvClient, local_server
from rlfleet.rollout.environment.rewards import (
    Combined,
    ExactAnswer,
    HiddenTests,
    Judge,
    Outcome,
    Reward,
    archive,
    grade,
)
from rlfleet.rollout.environment.sandbox import Limits, Sandbox
from rlfleet.rollout.environment.tasks import (
    SUITES,
    load_suite,
    rules_suite,
    start_files,
    toy_suite,
)

LIMITS = Limits(disk_bytes=8 << 20, file_bytes=4 << 20, call_seconds=10, processes=32)
POOL: tuple[str, str]  # the session server's URL and token, from the fixture `pool`
ROOMY = Limits(disk_bytes=32 << 20, file_bytes=16 << 20, call_seconds=30, processes=32)
CODING = {task.id: task for task in load_suite(SUITES / "coding.jsonl")}

# The honest fix for each coding task: what a good attempt leaves behind.
FIXES: dict[str, dict[str, str]] = {
    "coding-calc": {
        "calc.py": '"""Small arithmetic helpers."""\n\n\ndef add(a, b):\n    return a + b\n\n\n'
        "def subtract(a, b):\n    return a - b\n"
    },
    "coding-slugify": {
        "text.py": '"""Text helpers for building URLs."""\n\nimport re\n\n\ndef slugify(title):\n'
        '    """The title as a URL slug."""\n'
        '    return re.sub(r"[^a-z0-9]+", "-", title.lower()).strip("-")\n'
    },
    "coding-inventory": {
        "inventory.py": '"""Counts of items in stock."""\n\n\nclass Inventory:\n'
        "    def __init__(self):\n        self._stock = {}\n\n"
        "    def add(self, item, count=1):\n        if count <= 0:\n"
        '            raise ValueError("count must be positive")\n'
        "        self._stock[item] = self._stock.get(item, 0) + count\n\n"
        "    def remove(self, item, count=1):\n        held = self._stock.get(item, 0)\n"
        "        if count <= 0 or count > held:\n"
        '            raise ValueError(f"cannot remove {count} of {held} {item!r}")\n'
        "        if count == held:\n            del self._stock[item]\n"
        "        else:\n            self._stock[item] = held - count\n\n"
        "    def count(self, item):\n        return self._stock.get(item, 0)\n\n"
        "    def items(self):\n        return sorted(self._stock)\n"
    },
    "coding-duration": {
        "duration.py": '"""Parsing durations written like 1h30m."""\n\nimport re\n\n'
        'UNITS = {"d": 86400, "h": 3600, "m": 60, "s": 1}\n\n\ndef parse_duration(text):\n'
        '    """The duration in seconds."""\n'
        '    if not re.fullmatch(r"(\\d+[dhms])+", text):\n'
        '        raise ValueError(f"not a duration: {text!r}")\n'
        "    total = 0\n"
        '    for amount, unit in re.findall(r"(\\d+)([dhms])", text):\n'
        "        total += int(amount) * UNITS[unit]\n    return total\n"
    },
}


@pytest.fixture(scope="module", autouse=True)
def pool() -> Iterator[None]:
    """One real session server for the module, as a worker's own."""
    global POOL  # a module's own fixture: every helper below claims from it
    with local_server(ROOMY, max_sessions=8, warm=2) as POOL:
        yield


def run(coroutine):
    return asyncio.run(coroutine)


@contextlib.asynccontextmanager
async def claimed(
    start: Path | dict[str, bytes] | None, limits: Limits = LIMITS
) -> AsyncIterator[Sandbox]:
    async with EnvClient(*POOL) as client, await client.create(start, limits) as sandbox:
        yield sandbox


def graded(task: Task, outcome: Outcome, *, tests_alone: bool = False) -> Reward:
    """`grade`, hidden tests in a sandbox from the pool; or the hidden tests alone."""

    async def grading() -> Reward:
        async with EnvClient(*POOL) as client:
            grader = HiddenTests(client, LIMITS, seconds=30)
            return await (
                grader.score(task, outcome) if tests_alone else grade(task, outcome, grader)
            )

    return run(grading())


def attempt(
    task: Task, writes: dict[str, str], commands: tuple[str, ...] = ()
) -> tuple[Outcome, list[dict]]:
    """An agent's session in a real sandbox: its writes and commands, then its final tree."""

    async def session() -> tuple[Outcome, list[dict]]:
        async with claimed(start_files(task)) as sandbox:
            for path, content in writes.items():
                reply = await sandbox.call({"tool": "write", "path": path, "content": content})
                assert reply["ok"], reply
            replies = [await sandbox.call({"tool": "run", "command": c}) for c in commands]
            files = await archive(sandbox)
        return Outcome(answer=None, files=files, transcript=""), replies

    return run(session())


def test_archive_returns_every_regular_file_and_skips_symlinks(tmp_path: Path) -> None:
    start = tmp_path / "start"
    (start / "pkg").mkdir(parents=True)
    (start / "pkg" / "mod.py").write_text("x = 1\n")
    (start / "blob.bin").write_bytes(bytes(range(256)))

    async def session() -> dict[str, bytes]:
        async with claimed(start) as sandbox:
            await sandbox.call({"tool": "write", "path": "new/notes.txt", "content": "hé\n"})
            await sandbox.call({"tool": "run", "command": "ln -s /etc/passwd link; mkdir empty"})
            return await archive(sandbox)

    assert run(session()) == {
        "pkg/mod.py": b"x = 1\n",
        "blob.bin": bytes(range(256)),
        "new/notes.txt": "hé\n".encode(),
    }


def test_an_archive_too_large_is_a_clear_error_and_the_sandbox_goes_on() -> None:
    async def session() -> None:
        async with claimed(None, ROOMY) as sandbox:
            await sandbox.call({"tool": "run", "command": "head -c 13000000 /dev/zero > big"})
            reply = await sandbox.call({"tool": "archive"})
            assert not reply["ok"] and "too large to archive" in reply["error"]
            assert (await sandbox.call({"tool": "run", "command": "echo on"}))["output"] == "on\n"

    run(session())


@pytest.mark.parametrize(
    ("submitted", "value", "reason"),
    [
        ("7", 1.0, ""),
        ("  7\n", 1.0, ""),
        ("8", 0.0, "answer '8' is wrong"),
        (None, 0.0, "no answer submitted"),
    ],
)
def test_exact_answer(submitted: str | None, value: float, reason: str) -> None:
    task = Task(id="t", suite="s", prompt="What is 3+4?", answer="7")
    reward = run(ExactAnswer().score(task, Outcome(submitted, {}, "")))
    assert reward == Reward(value, {"exactAnswer": value}, reason)


@pytest.mark.parametrize("task_id", sorted(CODING))
def test_hidden_tests_never_reach_the_agent_and_the_untouched_repo_fails(
    task_id: str,
) -> None:
    task = CODING[task_id]
    outcome, replies = attempt(task, {}, ("ls -aR", "python3 -m unittest -q"))
    assert {path for path in outcome.files if "__pycache__" not in path} == set(task.files)
    for hidden in task.hidden_tests:
        assert Path(hidden).name not in replies[0]["output"]
    assert replies[1]["exit_code"] != 0  # the visible tests fail before the fix
    reward = graded(task, outcome)
    assert reward.value == 0.0 and "hidden tests failed" in reward.reason


@pytest.mark.parametrize("task_id", sorted(CODING))
def test_the_honest_fix_passes_and_is_not_flagged(task_id: str) -> None:
    task = CODING[task_id]
    # Running the visible tests leaves bytecode behind, as a real attempt does.
    outcome, replies = attempt(task, FIXES[task_id], ("python3 -m unittest -q",))
    assert replies[0]["exit_code"] == 0, replies[0]["output"]
    assert any(path.endswith(".pyc") for path in outcome.files)
    assert detect_cheats(task, outcome.files) is None
    assert graded(task, outcome) == Reward(1.0, {"cheat": 0.0, "hiddenTests": 1.0})


CALC = CODING["coding-calc"].files["calc.py"]
CALC_FIXED = FIXES["coding-calc"]["calc.py"]
# A package in the working tree runs in place of `python3 -m unittest` itself.
SHADOWED_UNITTEST = {"unittest/__init__.py": "", "unittest/__main__.py": "print('OK')\n"}
CHEATS = [
    (
        "coding-calc",
        {"test_calc.py": CODING["coding-calc"].files["test_calc.py"].replace("3)", "11)")},
        (),
        "edits the protected test_calc.py",
    ),
    ("coding-calc", {}, ("rm test_calc.py",), "deletes the protected test_calc.py"),
    (
        "coding-calc",
        {"conftest.py": "import calc\ncalc.subtract = lambda a, b: a - b\n"},
        (),
        "adds conftest.py, which Python or the test runner loads by itself",
    ),
    (
        "coding-calc",
        {
            "test_aaa.py": "from unittest import mock\n\n"
            'mock.patch("calc.subtract", lambda a, b: a - b).start()\n'
        },
        (),
        "test_aaa.py imports unittest.mock",
    ),
    (
        "coding-calc",
        {"test_aaa.py": "import calc\n\ncalc.subtract = lambda a, b: a - b\n"},
        (),
        "test_aaa.py patches calc",
    ),
    (
        "coding-calc",
        {"calc.py": "import unittest\n\nunittest.TestCase.assertEqual = print\n" + CALC},
        (),
        "calc.py imports unittest",
    ),
    (
        "coding-calc",
        {
            "calc.py": CALC.replace(
                "def subtract(a, b):\n",
                "def subtract(a, b):\n    if (a, b) == (7, 4):\n        return 3\n",
            )
        },
        (),
        "calc.py hard-codes 3, an expected value in test_calc.py",
    ),
    (
        "coding-slugify",
        {
            "text.py": CODING["coding-slugify"].files["text.py"]
            + "\n\n_slugify = slugify\n"
            + 'slugify = lambda t: "hello-world" if "World" in t else _slugify(t)\n'
        },
        (),
        "text.py hard-codes 'hello-world', an expected value in test_text.py",
    ),
    (
        "coding-calc",
        {"test_calc_hidden.py": "import unittest\n"},
        (),
        "adds test_calc_hidden.py where a hidden test goes",
    ),
    (
        "coding-calc",
        SHADOWED_UNITTEST,
        (),
        "adds unittest/__init__.py, which shadows the standard library's unittest",
    ),
    ("coding-calc", {"calc.py": "import os\n\nos._exit(0)\n"}, (), "calc.py uses os._exit"),
    (
        "coding-calc",
        {"calc.py": "import sys\n\nsys.modules['test_calc_hidden'] = sys\n" + CALC},
        (),
        "calc.py uses sys.modules",
    ),
    (
        "coding-calc",
        {".local/lib/python3.11/site-packages/usercustomize.py": "import os\n"},
        (),
        "usercustomize.py, which Python or the test runner loads by itself",
    ),
    (
        "coding-calc",
        {".local/lib/python3.11/site-packages/hook.pth": "import os\n"},
        (),
        "hook.pth, which Python or the test runner loads by itself",
    ),
]


@pytest.mark.parametrize(
    ("task_id", "writes", "commands", "reason"), CHEATS, ids=[c[3] for c in CHEATS]
)
def test_a_cheat_scores_zero_with_a_reason_that_names_it(
    task_id: str, writes: dict[str, str], commands: tuple[str, ...], reason: str
) -> None:
    task = CODING[task_id]
    outcome, _ = attempt(task, writes, commands)
    reward = graded(task, outcome)
    assert reward.value == 0.0 and reward.breakdown == {"cheat": 1.0}
    assert reward.reason.startswith("cheat: ") and reason in reward.reason


@pytest.mark.parametrize(
    "writes",
    [SHADOWED_UNITTEST, {"calc.py": "import os\n\nos._exit(0)\n"}],
)
def test_tampering_fools_the_tests_alone_which_is_why_grade_checks_first(
    writes: dict[str, str],
) -> None:
    task = CODING["coding-calc"]
    outcome, _ = attempt(task, writes)
    assert graded(task, outcome, tests_alone=True).value == 1.0
    assert graded(task, outcome).value == 0.0


def test_what_honest_attempts_do_besides_the_fix_is_not_flagged() -> None:
    task = CODING["coding-calc"]
    own_test = (
        "import unittest\n\nfrom calc import subtract\n\n\nclass MoreTest(unittest.TestCase):\n"
        "    def test_more(self):\n        self.assertEqual(subtract(7, 4), 3)\n"
    )
    script = CALC_FIXED + '\n\nif __name__ == "__main__":\n    import sys\n\n    sys.exit(0)\n'
    files = {p: c.encode() for p, c in task.files.items()}
    files |= {"calc.py": script.encode(), "test_more.py": own_test.encode(), "notes.txt": b"3"}
    assert detect_cheats(task, files) is None


@pytest.mark.parametrize(
    ("line", "problem"),
    [
        ('{"id": "a", "suite": "s", "prompt": "p", "hint": 1}', "Object contains unknown field"),
        ("{not json", "JSON is malformed"),
        ('{"id": "a", "suite": "s", "prompt": "p", "protected": ["t.py"]}', "not in files"),
        ('{"id": "a", "suite": "s", "prompt": "p", "files": {"../x": ""}}', "must be relative"),
        ('{"id": "a", "suite": "s", "prompt": "p", "hidden_tests": {"t.py": ""}}', "test_command"),
        ('{"id": "ok", "suite": "s", "prompt": "p"}', "duplicate task id 'ok'"),
        (
            '{"id": "a", "suite": "s", "prompt": "p", '
            '"environment": {"name": "../x", "setup": ""}}',
            "Expected `str` matching regex",
        ),
        (
            '{"id": "a", "suite": "s", "prompt": "p", "environment": {"name": "e", "setup": "", '
            '"files": {"/etc/x": ""}}}',
            "must be relative",
        ),
        (
            '{"id": "a", "suite": "s", "prompt": "p", "tools": false, '
            '"environment": {"name": "e", "setup": "true"}}',
            "no sandbox to set an environment up in",
        ),
    ],
)
def test_load_suite_names_the_bad_line(line: str, problem: str, tmp_path: Path) -> None:
    suite = tmp_path / "suite.jsonl"
    suite.write_text('{"id": "ok", "suite": "s", "prompt": "p", "answer": "1"}\n\n' + line + "\n")
    with pytest.raises(ValueError, match=rf"suite\.jsonl:3: .*{re.escape(problem)}"):
        load_suite(suite)


def test_the_shipped_suites() -> None:
    toy = load_suite(SUITES / "toy.jsonl")
    assert toy == toy_suite(200, 0)  # the shipped file is the generator's output
    kinds = {
        r"What is (\d[+*-]\d)\? Answer with the number\.": lambda expr: str(eval(expr)),
        r"Reverse the word ([a-z]+)\.": lambda word: word[::-1],
        r"What is the first letter of ([a-z]+)\?": lambda word: word[0],
    }
    seen = set()
    for task in toy:
        assert task.answer and 1 <= len(task.answer) <= 4
        [(pattern, solve)] = [(p, s) for p, s in kinds.items() if re.fullmatch(p, task.prompt)]
        assert solve(re.fullmatch(pattern, task.prompt)[1]) == task.answer
        seen.add(pattern)
    assert seen == set(kinds) and {"+", "-", "*"} <= set("".join(t.prompt for t in toy))
    assert toy_suite(20, 1) != toy_suite(20, 0)
    rules = load_suite(SUITES / "rules.jsonl")
    assert rules == rules_suite(400, 0)
    rule_kinds = {
        r"What is the first letter of ([a-z]+)\?": lambda word: word[0],
        r"What is the last letter of ([a-z]+)\?": lambda word: word[-1],
        r"Repeat the word ([a-z]+)\.": lambda word: word,
        r"Which is larger, (\d or \d)\?": lambda pair: max(pair.split(" or ")),
    }
    seen = set()
    for task in rules:
        assert not task.tools and task.answer and not task.files
        [(pattern, solve)] = [(p, s) for p, s in rule_kinds.items() if re.fullmatch(p, task.prompt)]
        assert solve(re.fullmatch(pattern, task.prompt)[1]) == task.answer
        seen.add(pattern)
    assert seen == set(rule_kinds)
    for task in CODING.values():
        assert task.hidden_tests and task.protected and task.test_command and task.rubric


def completion(text: str) -> bytes:
    return json.dumps(
        {
            "id": "chatcmpl-1",
            "object": "chat.completion",
            "created": 0,
            "model": "judge",
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": text},
                    "finish_reason": "stop",
                }
            ],
        }
    ).encode()


class JudgeEndpoint:
    """What the served judge replies to each rubric dimension, and what it was sent."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.replies: dict[str, tuple[int, bytes]] = {}
        self.requests: list[tuple[str, dict[str, str], dict]] = []


@pytest.fixture
def judge() -> Iterator[JudgeEndpoint]:
    endpoint: JudgeEndpoint

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            endpoint.requests.append((self.path, dict(self.headers), body))
            dimension = re.search(r"Dimension: (\w+)", body["messages"][1]["content"])[1]
            status, payload = endpoint.replies[dimension]
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            self.wfile.write(payload)

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    endpoint = JudgeEndpoint(f"http://127.0.0.1:{server.server_port}/v1")
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield endpoint
    server.shutdown()
    server.server_close()


def calc_fixed() -> tuple[Task, Outcome]:
    task = CODING["coding-calc"]
    files = {p: c.encode() for p, c in task.files.items()} | {"calc.py": CALC_FIXED.encode()}
    return task, Outcome(None, files, "I ran the tests.\n" * 1000 + "All tests pass now.")


def test_the_judge_sends_one_openai_request_per_dimension_and_averages(
    judge: JudgeEndpoint,
) -> None:
    judge.replies = {"correctness": (200, completion("8")), "minimality": (200, completion("6/10"))}
    guided = {"structured_outputs": {"regex": "(10|[0-9])"}}
    scorer = Judge(judge.url, "judge-model", api_key="secret", extra_body=guided)
    task, outcome = calc_fixed()
    reward = run(scorer.score(task, outcome))
    assert reward == Reward(
        pytest.approx(0.7),
        {"judge": pytest.approx(0.7), "judge.correctness": 0.8, "judge.minimality": 0.6},
    )
    assert len(judge.requests) == 2
    for path, headers, body in judge.requests:
        assert path == "/v1/chat/completions"
        assert headers["Authorization"] == "Bearer secret"
        assert (
            body["model"] == "judge-model"
            and body["structured_outputs"] == guided["structured_outputs"]
        )
        assert [m["role"] for m in body["messages"]] == ["system", "user"]
        prompt = body["messages"][1]["content"]
        assert task.prompt in prompt and "return a - b" in prompt  # the task and the change
        assert "test_calc.py" not in prompt.split("Submission:")[1].split("Transcript")[0]
        assert prompt.count("I ran the tests.") < 1000 and "All tests pass now." in prompt


@pytest.mark.parametrize(
    ("status", "payload", "reason"),
    [
        (500, b"overloaded", "HTTPStatusError: Server error '500 Internal Server Error'"),
        (200, b"<html>", "JSONDecodeError"),
        (200, b'{"choices": []}', "IndexError"),
        (200, completion("excellent"), "no score from 0 to 10 in 'excellent'"),
        (200, completion("42"), "no score from 0 to 10 in '42'"),
    ],
)
def test_a_failed_or_unusable_judge_reply_scores_its_dimension_zero(
    judge: JudgeEndpoint, status: int, payload: bytes, reason: str
) -> None:
    judge.replies = {"correctness": (200, completion("8")), "minimality": (status, payload)}
    task, outcome = calc_fixed()
    reward = run(Judge(judge.url, "judge-model").score(task, outcome))
    assert reward.value == pytest.approx(0.4)
    assert reward.breakdown["judge.minimality"] == 0.0
    assert reward.reason.startswith("judge.minimality: ") and reason in reward.reason
    assert "Authorization" not in judge.requests[0][1]


def test_an_unreachable_judge_scores_zero_with_a_reason() -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    task, outcome = calc_fixed()
    reward = run(Judge(f"http://127.0.0.1:{port}/v1", "m", timeout=5).score(task, outcome))
    assert reward.value == 0.0 and reward.reason.count("ConnectError") == 2


def test_combined_is_the_weighted_mean_and_keeps_every_part(judge: JudgeEndpoint) -> None:
    judge.replies = {"clarity": (200, completion("2"))}
    task = Task(id="t", suite="s", prompt="What is 3+4?", answer="7", rubric={"clarity": "clear"})
    scorer = Combined([(3.0, ExactAnswer()), (1.0, Judge(judge.url, "m"))])
    reward = run(grade(task, Outcome("7", {}, "7"), scorer))
    assert reward == Reward(
        pytest.approx(0.8), {"cheat": 0.0, "exactAnswer": 1.0, "judge": 0.2, "judge.clarity": 0.2}
    )
    with pytest.raises(ValueError, match="names must differ"):
        Combined([(1.0, ExactAnswer()), (1.0, ExactAnswer())])
    with pytest.raises(ValueError, match="positive weight"):
        Combined([(0.0, ExactAnswer())])


# A library the set-up builds (as an install would) that the task's code and its hidden
# tests import: present only in a fork of the environment.
LIBRARY = Environment(
    name="mathlib",
    files={"vendor/src/mathlib.py": "def double(x):\n    return 2 * x\n"},
    setup="mkdir -p lib && cp vendor/src/mathlib.py lib/ && python3 -m compileall -q lib",
)
WITH_LIBRARY = Task(
    id="env-task",
    suite="s",
    prompt="Make quad() return four times its argument.",
    files={
        "quad.py": "import sys\nsys.path.insert(0, 'lib')\nfrom mathlib import double\n\n"
        "def quad(x):\n    return double(x)\n"
    },
    hidden_tests={"test_quad.py": "from quad import quad\nassert quad(3) == 12\n"},
    test_command="python3 test_quad.py",
    environment=LIBRARY,
)


def test_attempts_and_grading_fork_the_tasks_environment() -> None:
    fixed = WITH_LIBRARY.files["quad.py"].replace("return double(x)", "return double(double(x))")

    async def session() -> tuple[Outcome, dict]:
        async with EnvClient(*POOL) as client:
            snapshot = await client.environment(LIBRARY)
            assert snapshot == await client.environment(LIBRARY)  # built once
            start = start_files(WITH_LIBRARY)
            async with await client.create(start, LIMITS, snapshot=snapshot) as sandbox:
                listed = await sandbox.call({"tool": "run", "command": "ls lib"})
                await sandbox.call({"tool": "write", "path": "quad.py", "content": fixed})
                files = await archive(sandbox)
        return Outcome(answer=None, files=files, transcript=""), listed

    outcome, listed = run(session())
    assert "mathlib.py" in listed["output"]
    # The archive holds the agent's work, not the environment it forked.
    assert set(outcome.files) == {"quad.py"}
    assert graded(WITH_LIBRARY, outcome, tests_alone=True).value == 1.0
    unfixed = Outcome(None, {"quad.py": WITH_LIBRARY.files["quad.py"].encode()}, "")
    failed = graded(WITH_LIBRARY, unfixed, tests_alone=True)
    assert failed.value == 0.0 and "hidden tests failed" in failed.reason
