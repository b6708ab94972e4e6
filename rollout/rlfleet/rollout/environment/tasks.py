"""Tasks as data: what the model is asked, what it starts from, and how it is graded.

A suite is a JSON Lines file, one `Task` per line, so suites are reviewed and versioned
like code and loaded without running any. Shipped suites live in `suites/`:

- `toy.jsonl`: short arithmetic and string questions with exact answers, small enough for
  a tiny byte-level model to learn. Regenerate it with
  `python -c "from pathlib import Path; from rlfleet.rollout.environment import tasks;
  tasks.write_suite(tasks.toy_suite(200, 0), tasks.SUITES / 'toy.jsonl')"`.
- `rules.jsonl`: bare questions (no tool protocol) answered by a rule read off the prompt:
  first or last letter, repeat a word, the larger of two digits. A rule learned on some
  tasks carries over to the rest, so RL on a tiny model improves in minutes (`rlfleet run`'s
  default). Regenerate it with `tasks.rules_suite(400, 0)` in the same way.
- `coding.jsonl`: small Python repositories with failing unit tests, graded by hidden
  tests that only the grading sandbox sees.
"""

from __future__ import annotations

import random
from pathlib import Path

import msgspec

from rlfleet.api.wire import Task, decode_strict

SUITES = Path(__file__).parent / "suites"


def suite_path(suite: str) -> Path:
    """A shipped suite by name (`toy`), or any suite by path."""
    shipped = SUITES / f"{suite}.jsonl"
    return shipped if shipped.exists() else Path(suite)


def load_suite(path: Path) -> list[Task]:
    """Every task in a JSON Lines suite; a bad line is reported with its number."""
    tasks: list[Task] = []
    seen: set[str] = set()
    # Split on newlines only: JSON strings may hold other line separators (U+2028).
    for number, line in enumerate(path.read_text(encoding="utf-8").split("\n"), start=1):
        if not line.strip():
            continue
        try:
            task = decode_strict(line, Task)  # people write suites: no unknown field
        except (msgspec.ValidationError, msgspec.DecodeError) as error:
            raise ValueError(f"{path}:{number}: {error}") from error
        if task.id in seen:
            raise ValueError(f"{path}:{number}: duplicate task id {task.id!r}")
        seen.add(task.id)
        tasks.append(task)
    return tasks


def write_suite(tasks: list[Task], path: Path) -> None:
    path.write_bytes(b"".join(msgspec.json.encode(task) + b"\n" for task in tasks))


def start_files(task: Task) -> dict[str, bytes]:
    """The agent's starting tree: the task's files, and never its hidden tests."""
    return {relative: content.encode() for relative, content in task.files.items()}


_LETTERS = "abcdefghijklmnopqrstuvwxyz"


def _toy_question(rng: random.Random) -> tuple[str, str]:
    kind = rng.randrange(5)
    a, b = rng.randrange(10), rng.randrange(10)
    if kind == 0:
        return f"What is {a}+{b}? Answer with the number.", str(a + b)
    if kind == 1:
        a, b = max(a, b), min(a, b)
        return f"What is {a}-{b}? Answer with the number.", str(a - b)
    if kind == 2:
        return f"What is {a}*{b}? Answer with the number.", str(a * b)
    word = "".join(rng.choice(_LETTERS) for _ in range(rng.randint(2, 4)))
    if kind == 3:
        return f"Reverse the word {word}.", word[::-1]
    return f"What is the first letter of {word}?", word[0]


def _word(rng: random.Random) -> str:
    return "".join(rng.choice(_LETTERS) for _ in range(rng.randint(3, 5)))


def _rule_question(rng: random.Random) -> tuple[str, str]:
    kind = rng.randrange(4)
    if kind == 3:
        a, b = rng.sample(range(10), 2)
        return f"Which is larger, {a} or {b}?", str(max(a, b))
    word = _word(rng)
    if kind == 0:
        return f"What is the first letter of {word}?", word[0]
    if kind == 1:
        return f"What is the last letter of {word}?", word[-1]
    return f"Repeat the word {word}.", word


def rules_suite(count: int, seed: int) -> list[Task]:
    """A deterministic suite of bare questions answered by one of four rules."""
    rng = random.Random(seed)
    return [
        Task(id=f"rules-{i:04d}", suite="rules", prompt=prompt, answer=answer, tools=False)
        for i, (prompt, answer) in enumerate(_rule_question(rng) for _ in range(count))
    ]


def toy_suite(count: int, seed: int) -> list[Task]:
    """A deterministic suite of one-line questions whose answers are 1 to 4 characters."""
    rng = random.Random(seed)
    tasks = []
    for index in range(count):
        prompt, answer = _toy_question(rng)
        tasks.append(Task(id=f"toy-{index:04d}", suite="toy", prompt=prompt, answer=answer))
    return tasks
