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
# With `tools`, the system turn lists them and the model calls one as Qwen's models do
# (Hermes: `<tool_call>` around a JSON object of `name` and `arguments`), so vLLM's
# `hermes` tool-call parser reads the tiny models' calls as it reads Qwen's; a tool's
# result comes back as a user turn in `<tool_response>`.
_TOOLS_SYSTEM = (
    "{%- if tools %}{{ '<|im_start|>system\n' }}"
    "{%- if messages and messages[0]['role'] == 'system' %}"
    "{{ messages[0]['content'] + '\n\n' }}{% endif %}"
    "{{ 'Tools:\n<tools>' }}{% for tool in tools %}"
    "{{ '\n' + ((tool['function'] if 'function' in tool else tool) | tojson) }}{% endfor %}"
    '{{ \'\n</tools>\nCall one as <tool_call>\n{"name": NAME, "arguments": {...}}'
    "\n</tool_call><|im_end|>\n' }}{% endif %}"
)
_TOOL_CALLS = (
    "{{ '<|im_start|>assistant\n' + (message['content'] or '') }}"
    "{%- for call in message['tool_calls'] %}{% set f = call['function'] %}"
    "{{ '<tool_call>\n{\"name\": ' + (f['name'] | tojson) + ', \"arguments\": ' }}"
    "{{ f['arguments'] if f['arguments'] is string else (f['arguments'] | tojson) }}"
    "{{ '}\n</tool_call>' }}{% endfor %}{{ '<|im_end|>\n' }}"
)
CHAT_TEMPLATE = (
    _TOOLS_SYSTEM + "{% for message in messages %}"
    "{%- if tools and loop.first and message['role'] == 'system' %}"
    "{%- elif message['role'] == 'tool' %}"
    "{{ '<|im_start|>user\n<tool_response>\n' + message['content']"
    " + '\n</tool_response><|im_end|>\n' }}"
    "{%- elif message['role'] == 'assistant' and message['tool_calls'] %}" + _TOOL_CALLS + ""
    "{%- else %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{%- endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def chat_text(turns: Iterable[tuple[str, str]]) -> str:
    """The (role, content) turns, each closed, then the assistant's turn opened: what
    `CHAT_TEMPLATE` renders with `add_generation_prompt`."""
    closed = "".join(f"{START_TURN}{role}\n{content}{END_TURN}\n" for role, content in turns)
    return f"{closed}{START_TURN}assistant\n"
