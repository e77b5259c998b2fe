"""A resumable store of generated responses for drafter warm-up.

Generating the self-distillation data is the slow part of a warm-up (minutes to hours
on CPU), so ``tools/warmup_drafter.py --responses FILE`` appends every finished chunk
of responses to a JSON-lines file and, when run again, generates only what is missing.
The first line records the settings the responses depend on (model and a signature of
its weights, task, seed, sampling); a later run with other settings is refused instead
of mixing data.

    store = ResponseStore(path, {"model": ..., "task": ..., "max_new_tokens": 256})
    todo = [i for i, p in enumerate(prompts) if store.get(i, p) is None]
    ...
    store.add(i, prompt, tokens)          # or add_many(records): appended, flushed
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

__all__ = ["ResponseStore", "ResponseStoreMismatch", "weights_signature"]

_FORMAT = "megatron_tlt.responses/1"


def weights_signature(model) -> str:
    """SHA-256 (first 16 hex digits) over the names, shapes, dtypes and bytes of a
    model's parameters: responses are kept per policy, so a store made with other
    weights behind the same path is refused (~0.5 s for SmolLM2's 540 MB)."""
    import hashlib

    import torch

    h = hashlib.sha256()
    for name, p in sorted(model.named_parameters(), key=lambda kv: kv[0]):
        t = p.detach().cpu().contiguous()
        h.update(f"{name}:{tuple(t.shape)}:{t.dtype};".encode())
        h.update(memoryview(t.reshape(-1).view(torch.uint8).numpy()))
    return h.hexdigest()[:16]


class ResponseStoreMismatch(ValueError):
    """The file holds responses generated with other settings or other prompts."""


class ResponseStore:
    """Responses keyed by request index, persisted line by line."""

    def __init__(self, path: str | Path, meta: Mapping[str, Any]):
        self.path = Path(path)
        self.meta = {k: meta[k] for k in sorted(meta)}
        self._records: dict[int, tuple[list[int], list[int]]] = {}
        if self.path.exists() and self.path.stat().st_size > 0:
            self._load()
        else:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with open(self.path, "w") as f:
                f.write(json.dumps({"format": _FORMAT, "meta": self.meta}) + "\n")

    def _load(self) -> None:
        with open(self.path) as f:
            lines = f.read().split("\n")
        try:
            head = json.loads(lines[0])
        except json.JSONDecodeError as e:
            raise ResponseStoreMismatch(f"{self.path}: not a response store ({e})") from None
        if not isinstance(head, dict) or head.get("format") != _FORMAT:
            raise ResponseStoreMismatch(f"{self.path}: not a response store "
                                        f"(first line lacks format {_FORMAT!r})")
        old = head.get("meta", {})
        diff = sorted(k for k in set(old) | set(self.meta) if old.get(k) != self.meta.get(k))
        if diff:
            detail = ", ".join(f"{k}: file {old.get(k)!r} vs now {self.meta.get(k)!r}"
                               for k in diff)
            raise ResponseStoreMismatch(
                f"{self.path} holds responses generated with other settings ({detail}); "
                "use another file or the original settings")
        body = lines[1:]
        good = 0
        for n, line in enumerate(body):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
                idx, prompt, tokens = int(rec["i"]), rec["prompt"], rec["tokens"]
            except (json.JSONDecodeError, KeyError, TypeError, ValueError):
                if all(not rest.strip() for rest in body[n + 1:]):
                    break  # a line cut short by an interrupted write: dropped, regenerated
                raise ResponseStoreMismatch(f"{self.path}: line {n + 2} is corrupt") from None
            self._records[idx] = (list(prompt), list(tokens))
            good = n + 1
        # Rewrite without a torn tail so later appends start on a fresh line.
        if good < len(body) and any(line.strip() for line in body[good:]):
            with open(self.path, "w") as f:
                f.write("\n".join(lines[: good + 1]) + "\n")

    def __len__(self) -> int:
        return len(self._records)

    def get(self, index: int, prompt: Sequence[int]) -> list[int] | None:
        """The stored response of request ``index``, or None; raises when the stored
        prompt differs (the prompt set changed under the same settings)."""
        rec = self._records.get(index)
        if rec is None:
            return None
        if rec[0] != list(prompt):
            raise ResponseStoreMismatch(
                f"{self.path}: request {index} was generated for another prompt; "
                "the prompt source changed, use a new file")
        return list(rec[1])

    def add(self, index: int, prompt: Sequence[int], tokens: Sequence[int]) -> None:
        self.add_many([(index, prompt, tokens)])

    def add_many(self, records: Iterable[tuple[int, Sequence[int], Sequence[int]]]) -> None:
        """Append (index, prompt, tokens) records in one write, flushed."""
        lines = []
        for index, prompt, tokens in records:
            rec = (list(map(int, prompt)), list(map(int, tokens)))
            self._records[int(index)] = rec
            lines.append(json.dumps({"i": int(index), "prompt": rec[0], "tokens": rec[1]}))
        if lines:
            with open(self.path, "a") as f:
                f.write("\n".join(lines) + "\n")
                f.flush()
