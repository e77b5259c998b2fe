"""Long-tailed rollout workloads: real reasoning-gym prompts and a synthetic stand-in.

RL rollouts for reasoning models are slow because of their length distribution:
most responses stop early, a few run to the token cap, and a synchronous batch
waits for the slowest one. The benchmarks of this project (rollout engine,
speculative decoding, RL step) need that shape reproducibly, in two forms:

* ``reasoning_gym_prompts`` -- real, chat-templated prompts from a reasoning-gym
  task, with ``score`` to grade a response against the task's own verifier.
  Driving SmolLM2-135M-Instruct with them gives a real long tail.
* ``synthetic_workload`` -- random prompt ids plus a target response length drawn
  from a log-normal distribution. Generating exactly ``target_len`` tokens per
  request (EOS ignored) reproduces a long tail with any model, even a random one,
  which is what unit tests and model-free benchmarks want.

``length_stats`` summarises a list of response lengths the same way for both.

Default task (``DEFAULT_TASK`` with ``TASK_PRESETS[DEFAULT_TASK]`` and
``DEFAULT_INSTRUCTION``): reasoning-gym ``basic_arithmetic`` with 2-4 terms of
1-2 digits and the suffix "Explain your steps, then state the final answer.".
Measured with SmolLM2-135M-Instruct (the Q4_1-derived float32 checkpoint of
``megatron_tlt.assets``), transformers greedy decoding, fp32, CPU, one left-padded
batch; response length = generated tokens before ``<|im_end|>``::

    python tools/workload_lengths.py --n 16 --max-new-tokens 256
    lengths 44 51 69 79 81 87 93 95 102 119 131 155 210 256 256 256
    -> median 98.5  p90 256  max 256  mean 130.2  max/median 2.60
       at cap: 3/16 (19 %)  accuracy 1/16
    --n 64:           median 105    p90 202.8  max 256  mean 120.5
                      at cap 4/64 (6 %)  accuracy 2/64
    --n 32 --seed 1:  median 109.5  p90 161.8  max 256  mean 114.3
                      at cap 2/32 (6 %)  accuracy 3/32

The capped responses are mostly repetition loops (with no suffix and a 512 cap,
of the two responses of 32 capped at 256 one stopped at 266, the other ran to
512). Why these defaults (each tried with n=16..32, cap 256, same model):
  * reasoning-gym's default difficulty (2-6 terms, 1-4 digits), no suffix:
    median 121, 5/32 at cap -- a similar tail; the preset's smaller numbers only
    make answers checkable by hand.
  * The suffix "Give the final answer as a number on the last line." makes the
    model answer in ~7 tokens on easy questions: no tail at all. "Think step by
    step, then give ..." gives median ~80-110 but rarely reaches the cap (0-1/16).
  * Accuracy stays low (3-9 %) in every long-tailed setting tried; this 135M
    model mostly fails arithmetic with more than one operation. RL on it needs
    sampling with temperature to get reward variance within a group.
  * ``allow_parentheses=False`` must not be used with reasoning-gym 0.1.19's
    ``basic_arithmetic``: without parentheses it evaluates left to right
    ignoring precedence and its divisions can disagree with the printed
    expression (e.g. "Calculate 4 / 1." with answer 2).

Answer extraction for ``score`` (``extract_answer``): the content of the last
``<answer>...</answer>`` tag if the response has one (reasoning-gym's own
convention), otherwise the last number in the response -- which is the last
number on the last line that contains a number. Thousands separators are dropped
and integral decimals are shortened ("1,200.00" -> "1200"), since the verifiers
compare strings. A minus sign counts only when it is not a binary minus
("7-3" gives "3", "is -4" gives "-4").
"""

from __future__ import annotations

import dataclasses
import difflib
import re
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Sequence

import numpy as np

ScoreFn = Callable[[str | None, dict[str, Any]], float]


class WorkloadError(ValueError):
    """Bad workload arguments (unknown task, bad size, bad parameters); says what is valid."""


DEFAULT_TASK = "basic_arithmetic"
DEFAULT_INSTRUCTION = "Explain your steps, then state the final answer."

# Task parameters used unless overridden (see the module docstring for why and
# what they give). Tasks without an entry use reasoning-gym's own defaults.
# Negation and parentheses stay at reasoning-gym's defaults (allowed).
TASK_PRESETS: dict[str, dict[str, Any]] = {
    "basic_arithmetic": {"min_terms": 2, "max_terms": 4, "min_digits": 1, "max_digits": 2},
}

# Arguments of create_dataset that this module sets itself.
_RESERVED_TASK_ARGS = ("size", "seed")

# reasoning-gym builds entry i from ``Random(seed + i)``, so its seeds 0 and 1 share
# all entries but one. Workload seed s is passed on as ``s * _SEED_STRIDE``: seed 0
# is reasoning-gym's seed 0, and different seeds draw disjoint entry streams.
_SEED_STRIDE = 2**32


# ----------------------------------------------------------------------------- real prompts


@dataclass(frozen=True)
class WorkloadPrompt:
    """One chat-templated reasoning-gym prompt.

    Attributes:
        token_ids: the full prompt as the policy sees it (chat template applied,
            ending with the assistant generation prompt), no BOS added.
        text: the user message (question plus instruction suffix).
        entry: the reasoning-gym entry (``question``, ``answer``, ``metadata``),
            needed by the verifier.
        task: the reasoning-gym dataset name.
        score_fn: the dataset's ``score_answer``; when None, ``score`` looks up
            the verifier of ``task`` with reasoning-gym's default configuration.
    """

    token_ids: list[int]
    text: str
    entry: dict[str, Any]
    task: str
    score_fn: ScoreFn | None = field(default=None, repr=False, compare=False)

    @property
    def question(self) -> str:
        """The task question without the instruction suffix."""
        return self.entry["question"]

    @property
    def answer(self) -> str:
        """The reference answer of the entry."""
        return self.entry["answer"]


def available_tasks() -> list[str]:
    """Names of all registered reasoning-gym datasets, sorted."""
    from reasoning_gym.factory import DATASETS

    return sorted(DATASETS)


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
) -> list[WorkloadPrompt]:
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
        WorkloadError (a ValueError): unknown task, ``n <= 0``, or parameters the
        task does not accept or rejects.
    """
    if isinstance(n, bool) or not isinstance(n, int) or n <= 0:
        raise WorkloadError(f"n must be a positive integer, got {n!r}")
    _check_int("seed", seed, minimum=0)
    config = _task_config(task, use_preset, task_kwargs)
    dataset = _create_dataset(task, n, seed * _SEED_STRIDE, config)
    score_fn = dataset.score_answer
    prompts = []
    for entry in dataset:
        text = entry["question"] if not instruction else f"{entry['question']}\n{instruction}"
        messages = [{"role": "user", "content": text}]
        if system_prompt is not None:
            messages.insert(0, {"role": "system", "content": system_prompt})
        prompts.append(
            WorkloadPrompt(
                token_ids=_chat_token_ids(tokenizer, messages),
                text=text,
                entry=entry,
                task=task,
                score_fn=score_fn,
            )
        )
    return prompts


def _task_config(task: str, use_preset: bool, task_kwargs: dict[str, Any]) -> dict[str, Any]:
    """Preset merged with explicit overrides; the arguments this module owns are refused."""
    reserved = [k for k in _RESERVED_TASK_ARGS if k in task_kwargs]
    if reserved:
        raise WorkloadError(
            f"{', '.join(reserved)} cannot be passed as task parameters; use n= and seed="
        )
    preset = TASK_PRESETS.get(task, {}) if use_preset else {}
    return {**preset, **task_kwargs}


def _create_dataset(task: str, n: int, seed: int, config: dict[str, Any]):
    """``reasoning_gym.create_dataset`` with its failures turned into WorkloadError."""
    import reasoning_gym
    from reasoning_gym.factory import DATASETS

    if task not in DATASETS:
        close = difflib.get_close_matches(task, DATASETS, n=3)
        hint = f"; did you mean {', '.join(close)}?" if close else ""
        raise WorkloadError(
            f"unknown reasoning-gym task {task!r}{hint} "
            f"(available_tasks() lists all {len(DATASETS)})"
        )
    config_cls = DATASETS[task][1]
    accepted = {f.name for f in dataclasses.fields(config_cls)} - set(_RESERVED_TASK_ARGS)
    unknown = sorted(set(config) - accepted)
    if unknown:
        raise WorkloadError(
            f"task {task!r} does not accept parameter(s) {unknown}; "
            f"accepted: {sorted(accepted)}"
        )
    try:
        return reasoning_gym.create_dataset(task, size=n, seed=seed, **config)
    except (AssertionError, TypeError, ValueError) as e:  # the configs validate with assert
        raise WorkloadError(f"task {task!r} rejected parameters {config}: {e}") from e


def _chat_token_ids(tokenizer: Any, messages: list[dict[str, str]]) -> list[int]:
    """Token ids of the rendered chat with the assistant generation prompt.

    Rendered to text first and then encoded without special tokens, so that the
    result is a plain list on every transformers version (5.x returns a
    BatchEncoding from ``tokenize=True``) and no BOS is added twice.
    """
    rendered = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return list(tokenizer(rendered, add_special_tokens=False)["input_ids"])


# ----------------------------------------------------------------------------- scoring

_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
# A number, optionally signed; the sign must not follow a word character or ")"
# (then it is a binary minus). Thousands groups and a fraction part are allowed.
_NUMBER = re.compile(r"(?:(?<![\w)])[-\u2212])?\d+(?:,\d{3})*(?:\.\d+)?")


def extract_answer(response_text: str) -> str | None:
    """The answer a response gives (see the module docstring), or None if it gives none."""
    tags = _ANSWER_TAG.findall(response_text)
    if tags:
        return tags[-1].strip()
    numbers = _NUMBER.findall(response_text)
    if not numbers:
        return None
    return _normalize_number(numbers[-1])


def _normalize_number(raw: str) -> str:
    """ "−1,200.00" -> "-1200"; non-integral decimals keep their digits."""
    number = raw.replace("\u2212", "-").replace(",", "")
    if "." in number:
        whole, frac = number.split(".", 1)
        if frac.strip("0") == "":
            number = whole
    if number == "-0":
        number = "0"
    return number


def score(prompt: WorkloadPrompt, response_text: str) -> float:
    """Reward in [0, 1] of ``response_text`` by the task's verifier.

    The answer is taken with ``extract_answer``; a response without one scores 0.
    The verifier is the task's own: reasoning-gym's default one gives 1.0 for an
    exact string match and partial credit ``len(reference) / len(answer)`` when the
    reference is a substring of the answer (reference "5", answer "2.25" -> 0.25).
    """
    score_fn = prompt.score_fn
    if score_fn is None:
        from reasoning_gym import get_score_answer_fn

        score_fn = get_score_answer_fn(prompt.task)
    return float(score_fn(extract_answer(response_text), prompt.entry))


# ----------------------------------------------------------------------------- synthetic


@dataclass(frozen=True)
class SyntheticRequest:
    """A model-free request: random prompt ids and the response length to generate.

    Drive an engine with ``max_new_tokens=target_len`` and EOS ignored.
    """

    token_ids: list[int]
    target_len: int


def synthetic_workload(
    n: int,
    *,
    vocab_size: int,
    prompt_len: tuple[int, int] = (4, 16),
    median_len: float = 32,
    sigma: float = 1.0,
    max_len: int = 256,
    seed: int = 0,
    exclude_ids: Iterable[int] = (),
) -> list[SyntheticRequest]:
    """``n`` requests with log-normal target lengths, deterministic per ``seed``.

    Target lengths are ``round(median_len * exp(sigma * z))`` with standard normal
    ``z``, clipped to ``[1, max_len]``: the median is ``median_len`` and the tail
    grows with ``sigma`` (1.0 puts about 10 % of requests above 3.6x the median).
    Prompt lengths are uniform in ``prompt_len`` (inclusive); prompt ids are
    uniform over ``[1, vocab_size)`` minus ``exclude_ids`` (id 0 is never used:
    it is padding or a special token in most vocabularies; pass BOS/EOS/pad ids
    to ``exclude_ids``).

    Lengths and prompts come from separate random streams, so changing the
    prompt settings does not change the target lengths, and vice versa.

    Raises:
        WorkloadError (a ValueError) on out-of-range arguments.
    """
    _check_int("n", n, minimum=1)
    _check_int("vocab_size", vocab_size, minimum=2)
    _check_int("max_len", max_len, minimum=1)
    _check_int("seed", seed, minimum=0)
    if len(prompt_len) != 2:
        raise WorkloadError(f"prompt_len must be a (min, max) pair, got {prompt_len!r}")
    lo, hi = prompt_len
    _check_int("prompt_len[0]", lo, minimum=1)
    _check_int("prompt_len[1]", hi, minimum=lo)
    if not median_len > 0 or median_len > max_len:
        raise WorkloadError(f"median_len must be in (0, max_len={max_len}], got {median_len!r}")
    if not sigma >= 0:
        raise WorkloadError(f"sigma must be >= 0, got {sigma!r}")
    excluded = np.asarray(sorted(set(int(i) for i in exclude_ids)), dtype=np.int64)
    allowed = np.setdiff1d(np.arange(1, vocab_size, dtype=np.int64), excluded)
    if allowed.size == 0:
        raise WorkloadError(f"no token ids left in [1, {vocab_size}) after excluding {excluded.tolist()}")

    length_seq, prompt_seq = np.random.SeedSequence(seed).spawn(2)
    z = np.random.default_rng(length_seq).standard_normal(n)
    targets = np.clip(np.rint(median_len * np.exp(sigma * z)), 1, max_len).astype(np.int64)

    prompt_rng = np.random.default_rng(prompt_seq)
    prompt_lens = prompt_rng.integers(lo, hi + 1, size=n)
    return [
        SyntheticRequest(
            token_ids=allowed[prompt_rng.integers(0, allowed.size, size=int(length))].tolist(),
            target_len=int(target),
        )
        for length, target in zip(prompt_lens, targets)
    ]


def _check_int(name: str, value: Any, minimum: int) -> None:
    """Raise WorkloadError unless ``value`` is an int (not bool) >= ``minimum``."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < minimum:
        raise WorkloadError(f"{name} must be an integer >= {minimum}, got {value!r}")


# ----------------------------------------------------------------------------- statistics


def length_stats(lengths: Sequence[int], cap: int | None = None) -> dict[str, float | int | None]:
    """Summary of response lengths.

    Returns a dict with ``n``, ``min``, ``mean``, ``median``, ``p90`` (linear
    interpolation between order statistics, numpy's default), ``max``,
    ``max_over_median`` (the tail ratio: how much longer the slowest request of a
    synchronous batch is than the typical one) and ``frac_at_cap`` (share of
    lengths ``>= cap``, i.e. truncated; None when ``cap`` is None).

    Raises:
        WorkloadError (a ValueError): empty input, negative lengths, ``cap < 1``.
    """
    values = np.asarray(list(lengths), dtype=np.float64)
    if values.size == 0:
        raise WorkloadError("length_stats needs at least one length")
    if values.ndim != 1 or (values < 0).any():
        raise WorkloadError("lengths must be a flat sequence of non-negative numbers")
    if cap is not None and cap < 1:
        raise WorkloadError(f"cap must be >= 1 or None, got {cap!r}")
    median = float(np.median(values))
    maximum = float(values.max())
    return {
        "n": int(values.size),
        "min": float(values.min()),
        "mean": float(values.mean()),
        "median": median,
        "p90": float(np.percentile(values, 90)),
        "max": maximum,
        "max_over_median": maximum / median if median > 0 else float("inf"),
        "frac_at_cap": None if cap is None else float((values >= cap).mean()),
    }


def format_length_stats(stats: dict[str, float | int | None], cap: int | None = None) -> str:
    """One line for logs: ``n=16  min 35  median 94  p90 256  max 256 ...``."""
    line = (
        f"n={stats['n']}  min {stats['min']:g}  median {stats['median']:g}  "
        f"p90 {stats['p90']:g}  max {stats['max']:g}  mean {stats['mean']:.1f}  "
        f"max/median {stats['max_over_median']:.2f}"
    )
    if stats.get("frac_at_cap") is not None:
        at_cap = round(stats["frac_at_cap"] * stats["n"])
        line += f"  at cap{f' {cap}' if cap else ''}: {at_cap}/{stats['n']} ({stats['frac_at_cap']:.0%})"
    return line
