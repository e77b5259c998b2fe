"""Speculative decoding: EAGLE drafting (chain or tree) and exact verification.

One speculative step for the running batch (every row at its own position L, its
last sampled token x_L not yet in the target's cache):

1. Drafter catch-up + root: the drafter's KV cache is valid up to ``draft_len`` per
   row; the pairs (tok_{p+1}, h_p) for p = draft_len .. L-1 are fed in one ragged
   forward (h_p = the target's hidden state at p, kept in a per-position feature
   store), so switching speculation on mid-generation costs one drafter pass over
   the positions it missed, never a target re-prefill. The last pair (x_L, h_{L-1})
   is the root: its output ĥ and draft distribution q_1.
2. Drafting: a chain of ``depth`` tokens (sampled from the processed q when the
   request samples, argmax when greedy), or an EAGLE-2 tree: top-k children per node,
   the top-k nodes of each depth by cumulative draft log-probability expanded, and the
   ``verify_tokens`` best nodes of the whole tree kept, a selection closed under
   parents by construction (``draft_tree.py``).
3. Verification: one target forward over [x_L, drafts...] (chains causally, trees
   with an ancestor mask and depth-based RoPE positions) gives p at every node from
   the same ``processed_logprobs`` as plain decoding.
4. Acceptance (exact, TLT.md): chains accept draft x with probability
   min(1, p(x)/q(x)) and at the first rejection sample from norm(max(0, p - q));
   trees (deterministic drafts) try a node's children in draft order, accept child x
   with probability p'(x) where p' is p with rejected siblings removed and
   renormalised, and sample from p' when none is accepted; greedy requests follow
   argmax p. One more token (the bonus) is always emitted.
5. Commit: accepted tree nodes' keys/values move to consecutive cache slots (KV
   rewind: rejected slots are simply beyond the new length), features are stored,
   and tokens, log-probs and hidden states are emitted exactly as plain decoding
   emits them (stop tokens and length limits cut the accepted run).

Coupled sampling (``rollout.sampling_mode=coupled``, a row with a noise ``key``): the
token at response position t is argmax(log p~ + g_t) with g_t the request's counter-based
Gumbel noise (``sampling.coupled_gumbel``). The drafter drafts argmax(log q~ + g_t) with
the same noise (chains; trees rank children by their perturbed processed score, so the
drafter's own coupled token is always the first child), and verification is greedy
verification on log p~ + g_t: drafts are accepted while they equal the target's coupled
token, and the first mismatch emits it. The output is the plain coupled sample, whatever the
drafter and whether speculation is on.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Optional, Sequence

import torch
import torch.distributed as dist

from ..models.drafter import EagleDrafter
from .forward import _NO_TENSOR, ModelRunner
from .draft_tree import (TreeNotClosed, TreePool, ancestor_mask, coupled_child_scores,
                         row_layout)
from .kv_cache import KVCache
from .sampling import argmax_rows, coupled_gumbel, processed_logprobs
from .tuner import Strategy


# -------------------------------------------------------------------------------------
# the drafter's incremental forward
# -------------------------------------------------------------------------------------

class DraftRunner(ModelRunner):
    """The drafter's layer run like the target's (same kernels, TP and cache code),
    with the target's embedding, RoPE and output layer (or its draft-vocabulary rows)."""

    def __init__(self, drafter: EagleDrafter, target: ModelRunner):
        self.drafter = drafter
        self.target = target
        super().__init__(target.model, target.arch)
        self._te: dict[int, torch.nn.Module] = {}
        if drafter.config.fp8:  # FP8 GEMMs through the layer's Transformer Engine linears
            att, mlp = drafter.layer.self_attention, drafter.layer.mlp
            self._te = {id(m.weight): m for m in (att.linear_qkv, att.linear_proj,
                                                  mlp.linear_fc1, mlp.linear_fc2)}

    def _lin(self, x, w, b=None, residual=None):
        mod = self._te.get(id(w))
        if mod is None:
            return super()._lin(x, w, b, residual)
        from ..models.drafter import fp8_context

        rows = x.numel() // x.shape[-1]
        x2 = x.reshape(rows, -1)
        pad = (-rows) % 16  # FP8 GEMMs need the row count to be a multiple of 16
        if pad:
            x2 = torch.nn.functional.pad(x2, (0, 0, 0, pad))
        with fp8_context(True):
            out, bias = mod(x2)  # the module adds its own bias
        out = out[:rows]
        if bias is not None:
            out = out + bias
        if residual is not None:
            out = residual.reshape(rows, -1) + out
        return out.view(*x.shape[:-1], -1)

    def refresh(self) -> None:
        """Re-read weights (the target's shared ones too): call after either changed
        tensors by replacement, or after the target's output layer was updated and a
        draft vocabulary is used (its rows are a copy)."""
        t, d = self.target, self.drafter
        self.set_layers([d.layer])
        self.embed_w, self.vocab_start = t.embed_w, t.vocab_start
        self.final_norm = d.norm
        self.fc_w = d.fc.weight
        self.feature_fc_w = d.feature_fc.weight if d.feature_fc is not None else None
        self.d2t = d.d2t
        if self.d2t is not None:
            self.output_w = self._gather_rows(t.output_w, self.d2t)
        else:
            self.output_w = t.output_w

    def kernel_weights(self) -> list[torch.Tensor]:
        """The drafter's own matrices (the target's output layer, when shared, is packed
        by the target's runner and read from there)."""
        extra = [self.fc_w] + ([self.feature_fc_w] if self.feature_fc_w is not None else [])
        return [w for w in super().kernel_weights() if w is not self.target.output_w] + extra

    def _panel(self, w: torch.Tensor) -> torch.Tensor:
        if w is self.target.output_w:
            return self.target._panel(w)
        return super()._panel(w)

    def _gather_rows(self, local_w: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """Rows ``ids`` of the vocab-parallel output weight, on every TP rank."""
        with torch.no_grad():
            if self.target.tp_group is None:
                return local_w[ids].contiguous()
            per = local_w.shape[0]
            local = ids - self.target.vocab_start
            inside = (local >= 0) & (local < per)
            rows = local_w[local.clamp(0, per - 1)] * inside[:, None].to(local_w.dtype)
            dist.all_reduce(rows, group=self.target.tp_group)
            return rows.contiguous()

    def draft_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """float32 logits over the draft vocabulary (the full one without pruning)."""
        if self.d2t is None:
            return self.logits(hidden)
        flat = hidden.reshape(-1, hidden.shape[-1])
        out = self._lin(flat.contiguous(), self.output_w).float()
        return out.view(*hidden.shape[:-1], -1)

    def reduce_features(self, feats: torch.Tensor) -> torch.Tensor:
        """The target's features [N, F] as the drafter's h [N, H] (EAGLE-3: feature_fc
        over the three layers; otherwise they are h already)."""
        if self.feature_fc_w is None:
            return feats
        return self._lin(feats.contiguous(), self.feature_fc_w)

    def inputs(self, tokens: torch.Tensor, h: torch.Tensor, *, target_features: bool
               ) -> torch.Tensor:
        """fc(concat(embed(tokens), h)) for tokens [N] and h [N, F]; ``target_features``
        marks h as the target's (EAGLE-3 features are reduced first)."""
        if target_features:
            h = self.reduce_features(h)
        x = torch.cat([self.embed(tokens), h.to(self.dtype)], dim=-1)
        return self._lin(x.contiguous(), self.fc_w)


# -------------------------------------------------------------------------------------
# exact acceptance (pure functions, tested on their own)
# -------------------------------------------------------------------------------------

def _uniform(gen: Optional[torch.Generator], device) -> float:
    return float(torch.rand((), generator=gen, device=device))


def _sample(probs: torch.Tensor, gen: Optional[torch.Generator]) -> int:
    total = probs.sum()
    if not bool(total > 0):
        raise RuntimeError("speculative sampling hit an empty distribution")
    return int(torch.multinomial(probs / total, 1, generator=gen))


def accept_chain(p_logprobs: torch.Tensor, q_logprobs: Optional[torch.Tensor],
                 drafts: Sequence[int], gen: Optional[torch.Generator], *, greedy: bool,
                 kernels=None) -> tuple[int, int]:
    """Verify a chain of drafts. p_logprobs [k+1, V] (target, processed), q_logprobs
    [k, V] (drafter's sampling distribution, full vocabulary; unused when greedy).
    Returns (accepted draft count a, next token): the tokens emitted are drafts[:a]
    then the next token. ``kernels``: the fused CPU kernels (greedy argmax)."""
    k = len(drafts)
    if greedy:
        best = argmax_rows(p_logprobs, kernels).tolist()
        a = 0
        while a < k and drafts[a] == best[a]:
            a += 1
        return a, best[a]
    for i, x in enumerate(drafts):
        px = float(p_logprobs[i, x].exp())
        qx = float(q_logprobs[i, x].exp())
        if _uniform(gen, p_logprobs.device) * qx < px:
            continue
        residual = (p_logprobs[i].exp() - q_logprobs[i].exp()).clamp_min(0.0)
        if not bool(residual.sum() > 0):  # p == q up to rounding: p itself is the residual
            residual = p_logprobs[i].exp()
        return i, _sample(residual, gen)
    return k, _sample(p_logprobs[k].exp(), gen)


def accept_tree(p_logprobs: torch.Tensor, tokens: Sequence[int], children: Sequence[list[int]],
                gen: Optional[torch.Generator], *, greedy: bool) -> tuple[list[int], int]:
    """Verify a tree of deterministic drafts. Node 0 is the root (the last emitted
    token); p_logprobs [n+1, V] is the target's processed distribution at each node;
    ``tokens[i]`` is node i's token; ``children[i]`` lists node i's children in the
    order they are tried (best draft score first). Returns (accepted node path without
    the root, next token)."""
    node, path = 0, []
    while True:
        kids = children[node]
        if greedy:
            best = int(torch.argmax(p_logprobs[node]))
            nxt = next((c for c in kids if tokens[c] == best), None)
            if nxt is None:
                return path, best
            node = nxt
            path.append(node)
            continue
        probs = p_logprobs[node].exp()
        accepted = None
        for c in kids:
            x = tokens[c]
            mass = probs.sum()
            if _uniform(gen, probs.device) * float(mass) < float(probs[x]):
                accepted = c
                break
            probs = probs.clone()
            probs[x] = 0.0
        if accepted is None:
            return path, _sample(probs, gen)
        node = accepted
        path.append(node)


def _processed_rows(logits: torch.Tensor, rows: Sequence) -> torch.Tensor:
    """``processed_logprobs`` of logits [B, ..., V] with row i's sampling settings, one
    call per distinct setting; greedy rows get their raw float32 logits (argmax only)."""
    groups: dict[tuple, list[int]] = {}
    for i, r in enumerate(rows):
        groups.setdefault(None if r.params.greedy else r.params.processing_key(), []).append(i)
    if len(groups) == 1:  # one setting for the whole batch (the usual case): no gathers
        key = next(iter(groups))
        return logits.float() if key is None else processed_logprobs(logits, *key)
    out = torch.empty(logits.shape, dtype=torch.float32, device=logits.device)
    for key, idx in groups.items():
        index = torch.tensor(idx, device=logits.device)
        part = logits.index_select(0, index)
        out[index] = part.float() if key is None else processed_logprobs(part, *key)
    return out


# -------------------------------------------------------------------------------------
# per-call metrics
# -------------------------------------------------------------------------------------

@dataclass
class SpecStats:
    """Speculation in one ``generate`` call (``GenerateStats.spec``)."""

    steps: int = 0  # speculative steps (each drafts and verifies the whole batch)
    rows: int = 0  # sequence-steps (sum of batch sizes over speculative steps)
    emitted: int = 0  # tokens emitted by speculative steps (accepted drafts + bonus)
    draft_seconds: float = 0.0
    verify_seconds: float = 0.0
    catchup_tokens: int = 0  # drafter positions recomputed from target features
    catchup_seconds: float = 0.0  # of them, fed apart before a step (SpeculativeDecoder.catch_up)
    drafted: int = 0  # draft tokens sent to verification
    accept_hist: dict[int, int] = field(default_factory=dict)  # accepted drafts -> rows
    by_bucket: dict[str, list[int]] = field(default_factory=dict)  # label -> [rows, emitted]
    by_depth: dict[int, list[int]] = field(default_factory=dict)  # depth -> [rows, emitted]
    by_position: dict[str, list[int]] = field(default_factory=dict)  # position_accept.py
    arms: dict[str, int] = field(default_factory=dict)  # strategy name -> steps chosen
    # (including "0_0_0": plain steps the tuner chose below the threshold)
    declined: int = 0  # steps below the threshold that ran plain (break-even gate or 0_0_0)
    probes: int = 0  # steps taken against the gate's decision to re-measure the other side
    # bucket label -> [tuned steps, declined, probes, spec steps, spec tokens per sequence,
    # spec seconds, plain steps, plain seconds]: steps where the tuner was asked
    tuned: dict[str, list] = field(default_factory=dict)
    gate: dict = field(default_factory=dict)  # StrategyTuner.gate_stats() after the call

    @property
    def accept_len(self) -> float:
        """Mean tokens emitted per sequence per speculative step (accepted + 1)."""
        return self.emitted / self.rows if self.rows else 0.0

    def record(self, strategy: Strategy, bucket: str, accepted: Sequence[int],
               emitted: Sequence[int]) -> None:
        self.steps += 1
        self.rows += len(emitted)
        self.emitted += sum(emitted)
        self.arms[strategy.name] = self.arms.get(strategy.name, 0) + 1
        for a in accepted:
            self.accept_hist[a] = self.accept_hist.get(a, 0) + 1
        for key, table in ((bucket, self.by_bucket), (strategy.depth, self.by_depth)):
            row = table.setdefault(key, [0, 0])
            row[0] += len(emitted)
            row[1] += sum(emitted)

    def record_tuned(self, bucket: str, *, declined: bool, probe: bool, rows: int,
                     tokens: int, seconds: float) -> None:
        """One decode step at or below the threshold (the tuner chose it): plain when
        ``declined``, else speculative; ``tokens`` emitted by the batch of ``rows``."""
        t = self.tuned.setdefault(bucket, [0, 0, 0, 0, 0.0, 0.0, 0, 0.0])
        t[0] += 1
        t[1] += int(declined)
        t[2] += int(probe)
        if declined:
            t[6] += 1
            t[7] += seconds
        else:
            t[3] += 1
            t[4] += tokens / rows
            t[5] += seconds
        self.declined += int(declined)
        self.probes += int(probe)

    def summary(self) -> dict:
        """JSON-able: mean acceptance length overall, per bucket and per depth, the
        rate at which the j-th draft token was accepted, times and chosen arms; how
        often speculation was declined; per bucket (``buckets``) this call's tokens/s
        per sequence of speculative and of plain steps and, under ``tuner``, the
        break-even gate's estimates (best arm, its rate and speedup, plain's rate)."""
        def mean(row):
            return row[1] / row[0] if row[0] else 0.0
        tuned_steps = sum(t[0] for t in self.tuned.values())
        buckets = {}
        for label, t in self.tuned.items():
            spec_rate = t[4] / t[5] if t[5] > 0 else None
            plain_rate = t[6] / t[7] if t[7] > 0 else None
            buckets[label] = {
                "steps": t[0], "declined": t[1], "probes": t[2], "spec_steps": t[3],
                "spec_tok_s": spec_rate, "plain_tok_s": plain_rate,
                "speedup": spec_rate / plain_rate if spec_rate and plain_rate else None}
            if label in self.gate:
                buckets[label]["tuner"] = self.gate[label]
        n = self.rows
        reach = {}
        if n:
            top = max(self.accept_hist) if self.accept_hist else 0
            for j in range(1, top + 1):
                reach[j] = sum(c for a, c in self.accept_hist.items() if a >= j) / n
        return {
            "steps": self.steps, "rows": n, "emitted": self.emitted,
            "accept_len": self.accept_len,
            "accept_len_by_bucket": {k: mean(v) for k, v in self.by_bucket.items()},
            "accept_len_by_depth": {str(k): mean(v) for k, v in self.by_depth.items()},
            "accept_by_position": {k: list(v) for k, v in self.by_position.items()},
            "accept_rate_at_position": {str(k): v for k, v in reach.items()},
            "draft_seconds": self.draft_seconds, "verify_seconds": self.verify_seconds,
            "catchup_tokens": self.catchup_tokens, "catchup_seconds": self.catchup_seconds,
            "arms": dict(self.arms),
            "drafted_per_row": self.drafted / n if n else 0.0,
            "declined": self.declined,
            "declined_fraction": self.declined / tuned_steps if tuned_steps else 0.0,
            "probes": self.probes, "buckets": buckets,
        }


# -------------------------------------------------------------------------------------
# the speculative step
# -------------------------------------------------------------------------------------

@dataclass
class Emission:
    """What one speculative step produced for one row (before stop/length cuts)."""

    tokens: list[int]  # accepted drafts, then the next token
    nodes: list[int]  # verify-forward index (= cache slot offset from L) of the node
    # that produced each token; nodes[1:] are the accepted draft nodes


class SpeculativeDecoder:
    """Drafter state for a running batch (drafter KV cache, per-position target
    features) and the speculative step. The engine owns the rows and the target cache;
    this keeps, per cache row, how far the drafter's cache is valid."""

    def __init__(self, drafter: EagleDrafter, target: ModelRunner):
        self.drafter = drafter
        self.target = target
        self.draft = DraftRunner(drafter, target)
        self.draft.kernels = target.kernels
        self.feature_layers = tuple(drafter.config.feature_layers)
        self.feature_width = drafter.config.feature_width
        self.cache: Optional[KVCache] = None
        self.features: Optional[torch.Tensor] = None
        self.draft_len: list[int] = []
        self.min_draft_prob = 0.0  # chains stop below this cumulative draft probability

    # ---------------------------------------------------------------- state
    def begin(self, max_batch: int, capacity: int, slack: int) -> None:
        """Make room for ``max_batch`` rows of ``capacity`` positions (+ draft slack)."""
        extra = slack if self.draft.kernels is not None else capacity + slack
        need = capacity + extra
        c = self.cache
        if c is None or c.max_batch < max_batch or c.capacity < need:
            self.cache = None
            self.cache = KVCache(num_layers=1, max_batch=max_batch,
                                 kv_heads=self.draft.groups, capacity=need,
                                 head_dim=self.draft.head_dim, dtype=self.draft.dtype,
                                 device=self.draft.device)
        f = self.features
        if f is None or f.shape[0] < max_batch or f.shape[1] < capacity + slack:
            self.features = None
            self.features = torch.zeros(max_batch, capacity + slack, self.feature_width,
                                        dtype=self.target.dtype, device=self.target.device)
        self.draft_len = [0] * max_batch

    def release(self) -> None:
        self.cache = None
        self.features = None

    def capture_hook(self):
        """A ``capture`` callback collecting the EAGLE-3 feature layers (None without)."""
        if not self.feature_layers:
            return None, None
        got: dict[int, torch.Tensor] = {}
        wanted = set(self.feature_layers)

        def hook(i, x):
            if i in wanted:
                got[i] = x
        return hook, got

    def features_of(self, hidden: torch.Tensor, got: Optional[dict]) -> torch.Tensor:
        if not self.feature_layers:
            return hidden
        return torch.cat([got[i] for i in self.feature_layers], dim=-1)

    def store(self, row: int, first_pos: int, feats: torch.Tensor) -> None:
        """Target features [T, F] of positions first_pos.. of cache row ``row``."""
        self.features[row, first_pos: first_pos + feats.shape[0]] = feats.to(self.features.dtype)

    def new_row(self, row: int) -> None:
        self.draft_len[row] = 0

    def move_row(self, src: int, dst: int, length: int) -> None:
        self.features[dst, :length] = self.features[src, :length]
        n = self.draft_len[src]
        self.cache.move_row(src, dst, n)
        self.draft_len[dst] = n

    # ---------------------------------------------------------------- the step
    @torch.no_grad()
    def step(self, target_cache: KVCache, rows: Sequence, strategy: Strategy,
             stats: SpecStats) -> tuple[list[Emission], list, list, list]:
        """Draft and verify for running rows 0..len(rows)-1 (``rows[i]`` has
        ``.length``, ``.prompt``, ``.tokens``, ``.params``, ``.generator``).

        Returns per-row emissions and, per row, the verify forward's hidden states
        [nodes, H], float32 logits [nodes, V] and the processed log-probs the acceptance
        used (greedy rows: the logits); the caller emits from them and commits.
        """
        t0 = time.perf_counter()
        b = len(rows)
        dev = self.target.device
        tree = q_lp = drafts = None
        if strategy.is_chain and self._fused_chain(rows):  # catch-up + chain, one call
            drafts = self._draft_chain_fused(rows, strategy.depth, stats)
        else:
            root_h, root_logits = self._catch_up(rows, stats)
            if strategy.is_chain:
                drafts, q_lp = self._draft_chain(rows, strategy.depth, root_h, root_logits)
            else:
                vtokens, tree = self._draft_tree(rows, strategy, root_h, root_logits)
        t1 = time.perf_counter()
        stats.draft_seconds += t1 - t0

        hook, got = self.capture_hook()
        if tree is None:
            hidden, counts = self._verify_chains(target_cache, rows, drafts, hook)
        else:
            L = torch.tensor([r.length for r in rows], dtype=torch.long, device=dev)
            h3 = self.target.extend(target_cache, slice(0, b), vtokens, L,
                                    rope_positions=L[:, None] + tree["depth"],
                                    new_token_mask=tree["mask"], capture=hook)
            counts = [vtokens.shape[1]] * b
            hidden = h3.reshape(b * counts[0], -1)
            if got:
                got = {k: v.reshape(b * counts[0], -1) for k, v in got.items()}
        stats.drafted += sum(counts) - b
        logits = self.target.logits(hidden)
        feats = self.features_of(hidden, got)
        per_query = [r for r, c in zip(rows, counts) for _ in range(c)]
        plp = _processed_rows(logits, per_query)
        split = lambda t: list(torch.split(t, counts))  # noqa: E731
        hidden_r, logits_r, plp_r, feats_r = split(hidden), split(logits), split(plp), split(feats)

        noisy = self._verify_noise(rows, counts, tree)
        emissions: list[Emission] = []
        for i, r in enumerate(rows):
            sp = r.params
            coupled = noisy[i] is not None  # greedy verification of log p~ + noise
            scores = plp_r[i] + noisy[i] if coupled else plp_r[i]
            if tree is None:
                a, nxt = accept_chain(scores, None if q_lp is None else q_lp[i], drafts[i],
                                      r.generator, greedy=sp.greedy or coupled,
                                      kernels=self.target.kernels)
                toks = list(drafts[i][:a]) + [nxt]
                nodes = list(range(a + 1))
            else:
                path, nxt = accept_tree(scores, tree["tokens"][i], tree["children"][i],
                                        r.generator, greedy=sp.greedy or coupled)
                toks = [tree["tokens"][i][c] for c in path] + [nxt]
                nodes = [0] + path
            emissions.append(Emission(toks, nodes))
        emissions = self._agree(emissions, max(counts))
        # features of accepted nodes go to positions L.. (compaction happens in commit)
        for i, (r, e) in enumerate(zip(rows, emissions)):
            idx = torch.tensor(e.nodes, device=dev)
            self.store(i, r.length, feats_r[i].index_select(0, idx))
            self.draft_len[i] = r.length  # drafted positions >= L are stale now
        stats.verify_seconds += time.perf_counter() - t1
        return emissions, hidden_r, logits_r, plp_r

    @staticmethod
    def _coupled(r) -> bool:
        return getattr(r, "key", None) is not None and not r.params.greedy

    def _verify_noise(self, rows, counts: Sequence[int], tree) -> list:
        """Per row, the coupled noise of each verified node [nodes, V] (a node at
        depth d predicts response position len(tokens) + d), or None (not coupled)."""
        keys, pos, owner = [], [], []
        for i, r in enumerate(rows):
            if not self._coupled(r):
                continue
            t0 = len(r.tokens)
            depths = range(counts[i]) if tree is None else tree["depth"][i].tolist()
            for d in depths:
                keys.append(r.key)
                pos.append(t0 + int(d))
            owner.append(i)
        out: list = [None] * len(rows)
        if not keys:
            return out
        g = coupled_gumbel(keys, pos, self.target.arch.vocab_size, self.target.device)
        for i, part in zip(owner, torch.split(g, [counts[i] for i in owner])):
            out[i] = part
        return out

    def _draft_noise(self, rows, offset: int):
        """Coupled rows' noise at response position len(tokens) + offset over the draft
        vocabulary, [B, V_draft] (zeros for other rows), and their mask [B]; None when
        no row is coupled."""
        idx = [i for i, r in enumerate(rows) if self._coupled(r)]
        if not idx:
            return None
        dev = self.target.device
        g = coupled_gumbel([rows[i].key for i in idx],
                           [len(rows[i].tokens) + offset for i in idx],
                           self.target.arch.vocab_size, dev, token_ids=self.draft.d2t)
        full = torch.zeros(len(rows), g.shape[-1], dtype=torch.float32, device=dev)
        index = torch.tensor(idx, device=dev)
        full[index] = g
        mask = torch.zeros(len(rows), dtype=torch.bool, device=dev)
        mask[index] = True
        return full, mask

    def _tree_scores(self, rows, logits: torch.Tensor, offset: int) -> torch.Tensor:
        """Draft scores of the token after each tree node, from the drafter's logits
        [B, V_draft] or [B, K, V_draft]: its log-probabilities, and in coupled rows its
        processed log-probabilities (the request's temperature, top-k, top-p) plus the
        noise of response position len(tokens) + offset, shifted so each node's best is
        0 (``draft_tree.coupled_child_scores``)."""
        noise = self._draft_noise(rows, offset)
        if noise is None:
            return torch.log_softmax(logits, dim=-1)
        lp = None if bool(noise[1].all()) else torch.log_softmax(logits, dim=-1)
        return coupled_child_scores(_processed_rows(logits, rows), lp, noise)

    def _verify_chains(self, cache: KVCache, rows, drafts: list[list[int]], hook):
        """Target forward over each row's [x_L, drafts...] (chains of any lengths).
        Returns hidden states [sum of lengths, H] (row by row) and the lengths."""
        dev = self.target.device
        counts = [len(d) + 1 for d in drafts]
        toks = [t for r, d in zip(rows, drafts) for t in [r.tokens[-1]] + list(d)]
        t = self.target
        if t.kernels is not None and cache.layout == "bgsd":  # ragged, one kernel call
            row_of = torch.tensor([i for i, c in enumerate(counts) for _ in range(c)],
                                  dtype=torch.long, device=dev)
            pos = torch.tensor([r.length + j for r, c in zip(rows, counts) for j in range(c)],
                               dtype=torch.long, device=dev)
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
        h = t.extend(cache, slice(0, b), ids, L, capture=sub)
        keep = torch.cat([torch.arange(c, device=dev) + i * width for i, c in enumerate(counts)])
        if hook is not None:
            for i, x in captured.items():
                hook(i, x.reshape(b * width, -1).index_select(0, keep))
        return h.reshape(b * width, -1).index_select(0, keep), counts

    def compact(self, target_cache: KVCache, row: int, length: int, slots: Sequence[int]) -> None:
        """Move accepted tree nodes (slot offsets from ``length``) to consecutive slots
        length+1.. in the target cache (chains are already in place)."""
        want = list(range(1, len(slots) + 1))
        if list(slots) == want:
            return
        src = torch.tensor([length + s for s in slots], device=target_cache.k.device)
        dst = torch.tensor([length + s for s in want], device=target_cache.k.device)
        for c in (target_cache.k, target_cache.v):
            if target_cache.layout == "bgsd":
                c[:, row, :, dst] = c[:, row, :, src]
            else:
                c[:, row, dst] = c[:, row, src]

    # ---------------------------------------------------------------- pieces
    def _agree(self, emissions: list[Emission], n: int) -> list[Emission]:
        """Under TP, every rank takes TP rank 0's decisions (they agree already: same
        logits, same generators; this makes it certain)."""
        tp = self.target.tp_group
        if tp is None:
            return emissions
        from megatron.core import parallel_state as ps

        width = n + 1
        buf = torch.full((len(emissions), 2, width), -1, dtype=torch.long,
                         device=self.target.device)
        for i, e in enumerate(emissions):
            buf[i, 0, : len(e.tokens)] = torch.tensor(e.tokens)
            buf[i, 1, : len(e.nodes)] = torch.tensor(e.nodes)
        dist.broadcast(buf, ps.get_tensor_model_parallel_src_rank(), group=tp)
        out = []
        for i in range(len(emissions)):
            toks = [t for t in buf[i, 0].tolist() if t >= 0]
            nodes = [t for t in buf[i, 1].tolist() if t >= 0]
            out.append(Emission(toks, nodes))
        return out

    def _pending(self, rows: Sequence, stats: SpecStats, root: bool = True):
        """Every row's pending drafter inputs: the pairs (tok_{p+1}, h_p) for positions
        p = draft_len .. L-1 (the last one is the root; ``root=False`` stops before it).
        Returns the tokens [N], the target features [N, F], the row counts and their
        first positions."""
        counts, toks, feats, starts = [], [], [], []
        for i, r in enumerate(rows):
            lo, hi = self.draft_len[i], r.length - (0 if root else 1)  # positions lo..hi-1
            hi = max(hi, lo)
            seq_next = (r.prompt + r.tokens)[lo + 1: hi + 1]
            counts.append(hi - lo)
            toks.extend(seq_next)
            feats.append(self.features[i, lo:hi])
            starts.append(lo)
        stats.catchup_tokens += sum(counts) - (len(rows) if root else 0)
        tok = torch.tensor(toks, dtype=torch.long, device=self.target.device)
        return tok, torch.cat(feats, dim=0), counts, starts

    def pending(self, rows: Sequence) -> int:
        """Drafter positions the rows missed (decoded plainly, or since their prefill),
        not counting each row's root."""
        return sum(max(0, r.length - 1 - self.draft_len[i]) for i, r in enumerate(rows))

    @torch.no_grad()
    def catch_up(self, rows: Sequence, stats: SpecStats) -> int:
        """Feed every row's missed drafter inputs but the root (positions draft_len ..
        L-2) in one forward, so the next ``step`` feeds only the roots and costs what a
        steady speculative step costs; the engine times this switching cost apart (the
        tuner's break-even gate compares steady steps). Returns the positions fed."""
        if self.pending(rows) == 0:
            return 0
        dev = self.target.device
        t0 = time.perf_counter()
        tok, feats, counts, starts = self._pending(rows, stats, root=False)
        x = self.draft.inputs(tok, feats, target_features=True)
        if self.draft.kernels is not None:  # ragged: rows with nothing pending add none
            row_of, pos = self._ragged(counts, starts)
            self.draft.extend_chains(self.cache, row_of, pos, x)
        else:  # padded [B, T]: pad slots lie at or past each row's draft_len (invalid)
            xp = self._padded(x, counts)
            b, t_max = xp.shape[:2]
            start = torch.tensor(starts, dtype=torch.long, device=dev)
            self.draft.extend(self.cache, slice(0, b),
                              torch.zeros(b, t_max, dtype=torch.long, device=dev), start,
                              embeds=xp)
        for i, (s, c) in enumerate(zip(starts, counts)):
            self.draft_len[i] = s + c
        stats.catchup_seconds += time.perf_counter() - t0
        return sum(counts)

    def _catch_up(self, rows: Sequence, stats: SpecStats) -> tuple[torch.Tensor, torch.Tensor]:
        """Feed every row's pending (tok_{p+1}, h_p) pairs; returns the root outputs
        ĥ [B, H] and draft logits [B, V_draft]."""
        dev = self.target.device
        b = len(rows)
        tok, feats, counts, starts = self._pending(rows, stats)
        x = self.draft.inputs(tok, feats, target_features=True)
        t_max = max(counts)
        if self.draft.kernels is not None or t_max == 1:
            # ragged: one query row per pending position, chains per cache row
            row_of, pos = self._ragged(counts, starts)
            if self.draft.kernels is not None:
                out = self.draft.extend_chains(self.cache, row_of, pos, x)
            else:  # one pending position per row: a plain one-token step
                out = self.draft.extend(self.cache, slice(0, b),
                                        torch.zeros(b, 1, dtype=torch.long, device=dev),
                                        pos, embeds=x[:, None]).reshape(b, -1)
            last = torch.tensor(counts, device=dev).cumsum(0) - 1
        else:  # padded [B, T]: pad slots lie beyond each row's valid range (the cache
            # has a full capacity of slack for them, see ``begin``)
            xp = self._padded(x, counts)
            start = torch.tensor(starts, dtype=torch.long, device=dev)
            out = self.draft.extend(self.cache, slice(0, b),
                                    torch.zeros(b, t_max, dtype=torch.long, device=dev),
                                    start, embeds=xp).reshape(b * t_max, -1)
            last = torch.arange(b, device=dev) * t_max + torch.tensor(counts, device=dev) - 1
        root_h = out.index_select(0, last)
        return root_h, self.draft.draft_logits(root_h)

    @staticmethod
    def _padded(x: torch.Tensor, counts: Sequence[int]) -> torch.Tensor:
        """Rows' consecutive runs of ``x`` [sum(counts), H] as [B, max(counts), H],
        zero-padded at the end of each row."""
        xp = torch.zeros(len(counts), max(counts), x.shape[-1], dtype=x.dtype,
                         device=x.device)
        off = 0
        for i, c in enumerate(counts):
            xp[i, :c] = x[off: off + c]
            off += c
        return xp

    def _ragged(self, counts: Sequence[int], starts: Sequence[int]):
        """Cache row and position of every pending query (``extend_chains``' layout)."""
        dev = self.target.device
        row_of = torch.tensor([i for i, c in enumerate(counts) for _ in range(c)],
                              dtype=torch.long, device=dev)
        pos = torch.tensor([s + j for s, c in zip(starts, counts) for j in range(c)],
                           dtype=torch.long, device=dev)
        return row_of, pos

    def _to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids if self.draft.d2t is None else self.draft.d2t[draft_ids]

    def _q(self, logits: torch.Tensor, rows) -> torch.Tensor:
        """Drafter's sampling distributions over the FULL vocabulary, [B, V] log-probs
        (each row processed with its request's settings, like the target's p)."""
        lp = _processed_rows(logits, rows)
        if self.draft.d2t is None:
            return lp
        full = torch.full((*lp.shape[:-1], self.target.arch.vocab_size), float("-inf"),
                          device=lp.device)
        full[..., self.draft.d2t] = lp
        return full

    def _draft_chain(self, rows, depth: int, h: torch.Tensor, logits: torch.Tensor):
        """Up to ``depth`` draft tokens per row. Before drafting position j a row stops if
        (probability of its draft so far) x (largest probability at j) is below
        ``min_draft_prob`` (zero drafts is allowed), so verification spends rows only
        where acceptance is likely. The rule never looks at the token about to be drawn,
        so every kept draft still follows q and acceptance stays exact (a rule that
        dropped unlikely draws would bias them; the distribution test catches that). Returns per-row draft token lists and, for
        sampled rows, the drafter's sampling distributions [n_i, V] (None for greedy)."""
        dev = self.target.device
        b = len(rows)
        coupled = [self._coupled(r) for r in rows]
        sampled = [not r.params.greedy for r in rows]
        any_sampled = any(sampled)
        min_prob = self.min_draft_prob
        q_rows: list[list[torch.Tensor]] = [[] for _ in range(b)]
        drafts: list[list[int]] = [[] for _ in range(b)]
        alive, cum = [True] * b, [1.0] * b
        start = torch.tensor([r.length for r in rows], dtype=torch.long, device=dev)
        last = torch.tensor([r.tokens[-1] for r in rows], dtype=torch.long, device=dev)
        for j in range(depth):
            top_p, top_id = torch.softmax(logits.float(), dim=-1).max(dim=-1)
            full_tok = self._to_target(top_id)
            q_all = self._q(logits, rows) if any_sampled else None
            tok_l, conf_l = full_tok.tolist(), top_p.tolist()
            coupled_tok = {}
            idx = [i for i in range(b) if coupled[i] and alive[i]]
            if idx:  # the drafter's coupled tokens: the target's noise at position t0 + j
                g = coupled_gumbel([rows[i].key for i in idx],
                                   [len(rows[i].tokens) + j for i in idx],
                                   q_all.shape[-1], dev)
                index = torch.tensor(idx, device=dev)
                best_tok = argmax_rows(q_all.index_select(0, index) + g, self.draft.kernels)
                coupled_tok = dict(zip(idx, best_tok.tolist()))
            for i, r in enumerate(rows):
                if not alive[i]:
                    continue
                # decide to stop BEFORE drawing: a draw kept only when its own probability
                # is high would no longer follow q, and the acceptance ratio would be wrong
                best = float(q_all[i].max().exp()) if sampled[i] else conf_l[i]
                if min_prob > 0 and cum[i] * best < min_prob:
                    alive[i] = False
                    continue
                if coupled[i]:
                    tok = coupled_tok[i]
                    cum[i] *= float(q_all[i, tok].exp())
                elif sampled[i]:
                    tok = _sample(q_all[i].exp(), r.generator)
                    cum[i] *= float(q_all[i, tok].exp())
                else:
                    tok = tok_l[i]
                    cum[i] *= best
                drafts[i].append(tok)
                if sampled[i] and not coupled[i]:
                    q_rows[i].append(q_all[i])
            if j == depth - 1 or not any(alive):
                break
            # next drafter step for every row (stopped rows feed a placeholder; ignored)
            feed = torch.tensor([d[-1] if d else 0 for d in drafts], dtype=torch.long,
                                device=dev)
            feed = torch.where(torch.tensor([bool(d) for d in drafts], device=dev), feed, last)
            x = self.draft.inputs(feed, h, target_features=False)
            h = self.draft.extend(self.cache, slice(0, b), feed[:, None], start + j,
                                  embeds=x[:, None])[:, 0]
            logits = self.draft.draft_logits(h)
        q_lp = None
        if any(sampled[i] and not coupled[i] for i in range(b)):
            q_lp = [torch.stack(q) if q else None for q in q_rows]
        return drafts, q_lp

    def _fused_chain(self, rows) -> bool:
        """Whether ``cpu_kernels.draft_chain`` drafts this batch: greedy rows, no
        confidence stop, the fused kernels' own cases (TP 1, float32 CPU, no FP8)."""
        d = self.draft
        return (d.kernels is not None and d.tp_group is None and not d._te
                and self.min_draft_prob <= 0 and self.cache.layout == "bgsd"
                and len(rows) <= d.fused_max_rows and all(r.params.greedy for r in rows))

    def _draft_chain_fused(self, rows, depth: int, stats: SpecStats) -> list[list[int]]:
        """``_catch_up`` then ``_draft_chain`` for greedy rows in one kernel call
        (``cpu_kernels.draft_chain``): the same kernels in the same order, so the same
        drafts, without the ~0.2 ms of host work per drafter run."""
        d = self.draft
        tok, feats, counts, starts = self._pending(rows, stats)
        feats = d.reduce_features(feats)
        row_of, pos = self._ragged(counts, starts)
        last = torch.tensor(counts).cumsum(0) - 1
        start = torch.tensor([r.length for r in rows], dtype=torch.long)
        return d.kernels.draft_chain(
            tok, feats.to(d.dtype).contiguous(), row_of, pos, last, start, depth,
            d.output_w.shape[0] if d.d2t is not None else self.target.arch.vocab_size,
            d.d2t if d.d2t is not None else _NO_TENSOR, d.embed_w, d._panel(d.fc_w),
            *d._fused_stack(), d.final_norm, self.cache.k, self.cache.v,
            *d.rope_tables(int(start.max()) + depth), d.groups, d.heads_per_group, d.head_dim, d.scale, d.eps, d._panel(d.output_w),
            d.output_w.shape[0]).tolist()

    def _draft_tree(self, rows, s: Strategy, h: torch.Tensor, logits: torch.Tensor):
        """EAGLE-2 style dynamic tree, batched over rows (``draft_tree.TreePool``: each
        depth's top-k nodes expanded, the ``verify_tokens`` best nodes of the whole tree
        kept, closed under parents). Returns verify tokens [B, 1+n] and the tree (mask
        [B, 1+n, 1+n], depth [B, 1+n], per-row node tokens and children lists)."""
        dev = self.target.device
        b, k = len(rows), s.top_k
        L = torch.tensor([r.length for r in rows], dtype=torch.long, device=dev)
        pool = TreePool(self._tree_scores(rows, logits, 0), k)
        parent_h = h[:, None].expand(b, k, h.shape[-1])
        # drafter tree masks: frontier j (slots L + (j-1)K ..) sees its ancestors
        anc = torch.zeros(b, 0, 0, dtype=torch.bool, device=dev)  # ancestors among fed nodes
        fed_pool: list[torch.Tensor] = []  # pool index of each fed slot
        for depth in range(1, s.depth):
            w = anc.shape[1]
            new_anc = torch.zeros(b, w + k, w + k, dtype=torch.bool, device=dev)
            new_anc[:, :w, :w] = anc
            if w:  # a frontier node sees its parent's ancestors (parent was fed last round)
                par_slot = self._slot_of_parent(pool, fed_pool)
                new_anc[:, w:, :w] = torch.gather(anc, 1, par_slot[:, :, None].expand(b, k, w))
                new_anc[:, w:, :w].scatter_(2, par_slot[:, :, None], True)
            new_anc[:, w:, w:] = torch.eye(k, dtype=torch.bool, device=dev)
            anc = new_anc
            fed_pool.append(pool.front)
            full_tok = self._to_target(pool.front_tok)
            x = self.draft.inputs(full_tok.reshape(-1), parent_h.reshape(b * k, -1),
                                  target_features=False).view(b, k, -1)
            out = self.draft.extend(
                self.cache, slice(0, b), full_tok, L + w,
                rope_positions=(L + depth - 1)[:, None].expand(b, k), new_token_mask=anc[:, w:],
                embeds=x)  # [B, K, H]
            # children predict response position t0 + depth
            best = pool.grow(self._tree_scores(rows, self.draft.draft_logits(out), depth))
            parent_h = torch.gather(out, 1, (best // k)[:, :, None].expand(b, k, out.shape[-1]))
        tok, par, dep, score, chosen = pool.select(s.verify_tokens)
        return self._tree_inputs(rows, s, tok, par, dep, chosen, score)

    @staticmethod
    def _slot_of_parent(pool: TreePool, fed_pool: list[torch.Tensor]) -> torch.Tensor:
        """Fed-slot index (within the drafter's tree region) of each frontier node's
        parent [B, K]."""
        par = torch.cat(pool.par, 1).gather(1, pool.front)  # pool index of parents [B, K]
        fed = torch.cat(fed_pool, 1)  # [B, W] pool index per fed slot
        match = fed[:, None, :] == par[:, :, None]  # [B, K, W]
        return match.float().argmax(dim=-1)

    def _tree_inputs(self, rows, s: Strategy, tok, par, dep, chosen, score):
        dev = self.target.device
        b, n = chosen.shape
        par_l, dep_l, ch_l = par.tolist(), dep.tolist(), chosen.tolist()
        score_l = score.tolist()
        full_l = self._to_target(tok).tolist()
        vtok = torch.empty(b, n + 1, dtype=torch.long, device=dev)
        mask = torch.zeros(b, n + 1, n + 1, dtype=torch.bool, device=dev)
        depth = torch.zeros(b, n + 1, dtype=torch.long, device=dev)
        tokens, children = [], []
        for i, r in enumerate(rows):
            try:
                node_par, kids = row_layout(par_l[i], ch_l[i], score_l[i])
            except TreeNotClosed as e:
                sp = r.params
                mode = ("greedy" if sp.greedy else "coupled" if self._coupled(r)
                        else "standard")
                raise RuntimeError(
                    f"draft tree of batch row {i} is not closed under parents ({e}): "
                    f"strategy {s.name}, temperature={sp.temperature} top_k={sp.top_k} "
                    f"top_p={sp.top_p}, {mode} sampling. This is an engine bug; chain "
                    "strategies only (top_k 1 in rollout.speculative.strategy / arms) "
                    "avoid trees until it is fixed"
                ) from None
            node_tok = [r.tokens[-1]] + [full_l[i][p] for p in ch_l[i]]
            mask[i] = torch.tensor(ancestor_mask(node_par), dtype=torch.bool)
            depth[i] = torch.tensor([0] + [dep_l[i][p] for p in ch_l[i]])
            vtok[i] = torch.tensor(node_tok)
            tokens.append(node_tok)
            children.append(kids)
        return vtok, {"mask": mask, "depth": depth, "tokens": tokens, "children": children}
