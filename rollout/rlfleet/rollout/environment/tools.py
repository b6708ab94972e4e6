"""The harness's tool protocol: what the model may call, and strict parsing of its calls.

A turn ends with at most one call, written as a JSON object between tags:

    <tool>{"name": "write", "arguments": {"path": "a.py", "content": "print(1)"}}</tool>

Anything that does not parse to exactly one known call with exactly the right arguments
becomes a `ToolError`, which the harness shows the model as an observation; it never
raises into the worker.
"""

from __future__ import annotations

import re
from typing import Literal

import msgspec

OPEN, CLOSE = "<tool>", "</tool>"
_CALL = re.compile(re.escape(OPEN) + r"(.*?)" + re.escape(CLOSE), re.DOTALL)

PROTOCOL = (
    'Call one tool per turn as <tool>{"name": ..., "arguments": {...}}</tool>. Tools: '
    'run {"command": str}, read {"path": str}, write {"path": str, "content": str}, '
    'submit {"answer": str}.'
)


# Strict: a model's call, not another component's message; an unknown argument is a
# mistake the model is told about.
class _Args(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    pass


class Run(_Args, tag="run"):
    command: str


class Read(_Args, tag="read"):
    path: str


class Write(_Args, tag="write"):
    path: str
    content: str


class Submit(_Args, tag="submit"):
    answer: str = ""


ToolCall = Run | Read | Write | Submit


class _Envelope(msgspec.Struct, forbid_unknown_fields=True):
    name: Literal["run", "read", "write", "submit"]
    arguments: msgspec.Raw


class ToolError(msgspec.Struct, frozen=True):
    message: str


_BY_NAME: dict[str, type[_Args]] = {"run": Run, "read": Read, "write": Write, "submit": Submit}


def parse(text: str) -> ToolCall | ToolError | None:
    """The call at the end of a model turn; None if the turn makes no call at all."""
    calls = _CALL.findall(text)
    if not calls:
        if OPEN in text:
            return ToolError(f"a {OPEN} without its {CLOSE}. {PROTOCOL}")
        return None
    if len(calls) > 1:
        return ToolError(f"{len(calls)} tool calls in one turn; make one. {PROTOCOL}")
    try:
        envelope = msgspec.json.decode(calls[0].strip(), type=_Envelope)
        return msgspec.json.decode(envelope.arguments, type=_BY_NAME[envelope.name])
    except msgspec.ValidationError as error:
        return ToolError(f"invalid tool call: {error}. {PROTOCOL}")
    except msgspec.DecodeError as error:
        return ToolError(f"tool call is not valid JSON: {error}. {PROTOCOL}")


def request(call: Run | Read | Write) -> dict:
    """The environment server's request for a call (submit is the harness's own)."""
    return {"tool": type(call).__struct_config__.tag} | msgspec.structs.asdict(call)


def observation(reply: dict, limit: int) -> str:
    """What the model is shown of the environment's reply, at most about `limit` characters."""
    if reply.get("ok"):
        text = str(reply.get("output", ""))
        if "exit_code" in reply:
            text = f"exit code {reply['exit_code']}\n{text}"
    else:
        text = f"error: {reply.get('error', 'unknown')}\n{reply.get('output', '')}".rstrip()
    if len(text) > limit:
        half = limit // 2
        text = f"{text[:half]}\n... [{len(text) - 2 * half} characters cut] ...\n{text[-half:]}"
    return text
