"""Verifiers: score a response against a prompt's reference answer.

``Verifier(cfg.reward, cfg.data).score(prompt, response_text)`` gives a
``RewardResult``: the verifier ``score`` in [0, 1], ``correct`` (score >=
``reward.correct_threshold``), ``format_ok`` (``reward.format_pattern`` found,
DOTALL), the extracted ``answer`` and ``reward`` = score + ``reward.format_reward``
when the format matches.

Answer extraction (``reward.answer_extraction``): ``tasks.extract`` with that mode
(answer_tag, boxed, last_number, last_line, or auto = answer_tag, else boxed, else
last_number; see ``megatron_tlt.tasks.answers``). No answer scores 0.

Verifiers (``reward.verifier``; auto = reasoning_gym for reasoning-gym prompts, math
otherwise):
  reasoning_gym  the task's own ``score_answer(answer, entry)`` (from a dataset built
                 with the run's task parameters); it may give partial credit.
  math           math-verify: reference and answer are parsed as ``\\boxed{...}``
                 (falling back to the bare text) and compared symbolically, so
                 "\\frac{1}{2}", "1/2" and "0.5" agree. math-verify's own timeouts use
                 SIGALRM, which only works in the main thread; they are disabled and
                 each parse+verify runs in a daemon worker thread instead, bounded by
                 ``reward.timeout_seconds`` of running time: a timeout scores 0 (counted
                 in ``Verifier.timeouts``). Python cannot kill a thread: a timed-out
                 call keeps running in the background until it returns; the pool is
                 replaced so later calls are not stuck behind it, and daemon threads do
                 not block interpreter exit. A reference math-verify cannot parse falls
                 back to exact matching.
  exact          normalised string match: stripped, lower-cased, whitespace collapsed,
                 numbers normalised ("1,200.0" == "1200").
"""

from __future__ import annotations

import functools
import logging
import queue
import re
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Callable, Optional

from ..config import ConfigError, DataConfig, RewardConfig
from ..tasks import (
    Prompt,
    TaskError,
    extract,
    normalize_exact,
    task_config,
    task_scorer,
)

__all__ = ["RewardResult", "Verifier"]

log = logging.getLogger(__name__)

@dataclass
class RewardResult:
    """Outcome of scoring one response."""

    reward: float            # score + format bonus: what GRPO's advantages use
    score: float             # verifier score in [0, 1]
    correct: bool            # score >= reward.correct_threshold
    format_ok: bool          # reward.format_pattern found in the response
    answer: Optional[str]    # extracted answer (None: the response gives none)
    timed_out: bool = False  # math-verify ran past reward.timeout_seconds (score 0)


# ----------------------------------------------------------------------------- math-verify


def _quiet_math_verify() -> None:
    """math-verify warns once when its timeouts are disabled; we bound time ourselves."""
    import math_verify.grader as grader
    import math_verify.parser as parser

    parser.TIMEOUT_WARNING_SHOWN = True
    grader.TIMEOUT_WARNING_SHOWN = True


def _math_parse(text: str) -> list:
    from math_verify import parse

    s = text.strip()
    while len(s) >= 2 and s[0] == "$" and s[-1] == "$":
        s = s[1:-1].strip()
    if not s:
        return []
    wrapped = s if "\\boxed" in s else f"\\boxed{{{s}}}"
    parsed = parse(wrapped, parsing_timeout=None)
    if not parsed and wrapped != s:
        parsed = parse(s, parsing_timeout=None)
    return parsed


@functools.lru_cache(maxsize=4096)
def _gold_parse(reference: str) -> tuple:
    """Parsed reference, cached: a GRPO group scores the same reference G times."""
    return tuple(_math_parse(reference))


def _math_equal(reference: str, answer: str) -> float:
    """1.0 when math-verify finds ``answer`` equivalent to ``reference``."""
    from math_verify import verify

    if normalize_exact(reference) == normalize_exact(answer):
        return 1.0  # identical after normalisation: no need to parse
    gold = list(_gold_parse(reference))
    if not gold:  # reference not parseable as math: compare as strings
        return float(normalize_exact(reference) == normalize_exact(answer))
    pred = _math_parse(answer)
    if not pred:
        return 0.0
    return float(verify(gold, pred, timeout_seconds=None))


class _DaemonPool:
    """Worker threads that never block interpreter exit; futures record their start time."""

    def __init__(self, workers: int):
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._threads = [threading.Thread(target=self._work, daemon=True,
                                          name=f"math-verify-{i}") for i in range(workers)]
        for t in self._threads:
            t.start()

    def _work(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            fut, fn, args = item
            if not fut.set_running_or_notify_cancel():
                continue
            fut.started_at = time.monotonic()
            try:
                fut.set_result(fn(*args))
            except BaseException as e:  # noqa: BLE001 - reported through the future
                fut.set_exception(e)

    def submit(self, fn: Callable, *args) -> Future:
        fut: Future = Future()
        fut.started_at = None
        self._queue.put((fut, fn, args))
        return fut

    def shutdown(self) -> None:
        """Ask idle workers to stop; a busy (stuck) one stops when its call returns."""
        for _ in self._threads:
            self._queue.put(None)


# ----------------------------------------------------------------------------- verifier


class Verifier:
    """Scores responses against prompts' references (see the module docstring)."""

    def __init__(self, reward_cfg: RewardConfig, data_cfg: DataConfig, workers: int = 1):
        self.cfg = reward_cfg
        self.data_cfg = data_cfg
        # its settings were checked by validation.validate (rule reward_settings)
        self._format = re.compile(reward_cfg.format_pattern, re.DOTALL)
        self._scorers: dict[str, Callable[[Optional[str], dict], float]] = {}
        self._workers = max(1, int(workers))
        self._pool: _DaemonPool | None = None
        self._lock = threading.Lock()
        self.timeouts = 0
        self.errors = 0
        if data_cfg.source == "reasoning_gym" and reward_cfg.verifier in ("auto",
                                                                          "reasoning_gym"):
            self._rg_scorer(data_cfg.task)  # a bad task fails now, not mid-run

    # --------------------------------------------------------------- public API

    def verifier_for(self, prompt: Prompt) -> str:
        """The verifier that scores ``prompt``: reasoning_gym, math or exact."""
        v = self.cfg.verifier
        if v == "auto":
            return "reasoning_gym" if prompt.task else "math"
        if v == "reasoning_gym" and not prompt.task:
            raise ValueError(f"prompt {prompt.uid} is not a reasoning-gym prompt; "
                             f"reward.verifier=reasoning_gym cannot score it")
        return v

    def score(self, prompt: Prompt, response_text: str) -> RewardResult:
        return self.score_many([prompt], [response_text])[0]

    def score_many(self, prompts: list[Prompt], responses: list[str]) -> list[RewardResult]:
        if len(prompts) != len(responses):
            raise ValueError(f"score_many got {len(prompts)} prompts and {len(responses)} "
                             f"responses")
        answers = [extract(r, self.cfg.answer_extraction) for r in responses]
        scores: list[float] = [0.0] * len(prompts)
        timed_out = [False] * len(prompts)
        math_jobs: list[int] = []
        for i, (p, a) in enumerate(zip(prompts, answers)):
            if a is None:
                continue
            kind = self.verifier_for(p)
            if kind == "math":
                math_jobs.append(i)
            elif kind == "exact":
                scores[i] = float(normalize_exact(a) == normalize_exact(p.answer))
            else:
                scores[i] = self._score_rg(p, a)
        if math_jobs:
            for i, (s, t) in zip(math_jobs, self._run_math(
                    [(prompts[i].answer, answers[i]) for i in math_jobs])):
                scores[i], timed_out[i] = s, t
        results = []
        bonus = self.cfg.format_reward
        for s, a, r, t in zip(scores, answers, responses, timed_out):
            fmt = bool(self._format.search(r))
            results.append(RewardResult(
                reward=s + (bonus if fmt else 0.0), score=s,
                correct=s >= self.cfg.correct_threshold, format_ok=fmt, answer=a,
                timed_out=t))
        return results

    def close(self) -> None:
        with self._lock:
            if self._pool is not None:
                self._pool.shutdown()
                self._pool = None

    # --------------------------------------------------------------- reasoning-gym

    def _rg_scorer(self, task: str) -> Callable[[Optional[str], dict], float]:
        fn = self._scorers.get(task)
        if fn is None:
            if task == self.data_cfg.task:
                # the scorer of a dataset with the run's parameters (some tasks' scorers
                # read their config)
                try:
                    fn = task_scorer(task, task_config(task, self.data_cfg.task_params))
                except TaskError as e:
                    raise ConfigError(f"data.task={task!r}: {e}") from None
            else:
                fn = task_scorer(task)
            self._scorers[task] = fn
        return fn

    def _score_rg(self, prompt: Prompt, answer: str) -> float:
        try:
            return float(self._rg_scorer(prompt.task)(answer, prompt.entry))
        except ConfigError:
            raise
        except Exception as e:  # a task scorer that chokes on odd model output
            self.errors += 1
            log.debug("reasoning-gym scorer of %s failed on %r: %s", prompt.task, answer, e)
            return 0.0

    # --------------------------------------------------------------- math

    def _run_math(self, pairs: list[tuple[str, str]]) -> list[tuple[float, bool]]:
        """(score, timed_out) per (reference, answer); each call bounded by the timeout."""
        _quiet_math_verify()
        with self._lock:
            if self._pool is None:
                self._pool = _DaemonPool(self._workers)
            pool = self._pool
        futures = [pool.submit(_math_equal, ref, ans) for ref, ans in pairs]
        limit = self.cfg.timeout_seconds
        out: list[tuple[float, bool] | None] = [None] * len(futures)
        pending = set(range(len(futures)))
        stuck = False
        while pending:
            now = time.monotonic()
            wait_for = limit
            for k in list(pending):
                fut = futures[k]
                if fut.done():
                    pending.discard(k)
                    try:
                        out[k] = (float(fut.result()), False)
                    except Exception as e:  # noqa: BLE001 - a parser crash scores 0
                        self.errors += 1
                        log.debug("math-verify failed on %r: %s", pairs[k], e)
                        out[k] = (0.0, False)
                elif fut.started_at is not None:
                    left = fut.started_at + limit - now
                    if left <= 0:
                        pending.discard(k)
                        out[k] = (0.0, True)
                        stuck = True
                        self.timeouts += 1
                        log.warning("math-verify ran past reward.timeout_seconds=%g on "
                                    "answer %.80r: scored 0", limit, pairs[k][1])
                    else:
                        wait_for = min(wait_for, left)
            if not pending:
                break
            if stuck:
                # the stuck workers keep their threads; move the queued calls to a fresh
                # pool so they do not wait behind them
                with self._lock:
                    if self._pool is pool:
                        self._pool.shutdown()
                        self._pool = _DaemonPool(self._workers)
                    pool = self._pool
                for k in list(pending):
                    if futures[k].cancel():  # not started yet: resubmit
                        futures[k] = pool.submit(_math_equal, *pairs[k])
                stuck = False
            # wake when something finishes or the earliest running call's deadline passes
            _wait_any([futures[k] for k in pending], max(wait_for, 0.001))
        return out  # type: ignore[return-value]

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass


def _wait_any(futures: list[Future], timeout: float) -> None:
    from concurrent.futures import FIRST_COMPLETED, wait

    wait(futures, timeout=min(timeout, 0.5), return_when=FIRST_COMPLETED)
