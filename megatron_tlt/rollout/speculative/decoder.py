"""The speculative step for a running batch, every row at its own position L, its last
sampled token x_L not yet in the target's cache: one verify-and-commit component for
every drafter kind (``SpeculativeDecoder``). A kind's decoder subclasses it and
implements only the proposer's part (``proposer.Proposer``: ``propose``,
``committed``, its per-row state and catch-up ``feed``); no kind overrides
verification (tests/rollout/test_drafter_registry.py checks it).

1. Proposal: the kind's ``propose`` (after its catch-up) gives per row a chain with q
   (one-hot for a deterministic proposal) or a ``DraftTree`` of candidates.
2. Verification: one target forward over [x_L, drafts...] (chains causally, trees
   with an ancestor mask and depth-based RoPE positions) gives p at every node from
   the same ``processed_logprobs`` as plain decoding.
3. Acceptance (exact; standard rows: ``acceptance_batched.py``, all rows at once on
   their random streams: chains by min(1, p/q), trees' candidates tried in order
   against the residual; greedy rows: ``acceptance.py``; coupled rows: greedy
   verification of log p~ + g_t, so the output is the plain coupled sample whatever
   the proposal).
4. The proposer is told what was accepted (``committed``); the engine emits the
   tokens, log-probs and hidden states exactly as plain decoding emits them (stop
   tokens and length limits cut the accepted run) and accepted tree nodes' keys/values
   (and recorded experts) move to consecutive cache slots (``compact``; rejected slots
   are simply beyond the new length).
"""

from __future__ import annotations

import time
from typing import Optional, Sequence

import torch

from ...spec_strategy import Strategy
from ..forward import ModelRunner
from ..kv_cache import KVCache
from ..sampling import CoupledNoise
from .acceptance import processed_rows
from .decision import Decision
from .drafting import DraftTree, is_coupled, ragged
from .emissions import Emission, Verified, accept_rows
from .proposer import Proposer
from .stats import SpecStats

# the methods of the one verifier, which no kind's decoder defines again
VERIFICATION = ("step", "catch_up", "compact", "_verify_chains", "_verify_tree",
                "_verify_noise", "_agree")


class SpeculativeDecoder(Proposer):
    """Verification and commit of a kind's proposals for the engine's running rows
    (``drafter``: the ``Drafter`` it drafts for, ``target``: the target's runner).
    Subclasses implement the proposer (``proposer.Proposer``)."""

    # the engine's fixed-shape target forwards (``cuda_graphs.GraphedDecoder``), set by
    # the engine at every call when it decodes through them: verification replays a
    # graph per (batch bucket, tokens per row, chain or tree); None: eager
    graphs = None

    def __init__(self, drafter, target: ModelRunner):
        self.drafter = drafter
        self.kind = drafter.name  # in metrics (``SpecStats.kinds``)
        self.target = target
        # a step's coupled noise rows, computed once per (request, position): drafting
        # at L+1..L+d and verification at L+1..L+d+1 share them
        self.noise = CoupledNoise(target.arch.vocab_size, target.device)

    def use_noise(self, noise: CoupledNoise) -> None:
        """Share ``noise`` (the step's coupled noise rows) with another decoder's
        verification (``multi.KindDecoder``)."""
        self.noise = noise

    # ---------------------------------------------------------------- the engine's view
    def each(self) -> list["SpeculativeDecoder"]:
        """The decoders speculating (one; several kinds: ``multi.KindDecoder``)."""
        return [self]

    def active_kind(self) -> Optional[str]:
        return self.kind

    def alone(self, rows: Sequence, decision: Decision, tuner) -> Optional[Decision]:
        """A step ``tuner`` declined (``decision``) as model-free kinds' alone step, or
        None: a plain step (one kind: always; several: ``multi.KindDecoder.alone``)."""
        return None

    def kinds_of_rows(self, n: int) -> list[str]:
        """The kind that proposed each of the last step's ``n`` rows."""
        return [self.kind] * n

    @torch.no_grad()
    def catch_up(self, rows: Sequence, stats: SpecStats,
                 target_cache: Optional[KVCache] = None) -> int:
        """Feed the proposer what it missed (``feed``: positions decoded plainly, new
        rows) before a step, so the step costs what a steady speculative step costs;
        the engine times this switching cost apart (the tuner's break-even gate
        compares steady steps). Returns the positions fed. (``target_cache``: the
        target's cache, which a token-fed proposer may copy from.)"""
        self.reserve(rows)  # (a paged drafter cache: the step's blocks)
        if self.pending(rows) == 0:
            return 0
        t0 = time.perf_counter()
        n = self.feed(rows, stats, target_cache)
        stats.catchup_seconds += time.perf_counter() - t0
        return n

    # ---------------------------------------------------------------- the step
    @torch.no_grad()
    def step(self, target_cache: KVCache, rows: Sequence, strategy: Strategy,
             stats: SpecStats) -> tuple[list[Emission], Verified]:
        """Propose, verify and accept for running rows 0..len(rows)-1 (``rows[i]`` has
        ``.length``, ``.prompt``, ``.tokens``, ``.params``, ``.stream``, ``.key``).

        Returns per-row emissions and the verify forward's outputs over every row's
        nodes (``Verified``: hidden states, float32 logits, the processed log-probs the
        acceptance used); the caller emits from them and commits.
        """
        t0 = time.perf_counter()
        b = len(rows)
        self.noise.clear()  # this step's coupled noise rows, as the target computes them
        self.noise.kernels = self.target.kernels
        self.reserve(rows)  # (after a catch-up: nothing more)
        proposal = self.propose(rows, strategy, stats, target_cache)
        drafts, q_lp, tree = proposal.drafts, proposal.q_lp, proposal.tree
        t1 = time.perf_counter()
        stats.draft_seconds += t1 - t0

        hook, got = self.capture_hook()
        if tree is None:
            hidden, counts = self._verify_chains(target_cache, rows, drafts, hook)
        else:
            hidden, counts, got = self._verify_tree(target_cache, rows, tree, hook, got)
        stats.drafted += sum(counts) - b
        logits = self.target.logits(hidden)
        feats = self.features_of(hidden, got)
        per_query = [r for r, c in zip(rows, counts) for _ in range(c)]
        plp = processed_rows(logits, per_query)
        split = lambda t: list(torch.split(t, counts))  # noqa: E731
        logits_r, plp_r, feats_r = split(logits), split(plp), split(feats)

        noisy = self._verify_noise(rows, counts, tree)
        scores = [plp_r[i] + noisy[i] if noisy[i] is not None else plp_r[i]
                  for i in range(b)]  # coupled: greedy verification of log p~ + noise
        emissions = accept_rows(self.target, rows, scores, logits_r, plp_r, drafts, q_lp,
                                tree, (logits, plp, counts), strategy)
        emissions = self._agree(emissions, max(counts))
        self.committed(rows, strategy, emissions, feats_r, proposal.mine)
        stats.verify_seconds += time.perf_counter() - t1
        return emissions, Verified(hidden, logits, plp, list(counts))

    def _verify_tree(self, target_cache: KVCache, rows, tree: DraftTree, hook, got):
        """Target forward over every row's tree nodes (ancestor mask, RoPE positions
        L + depth). Returns hidden states [B * nodes, H], the node counts and the
        captured feature layers reshaped alike."""
        b = len(rows)
        L = torch.tensor([r.length for r in rows], dtype=torch.long,
                         device=self.target.device)
        if self.graphs is not None and hook is None:  # a fixed-shape tree step
            h3 = self.graphs.verify(target_cache, tree.verify_tokens, L,
                                    rope_positions=L[:, None] + tree.depth,
                                    new_token_mask=tree.mask)
        else:
            h3 = self.target.extend(target_cache, slice(0, b), tree.verify_tokens, L,
                                    rope_positions=L[:, None] + tree.depth,
                                    new_token_mask=tree.mask, capture=hook,
                                    span=max(r.length for r in rows)
                                    + tree.verify_tokens.shape[1])
        counts = [tree.verify_tokens.shape[1]] * b
        if got:
            got = {k: v.reshape(b * counts[0], -1) for k, v in got.items()}
        return h3.reshape(b * counts[0], -1), counts, got

    def _verify_noise(self, rows, counts: Sequence[int], tree: Optional[DraftTree]) -> list:
        """Per row, the coupled noise of each verified node [nodes, V] (a node at
        depth d predicts response position len(tokens) + d), or None (not coupled)."""
        keys, pos, owner = [], [], []
        for i, r in enumerate(rows):
            if not is_coupled(r):
                continue
            t0 = len(r.tokens)
            depths = range(counts[i]) if tree is None else tree.depths[i]
            for d in depths:
                keys.append(r.key)
                pos.append(t0 + int(d))
            owner.append(i)
        out: list = [None] * len(rows)
        if not keys:
            return out
        g = self.noise.rows(keys, pos)  # the drafts' rows computed once
        for i, part in zip(owner, torch.split(g, [counts[i] for i in owner])):
            out[i] = part
        return out

    def _verify_chains(self, cache: KVCache, rows, drafts: list[list[int]], hook):
        """Target forward over each row's [x_L, drafts...] (chains of any lengths).
        Returns hidden states [sum of lengths, H] (row by row) and the lengths."""
        dev = self.target.device
        counts = [len(d) + 1 for d in drafts]
        toks = [t for r, d in zip(rows, drafts) for t in [r.tokens[-1]] + list(d)]
        t = self.target
        static = self.graphs is not None and hook is None  # a fixed-shape chain step
        if not static and t.kernels is not None and cache.layout == "bgsd":  # ragged, fused
            row_of, pos = ragged(counts, [r.length for r in rows], dev)
            x = t.embed(torch.tensor(toks, dtype=torch.long, device=dev))
            return t.extend_chains(cache, row_of, pos, x, hook), counts
        # padded [B, T]: pad tokens sit past each row's chain (their cache slots are
        # beyond the new length, i.e. already rewound)
        b, width = len(rows), max(counts)
        ids = torch.zeros(b, width, dtype=torch.long, device=dev)
        off = 0
        for i, c in enumerate(counts):
            ids[i, :c] = torch.tensor(toks[off: off + c])
            off += c
        L = torch.tensor([r.length for r in rows], dtype=torch.long, device=dev)
        captured: dict[int, torch.Tensor] = {}
        sub = None if hook is None else (lambda i, x: captured.__setitem__(i, x))
        if static:  # the graph of (bucket, width): pads as above
            h = self.graphs.verify(cache, ids, L)
        else:
            h = t.extend(cache, slice(0, b), ids, L, capture=sub,
                         span=max(r.length for r in rows) + width)
        keep = torch.cat([torch.arange(c, device=dev) + i * width for i, c in enumerate(counts)])
        if hook is not None:
            for i, x in captured.items():
                hook(i, x.reshape(b * width, -1).index_select(0, keep))
        return h.reshape(b * width, -1).index_select(0, keep), counts

    def compact(self, target_cache: KVCache, row: int, length: int, slots: Sequence[int]) -> None:
        """Move accepted tree nodes (slot offsets from ``length``) to consecutive slots
        length+1.. in the target cache (chains are already in place), their keys,
        values and, for a mixture-of-experts target, the experts recorded for them
        (``KVCache.routes``: the routes of the verified nodes, which a plain decode
        of the accepted tokens would have taken)."""
        want = list(range(1, len(slots) + 1))
        if list(slots) == want:
            return
        target_cache.move_positions(row, [length + s for s in slots],
                                    [length + s for s in want])

    # ---------------------------------------------------------------- pieces
    def _agree(self, emissions: list[Emission], n: int) -> list[Emission]:
        """Every rank of the group that decodes together (TP and, at PP > 1, the
        pipeline stages) takes the deciding rank's emissions (``ModelRunner.agree``;
        they agree already: same logits, same streams; this makes it certain)."""
        if self.target.decides_alone:
            return emissions
        width = n + 1
        buf = torch.full((len(emissions), 2, width), -1, dtype=torch.long,
                         device=self.target.device)
        for i, e in enumerate(emissions):
            buf[i, 0, : len(e.tokens)] = torch.tensor(e.tokens)
            buf[i, 1, : len(e.nodes)] = torch.tensor(e.nodes)
        self.target.agree(buf)
        out = []
        for e, (tok_row, node_row) in zip(emissions, buf.tolist()):  # one host read
            toks = [t for t in tok_row if t >= 0]
            nodes = [t for t in node_row if t >= 0]
            same = toks == e.tokens and nodes == e.nodes  # (always, unless ranks differ)
            out.append(Emission(toks, nodes, e.logprobs if same else None))
        return out
