"""The ``prompt_lookup`` drafter kind: n-gram lookup in the row's own prompt (prompt-lookup
decoding). A row's context (its last ``max_n`` tokens) is looked up among the prompt's
n-grams, the longest that occurred first; what followed its occurrences is proposed,
a chain of the most frequent continuation or a tree of the distinct ones. One index
per distinct prompt (a GRPO group's rows share it), built once, the last
``PROMPTS`` kept. No model, no training, no memory on the accelerator.
"""

from __future__ import annotations

from collections import OrderedDict

from .model_free import TREE_ARMS, ModelFreeDrafter
from .suffix_index import SuffixIndex

PROMPTS = 64  # prompts' indices kept (least recently used dropped)


class PromptLookup(ModelFreeDrafter):
    name = "prompt_lookup"
    label = "the prompt's n-gram lookup"
    color = "tab:brown"
    arms = TREE_ARMS

    def __init__(self, min_n: int = 2, max_n: int = 4):
        self.min_n, self.max_n = min_n, max_n
        self._indices: OrderedDict[tuple, SuffixIndex] = OrderedDict()

    def settings(self) -> dict:
        return {"kind": self.name, "min_n": self.min_n, "max_n": self.max_n}

    def _index(self, prompt) -> SuffixIndex:
        key = tuple(prompt)
        idx = self._indices.get(key)
        if idx is None:
            idx = SuffixIndex(min_n=self.min_n, max_n=self.max_n,
                              max_tokens=max(len(key), 1))
            idx.extend(0, key, live=False)
            self._indices[key] = idx
            while len(self._indices) > PROMPTS:
                self._indices.popitem(last=False)
        self._indices.move_to_end(key)
        return idx

    def lookup(self, row, depth: int) -> list[list[int]]:
        context = (list(row.prompt[-self.max_n:]) + list(row.tokens))[-self.max_n:]
        return self._index(row.prompt).candidates(context, depth)

    def propose(self, tokens, depth: int) -> list[int]:
        raise NotImplementedError("the prompt_lookup kind looks rows up (lookup)")

    @classmethod
    def from_value(cls, value, **kw):
        return cls() if value == cls.name else None
