"""The chat format: ChatML, which Qwen and the tiny models speak. The tiny tokenizers carry
it as a Jinja template (`CHAT_TEMPLATE`); sessions write prompts with `chat_text`, as
token-exact text, so the two are one format, defined here."""

from __future__ import annotations

from collections.abc import Iterable

START_TURN = "<|im_start|>"
END_TURN = "<|im_end|>"
END_TEXT = "<|endoftext|>"
SPECIAL_TOKENS = (END_TEXT, START_TURN, END_TURN)

# What `chat_text` writes, for tokenizers' `apply_chat_template` (tests hold the two equal).
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def chat_text(turns: Iterable[tuple[str, str]]) -> str:
    """The (role, content) turns, each closed, then the assistant's turn opened: what
    `CHAT_TEMPLATE` renders with `add_generation_prompt`."""
    closed = "".join(f"{START_TURN}{role}\n{content}{END_TURN}\n" for role, content in turns)
    return f"{closed}{START_TURN}assistant\n"
