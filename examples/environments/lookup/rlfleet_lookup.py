"""A multi-turn, tool-using environment, written as any OpenAI-SDK agent is: the model is
asked for a word's secret number, may call the `lookup` tool, and is rewarded for the
right number and for having looked it up. Its tasks and reward are its own."""

import json
from collections.abc import Iterator, Mapping
from typing import Any

from rlfleet.api.wire import Task
from rlfleet.rollout.environment.harness import Harness, Model
from rlfleet.rollout.environment.plugins import SettingsError

LOOKUP = {
    "type": "function",
    "function": {
        "name": "lookup",
        "description": "The secret number of a word.",
        "parameters": {
            "type": "object",
            "properties": {"word": {"type": "string"}},
            "required": ["word"],
        },
    },
}
WORDS = {
    "apple": 7, "river": 3, "stone": 5, "cloud": 8, "tiger": 1, "maple": 9, "ocean": 4,
    "flint": 2, "grape": 6, "lemon": 0, "cedar": 3, "pearl": 8, "raven": 5, "sugar": 1,
    "tulip": 9, "wheat": 2,
}  # fmt: skip


class Lookup(Harness):
    def __init__(self, words: Mapping[str, int], max_calls: int) -> None:
        self.words, self.max_calls = dict(words), max_calls

    def tasks(self) -> Iterator[Task]:
        for word, number in sorted(self.words.items()):
            prompt = f"What is the secret number of {word}?"
            yield Task(id=f"lookup-{word}", suite="lookup", prompt=prompt, answer=str(number))

    def demonstrations(self) -> Iterator[tuple[list[dict], list[dict]]]:
        """Half the words looked up and answered: a tiny model's warm-up (`rlfleet run`)."""
        for word, number in sorted(self.words.items())[::2]:
            call = {"name": "lookup", "arguments": json.dumps({"word": word})}
            yield (
                [
                    {"role": "user", "content": f"What is the secret number of {word}?"},
                    {"role": "assistant", "tool_calls": [{"id": "c", "function": call}]},
                    {"role": "tool", "tool_call_id": "c", "content": str(number)},
                    {"role": "assistant", "content": str(number)},
                ],
                [LOOKUP],
            )

    async def rollout(self, task: Task, model: Model) -> list[dict]:
        messages: list[dict] = [{"role": "user", "content": task.prompt}]
        for _ in range(self.max_calls):
            reply = await model.client.chat.completions.create(
                model=model.name, messages=messages, tools=[LOOKUP]
            )
            message = reply.choices[0].message
            messages.append(message.model_dump(exclude_none=True))
            if not message.tool_calls:
                break
            for call in message.tool_calls:
                result = self.lookup(call.function.name, call.function.arguments)
                messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
        return messages

    def lookup(self, name: str, arguments: str) -> str:
        try:
            word = json.loads(arguments)["word"]
        except (ValueError, KeyError, TypeError):
            return 'error: lookup takes {"word": WORD}'
        if name != "lookup" or word not in self.words:
            return f"error: no such word {word!r}"
        return str(self.words[word])

    async def score(self, task: Task, messages: list[dict]) -> dict[str, float]:
        answer = (messages[-1].get("content") or "").strip()
        looked = any(message["role"] == "tool" for message in messages)
        return {"correct": float(answer == task.answer), "lookedUp": float(looked)}


def load_environment(settings: Mapping[str, Any]) -> Lookup:
    """The entry point: settings `words` (word to number) and `maxCalls` (model calls)."""
    words = settings.get("words", WORDS)
    if not isinstance(words, Mapping) or not words:
        raise SettingsError("words", "a mapping of words to their secret numbers")
    for word, number in words.items():
        if not isinstance(number, int):
            raise SettingsError(f"words.{word}", f"{number!r} is not a whole number")
    max_calls = settings.get("maxCalls", 3)
    if not isinstance(max_calls, int) or max_calls < 1:
        raise SettingsError("maxCalls", f"{max_calls!r}: at least 1 call")
    if unknown := sorted(set(settings) - {"words", "maxCalls"}):
        raise SettingsError(unknown[0], "not a setting of lookup (words, maxCalls)")
    return Lookup(words, max_calls)
