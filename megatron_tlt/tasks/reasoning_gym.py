"""reasoning-gym tasks: dataset creation, chat-templated prompts and scoring.

* ``make_dataset(task, size, seed, config)`` -- a reasoning-gym dataset, its
  failures (unknown task, parameters the task does not accept or rejects) turned
  into ``TaskError`` messages that say what is valid.
* ``reasoning_gym_prompts(tokenizer, task, n, seed)`` -- ``n`` chat-templated
  ``Prompt``s of a task, each keeping its dataset's verifier.
* ``score(prompt, response_text)`` -- reward in [0, 1] by the task's own verifier
  on the answer ``extract`` finds (``auto`` mode).

Default task (``DEFAULT_TASK`` with ``TASK_PRESETS[DEFAULT_TASK]`` and
``DEFAULT_INSTRUCTION``): ``basic_arithmetic`` with 2-4 terms of 1-2 digits and the
suffix "Explain your steps, then state the final answer.": on SmolLM2-135M-Instruct
it gives a long tail of response lengths (docs/benchmarks.md, "The long-tail
workload", has the measurements and why these settings).

Seeds: reasoning-gym builds entry i from ``Random(seed + i)``, so its seeds 0 and 1
share all entries but one. A workload seed ``s`` is passed on as
``s * SEED_STRIDE``: seed 0 is reasoning-gym's seed 0, and different seeds draw
disjoint entry streams; ``offset`` shifts inside a seed's stream (the RL eval set).

``allow_parentheses=False`` must not be used with reasoning-gym 0.1.19's
``basic_arithmetic``: without parentheses it evaluates left to right ignoring
precedence, and its divisions can disagree with the printed expression.
"""

from __future__ import annotations

import dataclasses
import difflib
import numbers
from typing import Any

from .answers import extract
from .chat import Prompt, ScoreFn, build_messages, chat_token_ids

__all__ = ["TaskError", "DEFAULT_TASK", "DEFAULT_INSTRUCTION", "TASK_PRESETS", "SEED_STRIDE",
           "available_tasks", "task_config", "make_dataset", "task_scorer",
           "reasoning_gym_prompts", "score"]


class TaskError(ValueError):
    """Bad task arguments (unknown task, bad size or seed, bad parameters); says what is valid."""


DEFAULT_TASK = "basic_arithmetic"
DEFAULT_INSTRUCTION = "Explain your steps, then state the final answer."

# Task parameters used unless overridden (docs/benchmarks.md says why and what they
# give). Tasks without an entry use reasoning-gym's own defaults. Negation and
# parentheses stay at reasoning-gym's defaults (allowed).
TASK_PRESETS: dict[str, dict[str, Any]] = {
    "basic_arithmetic": {"min_terms": 2, "max_terms": 4, "min_digits": 1, "max_digits": 2},
}

SEED_STRIDE = 2**32

# Arguments of reasoning_gym.create_dataset that this module sets itself.
_RESERVED_TASK_ARGS = ("size", "seed")


def available_tasks() -> list[str]:
    """Names of all registered reasoning-gym datasets, sorted."""
    from reasoning_gym.factory import DATASETS

    return sorted(DATASETS)


def task_config(task: str, params: dict[str, Any] | None = None,
                use_preset: bool = True) -> dict[str, Any]:
    """``TASK_PRESETS[task]`` (when ``use_preset``) with ``params`` merged over it key by key.

    Raises:
        TaskError: ``params`` holds ``size`` or ``seed`` (set through ``make_dataset``).
    """
    params = dict(params or {})
    reserved = [k for k in _RESERVED_TASK_ARGS if k in params]
    if reserved:
        raise TaskError(
            f"{', '.join(reserved)} cannot be passed as task parameters; use n= and seed="
        )
    preset = TASK_PRESETS.get(task, {}) if use_preset else {}
    return {**preset, **params}


def make_dataset(task: str, size: int, seed: int, config: dict[str, Any], *, offset: int = 0):
    """``reasoning_gym.create_dataset(task, size, seed * SEED_STRIDE + offset, **config)``.

    Raises:
        TaskError: an unknown task (with close names), parameters the task does not
            accept (listing the accepted ones) or rejects.
    """
    import reasoning_gym
    from reasoning_gym.factory import DATASETS

    if task not in DATASETS:
        close = difflib.get_close_matches(task, DATASETS, n=3)
        hint = f"; did you mean {', '.join(close)}?" if close else ""
        raise TaskError(
            f"unknown reasoning-gym task {task!r}{hint} "
            f"(available_tasks() lists all {len(DATASETS)})"
        )
    config_cls = DATASETS[task][1]
    accepted = {f.name for f in dataclasses.fields(config_cls)} - set(_RESERVED_TASK_ARGS)
    unknown = sorted(set(config) - accepted)
    if unknown:
        raise TaskError(
            f"task {task!r} does not accept parameter(s) {unknown}; "
            f"accepted: {sorted(accepted)}"
        )
    try:
        return reasoning_gym.create_dataset(task, size=size, seed=seed * SEED_STRIDE + offset,
                                            **config)
    except (AssertionError, TypeError, ValueError) as e:  # the configs validate with assert
        raise TaskError(f"task {task!r} rejected parameters {config}: {e}") from e


def task_scorer(task: str, config: dict[str, Any] | None = None) -> ScoreFn:
    """The verifier of ``task``: that of a dataset built with ``config`` (some tasks'
    verifiers read their configuration), or reasoning-gym's default one when None.

    Raises:
        TaskError: as ``make_dataset``.
    """
    if config is None:
        from reasoning_gym import get_score_answer_fn

        return get_score_answer_fn(task)
    return make_dataset(task, 1, 0, config).score_answer


def reasoning_gym_prompts(
    tokenizer: Any,
    task: str = DEFAULT_TASK,
    n: int = 32,
    seed: int = 0,
    *,
    instruction: str | None = DEFAULT_INSTRUCTION,
    system_prompt: str | None = None,
    use_preset: bool = True,
    **task_kwargs: Any,
) -> list[Prompt]:
    """``n`` chat-templated prompts of a reasoning-gym task, deterministic per ``seed``.

    Args:
        tokenizer: a Hugging Face tokenizer with a chat template.
        task: reasoning-gym dataset name (see ``available_tasks``).
        n: number of prompts (> 0).
        seed: non-negative workload seed; the same seed gives the same prompts,
            different seeds give unrelated ones (reasoning-gym seed ``seed * 2**32``).
        instruction: appended to the question on a new line; None or "" for none.
        system_prompt: a system message; None keeps the chat template's default.
        use_preset: start from ``TASK_PRESETS[task]`` (if any) before applying
            ``task_kwargs``; False uses reasoning-gym's defaults.
        **task_kwargs: dataset configuration (e.g. ``min_terms=2``); they
            override the preset key by key.

    Raises:
        TaskError (a ValueError): unknown task, ``n <= 0``, a negative seed, or
        parameters the task does not accept or rejects.
    """
    if isinstance(n, bool) or not isinstance(n, int) or n <= 0:
        raise TaskError(f"n must be a positive integer, got {n!r}")
    if isinstance(seed, bool) or not isinstance(seed, numbers.Integral) or seed < 0:
        raise TaskError(f"seed must be an integer >= 0, got {seed!r}")
    seed = int(seed)
    dataset = make_dataset(task, n, seed, task_config(task, task_kwargs, use_preset))
    prompts = []
    for i, entry in enumerate(dataset):
        messages = build_messages(entry["question"], instruction, system_prompt)
        prompts.append(Prompt(uid=f"{task}:seed{seed}:{i}", messages=messages,
                              token_ids=chat_token_ids(tokenizer, messages),
                              answer=str(entry["answer"]), entry=entry, task=task,
                              score_fn=dataset.score_answer))
    return prompts


def score(prompt: Prompt, response_text: str) -> float:
    """Reward in [0, 1] of ``response_text`` by the task's verifier.

    The answer is taken with ``extract`` (``auto``: answer tag, boxed, last number);
    a response without one scores 0. The verifier is the prompt's ``score_fn``, else
    the task's with reasoning-gym's default configuration: that one gives 1.0 for an
    exact string match and partial credit ``len(reference) / len(answer)`` when the
    reference is a substring of the answer (reference "5", answer "2.25" -> 0.25).
    """
    score_fn = prompt.score_fn if prompt.score_fn is not None else task_scorer(prompt.task)
    return float(score_fn(extract(response_text), prompt.entry))
