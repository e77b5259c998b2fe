"""The target as the drafter loss reads it under tensor parallelism.

The drafter loss (``losses.py``) and the alpha measurement look up the target's
embedding rows and multiply by its output layer over the whole vocabulary (the target's
processed distribution p̃ needs every logit for temperature, top-k and top-p). At TP > 1
each rank of a replica holds a vocabulary slice of both. ``WholeVocabTarget`` wraps the
rollout's ``ModelRunner``: inside ``whole_vocab()`` its ``embed_w`` and ``output_w`` are
the full matrices, all-gathered over the TP group on entry (a collective every TP rank
of the replica enters together) and released on exit; everything else (RoPE, device,
dtype, the TP group) is the runner's. At TP = 1 they are the runner's own tensors and
nothing is copied.

At pipeline parallelism > 1 (``rollout.pipeline_mode=gathered``) the runner is a
``GatheredRunner``: every pipeline rank holds the embedding and the output layer, its
own or a copy the rollout keeps (re-sent from the owning stage at every generate), so
the view works on every stage as at PP = 1 and adds no memory of its own. Between a
policy update and the next generate the copies are stale: ``whole_vocab(refresh=True)``
re-sends them first (``ModelRunner.sync_vocab``, a broadcast over the pipeline group of
the matrices a stage does not own; nothing when the runner reads them in place).

Cost per entry at TP = t: one all-gather of the output layer (and of the embedding when
the two are not tied), (t-1)/t of V x H each, held only while the context is open. The
alternative, vocabulary-parallel logits (each rank its slice, all-reduced maxima and
sums as megatron-core's vocab-parallel cross-entropy does), moves no weights but
needs the top-k / top-p processing spread over slices and an all-gather or all-reduce
of [positions, V/t] tensors per micro-step chunk; the policy's weights are fixed
between two policy updates, so one gather per window is the cheaper of the two on a
window of more than about one micro-step (docs/drafter-group.md has the numbers).
"""

from __future__ import annotations

import contextlib

import torch

from .. import collectives

__all__ = ["WholeVocabTarget", "gather_vocab_rows"]


@torch.no_grad()
def gather_vocab_rows(local: torch.Tensor, group) -> torch.Tensor:
    """The whole [V_padded, H] matrix from each TP rank's vocabulary slice (dim 0)."""
    return torch.cat(collectives.all_gather(local.detach(), group), dim=0)


class WholeVocabTarget:
    """A ``ModelRunner`` whose embedding and output layer are unsharded inside
    ``whole_vocab()`` (see the module docstring)."""

    def __init__(self, runner):
        self.runner = runner
        self._whole: dict = {}
        self._depth = 0

    @property
    def sharded(self) -> bool:
        return getattr(self.runner, "tp_group", None) is not None

    @contextlib.contextmanager
    def whole_vocab(self, *, refresh: bool = False):
        """Unsharded ``embed_w`` / ``output_w`` for the block (re-entrant: an inner
        entry reuses the outer one's copies). ``refresh``: first bring the runner's
        copies of them up to date with their owners' parameters (after a policy update;
        a collective over the pipeline group)."""
        if refresh:
            self.runner.sync_vocab()
        if not self.sharded or self._depth:
            self._depth += 1
            try:
                yield self
            finally:
                self._depth -= 1
            return
        r = self.runner
        emb = gather_vocab_rows(r.embed_w, r.tp_group)
        out = emb if r.output_w is r.embed_w else gather_vocab_rows(r.output_w, r.tp_group)
        self._whole = {"embed_w": emb, "output_w": out}
        self._depth = 1
        try:
            yield self
        finally:
            self._depth = 0
            self._whole = {}

    def _matrix(self, name: str) -> torch.Tensor:
        if not self.sharded:
            return getattr(self.runner, name)
        if name not in self._whole:
            raise RuntimeError(f"the target's {name} is a vocabulary slice at tensor "
                               "parallel size > 1: read it inside "
                               "WholeVocabTarget.whole_vocab()")
        return self._whole[name]

    @property
    def embed_w(self) -> torch.Tensor:
        return self._matrix("embed_w")

    @property
    def output_w(self) -> torch.Tensor:
        return self._matrix("output_w")

    def __getattr__(self, name):  # everything else is the runner's
        if name == "runner":
            raise AttributeError(name)
        return getattr(self.runner, name)
