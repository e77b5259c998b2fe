"""RL prompt sets: reasoning-gym tasks or JSONL / Parquet files, validated up front.

``build_prompt_sets(cfg.data, tokenizer)`` returns ``(train, eval)`` lists of
``tasks.Prompt``: chat messages, their token ids (chat template applied with the
assistant generation prompt, no BOS added twice), the reference answer and what
the verifier needs (the reasoning-gym entry, or the raw file row).

Sources (``data.source``):

* ``reasoning_gym``: ``train_size`` entries of ``data.task`` with
  ``data.task_params`` merged over ``tasks.TASK_PRESETS[task]``, from
  reasoning-gym seed ``data.seed * 2**32`` (``tasks.make_dataset``'s seed striding:
  reasoning-gym builds entry i from ``Random(seed + i)``). The eval set
  (``eval_size``) comes from the same stream shifted by ``2**31``, so it never
  shares an entry seed with the training set (of any size below 2**31) and does
  not change when ``train_size`` does. Small task spaces (e.g. two one-digit
  terms) can still produce the same *question* twice; ``stats["eval_overlap"]``
  counts eval questions that also appear in the training set.
* ``jsonl`` / ``parquet``: ``data.path``; ``data.prompt_field`` holds a string
  (the user message) or a list of ``{role, content}`` messages, and
  ``data.answer_field`` the reference (numbers become strings: ``2.0`` -> "2").
  The eval set is the last ``eval_size`` valid rows, the training set the first
  ``train_size`` (0 = all) of the rest. Parquet is read with the ``datasets``
  library (offline, quiet, throw-away cache). JSONL is read line by line with the
  standard library: ``datasets``' Arrow schema inference re-decodes mixed-type
  columns (the string "2" comes back as the int 2), widens ints to floats next to
  float rows and drops blank lines, so neither the values nor the line numbers
  would be the file's.

Every row is validated before anything else runs: a missing field, a wrong type,
an empty prompt, a prompt longer than ``data.max_prompt_tokens`` after the chat
template is a ``DataError`` naming the file, the line (1-based row; for JSONL the
physical line) and the field. With ``data.skip_bad_rows`` such rows are skipped
and counted (``PromptSet.skipped_rows``, ``PromptSet.stats``, a log warning).

``data.instruction`` is appended on a new line to the user message (the last user
message of a chat prompt); ``data.system_prompt`` adds a system message unless
the row's chat messages already have one.

``PromptSampler`` cycles through a prompt list, reshuffled per epoch from
``(seed, epoch)``, and resumes exactly from its ``state_dict``.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import math
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Optional

import numpy as np

from ..config import ConfigError, DataConfig
from ..tasks import (
    Prompt,
    TaskError,
    build_messages,
    chat_token_ids,
    make_dataset,
    normalize_number,
    task_config,
)

__all__ = ["DataError", "PromptSet", "PromptSampler", "build_prompt_sets",
           "EVAL_SEED_OFFSET"]

log = logging.getLogger(__name__)

# The eval stream of reasoning-gym seed s*2**32 starts at s*2**32 + 2**31: disjoint from
# the training stream (sizes < 2**31) and from every other data.seed's streams.
EVAL_SEED_OFFSET = 2**31


class DataError(ValueError):
    """A prompt row that cannot be used; the message names the file, line and field."""

    def __init__(self, message: str, path: str | None = None, line: int | None = None,
                 field: str | None = None):
        super().__init__(message)
        self.path, self.line, self.field = path, line, field


class PromptSet(list):
    """A list of ``Prompt`` that also carries how it was built.

    ``skipped_rows``: rows of the source dropped by ``data.skip_bad_rows`` (the same
    count on the train and the eval set of one build). ``stats``: source, rows read,
    skipped rows by reason, the first few skip messages, sizes, eval/train question
    overlap (reasoning-gym).
    """

    def __init__(self, prompts=(), skipped_rows: int = 0, stats: dict | None = None):
        super().__init__(prompts)
        self.skipped_rows = skipped_rows
        self.stats = dict(stats or {})


# ----------------------------------------------------------------------------- building


@dataclass
class _Row:
    """A candidate row before validation: where it came from and its raw content."""

    uid: str
    line: int
    value: Any          # the parsed row (dict) or an exception message (str) if unparsable
    parse_error: Optional[str] = None


def build_prompt_sets(cfg: DataConfig, tokenizer) -> tuple[PromptSet, PromptSet]:
    """(train, eval) prompt sets for ``cfg``; see the module docstring.

    Raises:
        ConfigError: unknown reasoning-gym task or parameters the task rejects,
            a missing file, or sizes the file cannot satisfy.
        DataError: a bad row (unless ``cfg.skip_bad_rows``), naming file, line, field.
    """
    if cfg.source == "reasoning_gym":
        return _build_reasoning_gym(cfg, tokenizer)
    if cfg.source in ("jsonl", "parquet"):
        return _build_file(cfg, tokenizer)
    raise ConfigError(f"data.source={cfg.source!r} is not valid; choose one of "
                      f"reasoning_gym, jsonl, parquet")


def _messages(user_or_messages: Any, cfg: DataConfig) -> list[dict]:
    """Chat messages with ``data.instruction`` and ``data.system_prompt`` applied."""
    return build_messages(user_or_messages, cfg.instruction, cfg.system_prompt or None)


class _Collector:
    """Validated prompts of one source; bad rows raise or are counted."""

    def __init__(self, cfg: DataConfig, tokenizer, origin: str):
        self.cfg, self.tokenizer, self.origin = cfg, tokenizer, origin
        self.errors: list[DataError] = []
        self.reasons: dict[str, int] = {}

    def bad(self, line: int, field: str, why: str, reason: str) -> None:
        err = DataError(f"{self.origin}, line {line}, field {field!r}: {why}",
                        path=self.origin, line=line, field=field)
        self.errors.append(err)
        self.reasons[reason] = self.reasons.get(reason, 0) + 1

    def tokenize(self, uid: str, line: int, field: str, messages: list[dict], answer: str,
                 entry: dict | None, task: str | None) -> Prompt | None:
        try:
            ids = chat_token_ids(self.tokenizer, messages)
        except Exception as e:  # a template that refuses the roles / order of messages
            self.bad(line, field, f"the chat template rejects these messages: {e}",
                     "chat template error")
            return None
        if len(ids) > self.cfg.max_prompt_tokens:
            self.bad(line, field, f"prompt is {len(ids)} tokens after the chat template, "
                     f"more than data.max_prompt_tokens={self.cfg.max_prompt_tokens}",
                     "too long")
            return None
        return Prompt(uid=uid, messages=messages, token_ids=ids, answer=answer, entry=entry,
                      task=task)

    def finish(self) -> int:
        """Raise the first error (unless skipping); returns the number of skipped rows."""
        if not self.errors:
            return 0
        if not self.cfg.skip_bad_rows:
            first = self.errors[0]
            more = len(self.errors) - 1
            suffix = (f" ({more} more bad row{'s' if more > 1 else ''}; "
                      f"data.skip_bad_rows=true skips them)" if more
                      else " (data.skip_bad_rows=true skips such rows)")
            raise DataError(str(first) + suffix, first.path, first.line, first.field)
        shown = "; ".join(str(e) for e in self.errors[:3])
        log.warning("data: skipped %d bad row(s) of %s (%s): %s%s", len(self.errors),
                    self.origin, ", ".join(f"{k}: {v}" for k, v in self.reasons.items()),
                    shown, " ..." if len(self.errors) > 3 else "")
        return len(self.errors)


def _build_reasoning_gym(cfg: DataConfig, tokenizer) -> tuple[PromptSet, PromptSet]:
    # data.seed and data.train_size: checked by validation.validate (prompt_settings)
    task_params = dict(cfg.task_params or {})
    try:
        config = task_config(cfg.task, task_params)
        train_ds = make_dataset(cfg.task, cfg.train_size, cfg.seed, config)
        eval_ds = (make_dataset(cfg.task, cfg.eval_size, cfg.seed, config,
                                offset=EVAL_SEED_OFFSET)
                   if cfg.eval_size else None)
    except TaskError as e:
        raise ConfigError(f"data.task={cfg.task!r} / data.task_params={task_params}: "
                          f"{e}") from None

    skipped = 0
    reasons: dict[str, int] = {}
    samples: list[str] = []
    sets = []
    for split, ds in (("train", train_ds), ("eval", eval_ds)):
        col = _Collector(cfg, tokenizer, f"reasoning_gym:{cfg.task}:{split}")
        prompts = []
        for i in range(len(ds) if ds is not None else 0):
            try:
                entry = ds[i]
            except Exception as e:  # a generator bug for some parameter combination
                col.bad(i + 1, "question", f"reasoning-gym failed to generate it: {e}",
                        "generation error")
                continue
            question, answer = entry.get("question"), entry.get("answer")
            if not isinstance(question, str) or not question.strip():
                col.bad(i + 1, "question", "empty or not a string", "empty prompt")
                continue
            if answer is None:
                col.bad(i + 1, "answer", "missing", "missing field")
                continue
            p = col.tokenize(f"{cfg.task}:{split}:{i}", i + 1, "question",
                             _messages(question, cfg), str(answer), entry, cfg.task)
            if p is not None:
                prompts.append(p)
        n_bad = col.finish()
        skipped += n_bad
        for k, v in col.reasons.items():
            reasons[k] = reasons.get(k, 0) + v
        samples += [str(e) for e in col.errors[:3]]
        sets.append(prompts)
    train, evals = sets
    if not train:
        raise DataError(f"reasoning_gym:{cfg.task}: every training prompt was skipped "
                        f"({reasons})", f"reasoning_gym:{cfg.task}:train")
    train_q = {p.entry["question"] for p in train}
    stats = {
        "source": "reasoning_gym", "task": cfg.task, "task_params": config,
        "rows": cfg.train_size + cfg.eval_size, "skipped_rows": skipped,
        "skipped_by_reason": reasons, "skipped_examples": samples[:3],
        "train_size": len(train), "eval_size": len(evals),
        "eval_overlap": sum(p.entry["question"] in train_q for p in evals),
    }
    return (PromptSet(train, skipped, stats), PromptSet(evals, skipped, stats))


# ----------------------------------------------------------------------------- files


def _read_jsonl(path: Path) -> Iterator[_Row]:
    name = path.name
    with open(path, encoding="utf-8") as f:
        for lineno, text in enumerate(f, start=1):
            if not text.strip():
                continue
            try:
                value = json.loads(text)
            except json.JSONDecodeError as e:
                yield _Row(f"{name}:{lineno}", lineno, None, f"not valid JSON ({e.msg}, "
                                                             f"column {e.colno})")
                continue
            yield _Row(f"{name}:{lineno}", lineno, value)


@contextlib.contextmanager
def _quiet_datasets():
    """No progress bars or info logs from ``datasets`` while inside; restored after."""
    import datasets

    bars = datasets.is_progress_bar_enabled()
    verbosity = datasets.logging.get_verbosity()
    datasets.disable_progress_bars()
    datasets.logging.set_verbosity_error()
    try:
        yield datasets
    finally:
        datasets.logging.set_verbosity(verbosity)
        if bars:
            datasets.enable_progress_bars()


def _read_parquet(path: Path) -> Iterator[_Row]:
    with _quiet_datasets() as datasets, tempfile.TemporaryDirectory(prefix="tlt_ds_") as cache:
        try:
            ds = datasets.load_dataset("parquet", data_files=str(path), split="train",
                                       cache_dir=cache, keep_in_memory=True)
        except Exception as e:
            raise DataError(f"{path}: cannot read it as Parquet: {type(e).__name__}: {e}",
                            str(path)) from None
        rows = ds.to_list()
    for i, value in enumerate(rows, start=1):
        yield _Row(f"{path.name}:{i}", i, value)


def _answer_string(value: Any) -> str | None:
    """Reference answer as a string; None when its type is not usable."""
    if isinstance(value, bool):
        return None
    if isinstance(value, str):
        return value.strip()
    if isinstance(value, (int, np.integer)):
        return str(int(value))
    if isinstance(value, (float, np.floating)):
        if not math.isfinite(value):
            return None
        return normalize_number(repr(float(value)))  # 2.0 -> "2", 0.5 -> "0.5"
    return None


def _check_messages(value: list) -> str | None:
    """Why a chat-message prompt is unusable, or None."""
    if not value:
        return "empty list of messages"
    for k, m in enumerate(value):
        if not isinstance(m, dict):
            return f"message {k} is a {type(m).__name__}, not a {{role, content}} object"
        role, content = m.get("role"), m.get("content")
        if not isinstance(role, str) or not role:
            return f"message {k} has no string 'role'"
        if not isinstance(content, str):
            return f"message {k} ('{role}') has no string 'content'"
    if not any(m["role"] == "user" for m in value):
        return "no message with role 'user'"
    if not any(m["content"].strip() for m in value if m["role"] != "system"):
        return "empty prompt (every user/assistant message is empty)"
    return None


def _build_file(cfg: DataConfig, tokenizer) -> tuple[PromptSet, PromptSet]:
    path = Path(cfg.path).expanduser()
    if not path.is_file():
        raise ConfigError(f"data.path={cfg.path!r} does not exist or is not a file")
    reader = _read_jsonl if cfg.source == "jsonl" else _read_parquet
    col = _Collector(cfg, tokenizer, str(path))
    pf, af = cfg.prompt_field, cfg.answer_field
    prompts: list[Prompt] = []
    n_rows = 0
    for row in reader(path):
        n_rows += 1
        if row.parse_error is not None:
            col.bad(row.line, "<row>", row.parse_error, "invalid JSON")
            continue
        value = row.value
        if not isinstance(value, dict):
            col.bad(row.line, "<row>", f"a row must be a JSON object, got "
                    f"{type(value).__name__}", "wrong type")
            continue
        prompt = value.get(pf)
        if prompt is None:
            present = ", ".join(sorted(map(str, value))) or "none"
            col.bad(row.line, pf, f"missing (data.prompt_field={pf!r}; fields present: "
                    f"{present})", "missing field")
            continue
        if isinstance(prompt, str):
            if not prompt.strip():
                col.bad(row.line, pf, "empty prompt", "empty prompt")
                continue
        elif isinstance(prompt, (list, tuple)):
            why = _check_messages(list(prompt))
            if why is not None:
                col.bad(row.line, pf, why,
                        "empty prompt" if "empty" in why else "wrong type")
                continue
        else:
            col.bad(row.line, pf, f"must be a string or a list of {{role, content}} "
                    f"messages, got {type(prompt).__name__}", "wrong type")
            continue
        if af not in value or value[af] is None:
            present = ", ".join(sorted(map(str, value))) or "none"
            col.bad(row.line, af, f"missing (data.answer_field={af!r}; fields present: "
                    f"{present})", "missing field")
            continue
        answer = _answer_string(value[af])
        if answer is None:
            col.bad(row.line, af, f"must be a string or a number, got "
                    f"{type(value[af]).__name__} {value[af]!r:.60}", "wrong type")
            continue
        if not answer:
            col.bad(row.line, af, "empty answer", "empty answer")
            continue
        p = col.tokenize(row.uid, row.line, pf, _messages(prompt, cfg), answer, value, None)
        if p is not None:
            prompts.append(p)
    skipped = col.finish()
    if not prompts:
        raise DataError(f"{path}: no usable rows ({n_rows} read, {skipped} skipped); "
                        f"data.path needs rows with data.prompt_field={pf!r} and "
                        f"data.answer_field={af!r}", str(path))
    n_eval = cfg.eval_size
    if n_eval >= len(prompts):
        raise ConfigError(f"data.eval_size={n_eval} leaves no training rows: {path} has "
                          f"{len(prompts)} usable rows")
    train_pool = prompts[:len(prompts) - n_eval]
    evals = prompts[len(prompts) - n_eval:]
    train = train_pool[:cfg.train_size] if cfg.train_size else train_pool
    if cfg.train_size > len(train_pool):
        log.warning("data: data.train_size=%d but %s has only %d training rows; using "
                    "all of them (data.train_size=0 means every row)", cfg.train_size,
                    path, len(train_pool))
    stats = {
        "source": cfg.source, "path": str(path), "rows": n_rows, "skipped_rows": skipped,
        "skipped_by_reason": dict(col.reasons),
        "skipped_examples": [str(e) for e in col.errors[:3]],
        "train_size": len(train), "eval_size": len(evals),
    }
    return PromptSet(train, skipped, stats), PromptSet(evals, skipped, stats)


# ----------------------------------------------------------------------------- sampling


def _fingerprint(prompts: list[Prompt]) -> str:
    h = hashlib.sha1()
    for p in prompts:
        h.update(p.uid.encode())
        h.update(b"\0")
        h.update(np.asarray(p.token_ids, dtype=np.int64).tobytes())
        h.update(b"\0")
        h.update(p.answer.encode())
        h.update(b"\1")
    return h.hexdigest()[:16]


class PromptSampler:
    """Cycles through ``prompts`` in a per-epoch shuffled order, resumable exactly.

    The order of epoch ``e`` is a permutation drawn from NumPy's generator seeded with
    ``(seed, e)``: deterministic, different every epoch, independent of how the
    prompts were consumed. ``next_batch(n)`` continues across epoch boundaries.
    """

    def __init__(self, prompts: list[Prompt], seed: int):
        if len(prompts) == 0:
            raise ValueError("PromptSampler needs at least one prompt")
        self.prompts = prompts
        self.seed = int(seed)
        self.epoch = 0
        self.position = 0
        self.served = 0
        self._order_epoch = -1
        self._order: np.ndarray | None = None
        self._fingerprint: str | None = None

    def __len__(self) -> int:
        return len(self.prompts)

    @property
    def skipped_rows(self) -> int:
        """Rows the prompt set's build skipped (``data.skip_bad_rows``); 0 if unknown."""
        return int(getattr(self.prompts, "skipped_rows", 0))

    @property
    def stats(self) -> dict:
        return {"size": len(self.prompts), "epoch": self.epoch, "position": self.position,
                "served": self.served, "skipped_rows": self.skipped_rows}

    @property
    def fingerprint(self) -> str:
        """Hash of the prompt set (uids, token ids, answers); checked on resume."""
        if self._fingerprint is None:
            self._fingerprint = _fingerprint(self.prompts)
        return self._fingerprint

    def _permutation(self, epoch: int) -> np.ndarray:
        if self._order_epoch != epoch:
            rng = np.random.default_rng([self.seed % 2**64, epoch])
            self._order = rng.permutation(len(self.prompts))
            self._order_epoch = epoch
        return self._order

    def next_batch(self, n: int) -> list[Prompt]:
        """The next ``n`` prompts (n may exceed the set: it wraps into the next epochs)."""
        if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 1:
            raise ValueError(f"next_batch needs n >= 1, got {n!r}")
        out = []
        while len(out) < n:
            order = self._permutation(self.epoch)
            take = min(n - len(out), len(order) - self.position)
            out.extend(self.prompts[i] for i in order[self.position:self.position + take])
            self.position += take
            if self.position == len(order):
                self.epoch += 1
                self.position = 0
        self.served += n
        return out

    def state_dict(self) -> dict:
        """JSON-serialisable position: epoch, position, seed, size, served, fingerprint."""
        return {"epoch": self.epoch, "position": self.position, "seed": self.seed,
                "size": len(self.prompts), "served": self.served,
                "fingerprint": self.fingerprint}

    def load_state_dict(self, state: dict, strict: bool = True) -> None:
        """Resume at ``state``'s position.

        Refuses a state saved for a prompt set of another size or another seed; with
        ``strict`` also one whose fingerprint (uids, token ids, answers) differs, i.e.
        the prompts changed (task parameters, instruction, file). ``strict=False``
        accepts a changed set of the same size and seed.
        """
        missing = [k for k in ("epoch", "position", "seed", "size") if k not in state]
        if missing:
            raise ValueError(f"prompt sampler state lacks {missing}: {state!r}")
        if int(state["size"]) != len(self.prompts):
            raise ValueError(
                f"cannot resume the prompt sampler: the checkpoint was saved with "
                f"{state['size']} prompts, this run has {len(self.prompts)} (data.* "
                f"changed: train_size, task, file or skipped rows)")
        if int(state["seed"]) != self.seed:
            raise ValueError(
                f"cannot resume the prompt sampler: the checkpoint was saved with seed "
                f"{state['seed']}, this run uses {self.seed} (data.seed changed)")
        fp = state.get("fingerprint")
        if strict and fp is not None and fp != self.fingerprint:
            raise ValueError(
                "cannot resume the prompt sampler: the prompts differ from the "
                "checkpoint's (same size and seed, but other prompts or answers: "
                "data.task_params, data.instruction, data.system_prompt or the file "
                "changed); load_state_dict(state, strict=False) accepts it")
        epoch, position = int(state["epoch"]), int(state["position"])
        if epoch < 0 or not 0 <= position < len(self.prompts):
            raise ValueError(f"prompt sampler state out of range: epoch {epoch}, position "
                             f"{position}, size {len(self.prompts)}")
        self.epoch, self.position = epoch, position
        self.served = int(state.get("served", epoch * len(self.prompts) + position))
