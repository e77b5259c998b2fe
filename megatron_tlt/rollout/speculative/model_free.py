"""Model-free drafter kinds: drafts proposed from a row's own tokens (n-gram or suffix
lookups, the group's sibling responses), no model and no cache.

A kind subclasses ``ModelFreeDrafter`` and defines ``propose(tokens, depth)``; its
decoder (``ModelFreeDecoder``) verifies the proposals as every kind's drafts are
verified (``SpeculativeDecoder.step``), chains only. A proposal is deterministic, so
the drafter's distribution q is one-hot on it: exact rejection sampling accepts a
draft x with probability p~(x) and resamples from p~ without x, and coupled and greedy
rows accept while the draft equals the target's own token. Proposing runs on the host,
once per row and step (what an n-gram lookup is); the verification stays batched.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from ...spec_strategy import Strategy
from ..forward import ModelRunner
from .decoder import SpeculativeDecoder
from .drafter_kind import Drafter
from .drafting import Drafting, is_standard
from .stats import SpecStats

# chains only (a proposal has no siblings), shallow: a lookup's later tokens are less
# likely to hold
CHAIN_ARMS = "*:0_0_0,2_1_2,3_1_3,4_1_4"


class ModelFreeDrafter(Drafter):
    """A kind whose drafts are a function of the row's tokens."""

    fed = "tokens"

    def propose(self, tokens: Sequence[int], depth: int) -> list[int]:
        """Up to ``depth`` draft tokens to follow ``tokens`` (prompt and response so
        far); fewer (or none) where the kind has nothing to propose."""
        raise NotImplementedError

    def make_decoder(self, target: ModelRunner) -> "ModelFreeDecoder":
        return ModelFreeDecoder(self, target)

    @classmethod
    def tuner_config(cls, sc):
        import dataclasses

        return dataclasses.replace(sc, arms=CHAIN_ARMS)


class ModelFreeDecoder(SpeculativeDecoder):
    """``SpeculativeDecoder`` whose drafts come from ``drafter.propose``: no drafter
    cache, feature store or catch-up."""

    keeps_hidden = False

    def __init__(self, drafter: ModelFreeDrafter, target: ModelRunner):
        self.drafter = drafter
        self.kind = drafter.name
        self.target = target
        self.drafting = Drafting(None, target)  # the step's coupled noise rows
        self.feature_layers = ()
        self.feature_width = 0
        self.cache = None
        self.features = None
        self.draft_len: list[int] = []

    # ---------------------------------------------------------------- no model
    def pack_weights(self) -> tuple[int, float]:
        return 0, 0.0

    def wire_graphs(self, graphs) -> None:
        self.graphs = graphs  # verification through the engine's graphs

    def graph_decisions(self) -> dict[str, dict]:
        return {}

    def begin(self, max_batch: int, capacity: int, slack: int, *,
              reach: Optional[int] = None, draft_rows: Optional[int] = None) -> None:
        self.draft_len = [0] * max_batch

    def release(self) -> None:
        pass

    def store(self, row: int, first_pos: int, feats: torch.Tensor) -> None:
        pass

    def store_step(self, start: torch.Tensor, feats: torch.Tensor) -> None:
        pass

    def copy_prompt(self, src: int, dst: list[int], length: int) -> None:
        pass

    def move_row(self, src: int, dst: int, length: int) -> None:
        pass

    def pending(self, rows: Sequence) -> int:
        return 0

    def catch_up(self, rows: Sequence, stats: SpecStats, target_cache=None) -> int:
        return 0

    # ---------------------------------------------------------------- drafts
    def _draft(self, rows: Sequence, strategy: Strategy, stats: SpecStats):
        """Each row's proposal, and for standard rows q one-hot on it [B, depth', V]."""
        if not strategy.is_chain:
            raise ValueError(f"{self.drafter.label} drafts chains; strategy "
                             f"{strategy.name} is a tree (give its tuner chain arms)")
        drafts = [list(self.drafter.propose(r.prompt + r.tokens, strategy.depth))
                  [: strategy.depth] for r in rows]
        width = max(len(d) for d in drafts)
        q_lp = None
        if width and any(is_standard(r) for r in rows):
            vocab, dev = self.target.arch.vocab_size, self.target.device
            q_lp = torch.full((len(rows), width, vocab), float("-inf"), device=dev)
            at = [(i, j, t) for i, d in enumerate(drafts) for j, t in enumerate(d)]
            i, j, t = torch.tensor(at, dtype=torch.long, device=dev).unbind(1)
            q_lp[i, j, t] = 0.0
        return drafts, q_lp, None
