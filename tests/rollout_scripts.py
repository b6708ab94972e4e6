"""Scripted agents for the rollout worker's tests: a tiny model taught fixed sessions.

A random tiny model never writes a tool call, so the tests teach it three sessions by
supervised fine-tuning (`fine_tune`) and decode greedily: each task's prompt selects its
script. The observations it is trained on come from a real sandbox running the same
commands, and the texts around them from the harness's own formatting.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from pathlib import Path

from rlfleet.api.wire import Task
from rlfleet.models.tiny import Example, fine_tune
from rlfleet.rollout.environment import tools
from rlfleet.rollout.environment.envclient import local_pool
from rlfleet.rollout.environment.sandbox import Limits
from rlfleet.rollout.environment.session import (
    END_TURN,
    SUMMARY_REQUEST,
    SessionConfig,
    user_turn_text,
    window_text,
)

# A call gets 10 s: vLLM's CPU engine spins on both cores, and starting a Python in a
# sandbox beside it took up to 3 s in CI; the fork bomb and the sleep still hit the limit.
LIMITS = Limits(
    call_seconds=10, wall_seconds=180, processes=32, disk_bytes=8 << 20, file_bytes=4 << 20
)
SUMMARY = "I wrote f1.txt and f2.txt; f3.txt is left."


def call(name: str, **arguments: str) -> str:
    return f"{tools.OPEN}{json.dumps({'name': name, 'arguments': arguments})}{tools.CLOSE}"


def run(command: str) -> str:
    return call("run", command=command)


HAPPY = Task(
    id="happy",
    suite="scripted",
    prompt="Task H: put hello in a.txt, show it, then submit.",
    answer="hello",
    test_command="grep -qx hello a.txt",
)
ABUSE = Task(
    id="abuse",
    suite="scripted",
    prompt="Task A: try to break out of the sandbox.",
    answer="done",
)
SUMMARY_TASK = Task(
    id="summary",
    suite="scripted",
    prompt="Task S: write three long files.",
    answer="3",
    test_command="test -s f1.txt && test -s f2.txt && test -s f3.txt",
)


def _long(letter: str) -> str:
    # Numbered, not repeated: a 2-layer model cannot count 250 equal letters.
    return " ".join(f"{letter}{i:02d}" for i in range(56))


# task id -> the model's turns; the summary task summarises after SUMMARY_AFTER of them.
SCRIPTS: dict[str, list[str]] = {
    HAPPY.id: [
        '<tool>{"name": "write", "arguments": {"path": "a.txt"}}</tool>',  # malformed
        call("write", path="a.txt", content="hello\n"),
        run("cat a.txt"),
        call("submit", answer="hello"),
    ],
    ABUSE.id: [
        run(
            "python3 -c \"import socket; socket.create_connection(('10.1.2.3', 80), 2)\" "
            "2>&1 | tail -n 1"
        ),
        # The sleep starts first and `wait` is a builtin: the shell needs no fork once the
        # bomb has the process limit, so the call always runs to its deadline.
        run("sleep 600 & bomb() { bomb | bomb & }; bomb 2>/dev/null; wait"),  # fork bomb
        run("head -c 50000000 /dev/zero > big; echo $?"),  # fill the disk
        run("sleep 1000"),  # run forever
        call("submit", answer="done"),
    ],
    SUMMARY_TASK.id: [
        call("write", path="f1.txt", content=_long("a")),
        call("write", path="f2.txt", content=_long("b")),
        call("write", path="f3.txt", content=_long("c")),
        call("submit", answer="3"),
    ],
}
SUMMARY_AFTER = 2  # turns of the summary script before its context is full
TURN_TOKENS = 320
SUMMARY_TOKENS = 64


@dataclass
class Scripted:
    examples: list[Example]
    session: SessionConfig


async def _observations(turns: list[str], config: SessionConfig) -> list[str]:
    """What the harness shows after each turn but the last, from a real sandbox."""
    shown = []
    async with local_pool(LIMITS, max_sessions=1) as pool, await pool.create(None) as sandbox:
        for turn in turns[:-1]:
            parsed = tools.parse(turn)
            if isinstance(parsed, tools.ToolError):
                shown.append(f"error: {parsed.message}")
            else:
                reply = await sandbox.call(tools.request(parsed))
                shown.append(tools.observation(reply, config.observation_chars))
    return shown


def _window(prompt: str, turns: list[str], shown: list[str], **opening) -> Example:
    pieces: Example = [(window_text(prompt, **opening), False)]
    for index, turn in enumerate(turns):
        pieces.append((turn, True))
        if index < len(shown):
            pieces.append((END_TURN + "\n" + user_turn_text(shown[index]), False))
    return pieces


def _tokens(tokenizer, pieces: Example) -> int:
    return sum(len(tokenizer.encode(text, add_special_tokens=False)) for text, _ in pieces)


def build(tokenizer) -> Scripted:
    """The fine-tuning examples and a context budget only the summary script overflows."""
    probe = SessionConfig(turn_tokens=TURN_TOKENS, summary_tokens=SUMMARY_TOKENS)
    tasks = {task.id: task for task in (HAPPY, ABUSE, SUMMARY_TASK)}
    shown = {key: asyncio.run(_observations(turns, probe)) for key, turns in SCRIPTS.items()}
    reserve = (
        _tokens(tokenizer, [(END_TURN + "\n" + user_turn_text(SUMMARY_REQUEST), False)])
        + SUMMARY_TOKENS
    )

    def needs(key: str, turns: list[str], observations: list[str], **opening) -> list[int]:
        # What the harness checks after each turn but the last: window, reply, next turn.
        return [
            _tokens(
                tokenizer,
                _window(tasks[key].prompt, turns[: k + 1], observations[: k + 1], **opening),
            )
            + TURN_TOKENS
            + reserve
            for k in range(len(turns) - 1)
        ]

    examples, budget = [], 0
    for key in (HAPPY.id, ABUSE.id):
        examples.append(_window(tasks[key].prompt, SCRIPTS[key], shown[key]))
        budget = max(budget, *needs(key, SCRIPTS[key], shown[key]))
    turns, observations = SCRIPTS[SUMMARY_TASK.id], shown[SUMMARY_TASK.id]
    before, after = turns[:SUMMARY_AFTER], turns[SUMMARY_AFTER:]
    first = _window(SUMMARY_TASK.prompt, before, observations[: SUMMARY_AFTER - 1])
    first += [
        (END_TURN + "\n" + user_turn_text(SUMMARY_REQUEST), False),
        (SUMMARY + END_TURN, True),
    ]
    opening = {"summary": SUMMARY, "observation": observations[SUMMARY_AFTER - 1]}
    second = _window(SUMMARY_TASK.prompt, after, observations[SUMMARY_AFTER:], **opening)
    examples += [first, second]
    budget = max(
        budget,
        *needs(SUMMARY_TASK.id, before, observations)[: SUMMARY_AFTER - 1],
        *needs(SUMMARY_TASK.id, after, observations[SUMMARY_AFTER:], **opening),
    )
    overflow = needs(SUMMARY_TASK.id, turns, observations)[SUMMARY_AFTER - 1]
    assert overflow > budget, (overflow, budget)
    session = SessionConfig(
        max_turns=8,
        turn_tokens=TURN_TOKENS,
        context_tokens=budget,
        summary_tokens=SUMMARY_TOKENS,
        temperature=0.0,
    )
    return Scripted(examples, session)


# 200 steps left one machine's greedy decoding off the abuse script at "sleep 1000"
# (bf16 rounding differs between CPUs); 300 learn every script with margin to spare.
def teach(model_dir: Path, tokenizer, steps: int = 300) -> SessionConfig:
    scripted = build(tokenizer)
    fine_tune(model_dir, scripted.examples, steps=steps)
    return scripted.session
