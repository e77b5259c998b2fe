"""The prompt type and chat-template prompt building.

``Prompt`` is the one prompt type of the project: the RL data pipeline
(``rl.data``), the verifiers (``rl.rewards``), the reasoning-gym prompt builder
(``tasks.reasoning_gym``) and the benchmarks all pass it around.

``build_messages`` makes the chat messages (instruction suffix, optional system
message) and ``chat_token_ids`` renders them with the tokenizer's chat template.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Optional

__all__ = ["Prompt", "ScoreFn", "build_messages", "chat_token_ids"]

# a reasoning-gym verifier: (extracted answer or None, entry) -> score in [0, 1]
ScoreFn = Callable[[Optional[str], dict], float]


@dataclass(frozen=True)
class Prompt:
    """One chat-templated prompt.

    uid: stable id, ``"<task>:train:17"`` (RL reasoning-gym sets: split and index),
        ``"<task>:seed3:5"`` (``reasoning_gym_prompts``: workload seed and index) or
        ``"<file name>:42"`` (file prompts: the 1-based line).
    messages: the chat messages given to the chat template.
    token_ids: the chat template applied with the assistant generation prompt, no
        BOS added twice.
    answer: the reference answer, a string.
    entry: the reasoning-gym entry (``question``, ``answer``, ``metadata``) for its
        verifier, or the raw file row.
    task: the reasoning-gym task name, None for file prompts.
    score_fn: the verifier of the dataset the entry came from (its
        ``score_answer``), when the builder kept it; ``tasks.score`` otherwise uses
        the task's verifier with reasoning-gym's default configuration.
    """

    uid: str
    messages: list
    token_ids: list
    answer: str
    entry: Optional[dict]
    task: Optional[str]
    score_fn: Optional[ScoreFn] = field(default=None, repr=False, compare=False)

    @property
    def text(self) -> str:
        """The last user message (the question plus the instruction suffix)."""
        return next(m["content"] for m in reversed(self.messages) if m["role"] == "user")

    @property
    def question(self) -> str:
        """The reasoning-gym question, without the instruction suffix."""
        if self.entry is None or "question" not in self.entry:
            raise AttributeError(f"prompt {self.uid} is not a reasoning-gym prompt; "
                                 f"it has no question (use .text)")
        return self.entry["question"]


def build_messages(user_or_messages: str | list[dict], instruction: str | None = None,
                   system_prompt: str | None = None) -> list[dict]:
    """Chat messages for a user message (a string) or a list of ``{role, content}``.

    ``instruction`` (None or "" for none) is appended on a new line to the last user
    message; ``system_prompt`` (None for none) is put first unless the messages
    already have a system message. The input is not modified.
    """
    if isinstance(user_or_messages, str):
        messages = [{"role": "user", "content": user_or_messages}]
    else:
        messages = [{"role": m["role"], "content": m["content"]} for m in user_or_messages]
    if instruction:
        for m in reversed(messages):
            if m["role"] == "user":
                m["content"] = f"{m['content']}\n{instruction}"
                break
    if system_prompt is not None and not any(m["role"] == "system" for m in messages):
        messages.insert(0, {"role": "system", "content": system_prompt})
    return messages


def chat_token_ids(tokenizer: Any, messages: list[dict]) -> list[int]:
    """Token ids of the rendered chat with the assistant generation prompt.

    Rendered to text first and then encoded without special tokens, so that the
    result is a plain list on every transformers version (5.x returns a
    BatchEncoding from ``tokenize=True``) and no BOS is added twice.
    """
    rendered = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return list(tokenizer(rendered, add_special_tokens=False)["input_ids"])
