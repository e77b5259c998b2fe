"""Rollout at pipeline parallelism > 1 on a gathered copy of the stages' weights.

``rollout.pipeline_mode=gathered`` (the default). At the start of every ``generate``
each pipeline rank receives the other stages' decoder layers (this TP rank's shards),
the embedding, the final norm and the output layer from their owners by broadcasts
over the pipeline group (``GatheredRunner.pack_weights``); its own stage's layers
are read in place, as at PP = 1. Every pipeline rank then holds the whole model and
decodes its own share of the call's prompts as a PP = 1 engine (a contiguous block of
the requests grouped by prompt, so a GRPO group shares one prefill,
``rollout.share_prefill``; without it every ``stages``-th request) (with its TP group as
at PP = 1), and the outputs are exchanged over the pipeline group back into prompt
order, so every stage returns the same outputs (``GatheredRunner.run_call``): small metadata
(lengths, finish reasons, statistics) as objects, token ids, log-probs and hidden
states as tensors on the group's device, broadcast stage by stage (a pickled multi-GB
object over NCCL would pass through the host twice).

Why not the stage-to-stage forward (``rollout.pipeline``, ``pipelined``): decoding is
bound by streaming the weights, so a stage that waits for its neighbour's activations
idles, and micro-batches in flight across stages would stream each stage's weights
once per micro-batch and leave the stages as unbalanced as their layers (the last one
also runs the LM head). Here both ranks stream the whole model at half the batch,
with no communication until the end of the call.

Costs: per rank, a copy of the other stages' layers and of the vocabulary matrix it
does not own (``copy_bytes``), and the broadcasts at every ``generate`` (its time is
``GenerateStats.pack_seconds``). The copies are re-sent from the owners' parameters
at every call, so rollouts always run the weights the trainer has just updated.

Exactness: a request's random stream (standard sampling) or noise key (coupled
sampling) is derived from its index in the call before the prompts are split, so the
tokens equal the PP = 1 engine's for greedy, coupled and standard sampling (up to
floating-point differences of a smaller batch's kernels).
"""

from __future__ import annotations

import math
from dataclasses import fields, replace
from typing import Callable, Sequence

import torch

from .. import collectives
from ..models.gpt import ModelArch
from .forward import ModelRunner, _Layer
from .outputs import GenerateStats, RolloutOutput


class GatheredRunner(ModelRunner):
    """The whole model on every pipeline rank: this stage's layers by reference, the
    other stages' as copies that ``pack_weights`` refreshes from their owners."""

    pp_size = 1  # decodes with its TP group only; the stages split the prompts
    shares_prompts = True
    # each stage decodes its share as a PP = 1 engine over its own cache, so its decode
    # and verification forwards are captured as at PP = 1 (its rows' buckets)
    supports_graphs = True

    def __init__(self, model, arch: ModelArch):
        from megatron.core import parallel_state as ps

        self.pp_group = ps.get_pipeline_model_parallel_group()
        self.stages = ps.get_pipeline_model_parallel_world_size()
        self.pp_rank = ps.get_pipeline_model_parallel_rank()
        super().__init__(model, arch)

    def refresh(self) -> None:
        """Own tensors by reference, receive buffers for the others' (collective over
        the pipeline group), then the first sync."""
        m = self.model
        is_first, is_last = self.pp_rank == 0, self.pp_rank == self.stages - 1
        self.set_layers(m.decoder.layers)
        own = self.layers
        # every stage's layers' tensor shapes (a layer's fields differ: QK norm, experts)
        shapes = collectives.all_gather_object(
            [{f.name: None if getattr(lw, f.name) is None else tuple(getattr(lw, f.name).shape)
              for f in fields(_Layer)} for lw in own], self.pp_group)
        vocab = self.arch.padded_vocab_size(self.tp_size) // self.tp_size
        self.vocab_start = self.tp_rank * vocab
        like = dict(dtype=own[0].qkv_w.dtype, device=own[0].qkv_w.device)

        def empty_layer(shape: dict) -> _Layer:
            return _Layer(**{k: None if s is None else torch.empty(s, **like)
                             for k, s in shape.items()})

        # (tensor, owner's stage: its rank in the pipeline group, whether this rank owns
        # it, its shape), in the same order on every rank
        self._copies: list[tuple[torch.Tensor, int, bool, tuple]] = []
        self.copy_bytes = 0
        layers = []
        for stage, stage_shapes in enumerate(shapes):
            mine = stage == self.pp_rank
            stage_layers = own if mine else [empty_layer(s) for s in stage_shapes]
            for lw in stage_layers:
                for f in fields(_Layer):
                    t = getattr(lw, f.name)
                    if t is not None:
                        self._track(t, stage, mine)
            layers.extend(stage_layers)
        self.layers = layers
        self.index_layers()
        own_output = None
        if is_last:
            own_output = (m.shared_embedding_or_output_weight()
                          if m.share_embeddings_and_output_weights else m.output_layer.weight)
        shape = (vocab, self.arch.hidden_size)
        last = self.stages - 1
        own_embed = m.embedding.word_embeddings.weight if is_first else None
        if m.share_embeddings_and_output_weights and self.stages == 2:
            # tied: the first stage's embedding and the last stage's output layer are
            # the same matrix (megatron-core keeps the two copies equal), so each
            # stage uses its own for both (with middle stages, all receive the first's)
            self.embed_w = self.output_w = own_embed if is_first else own_output
        else:
            self.embed_w = self._track(own_embed if is_first else torch.empty(shape, **like),
                                       0, is_first)
            self.output_w = (self.embed_w if m.share_embeddings_and_output_weights else
                             self._track(own_output if is_last else
                                         torch.empty(shape, **like), last, is_last))
        self.final_norm = self._track(m.decoder.final_layernorm.weight if is_last
                                      else torch.empty(own[0].ln1.shape, **like), last, is_last)
        self._panels, self._packed_stack = {}, None
        self.sync_weights()

    def _track(self, t: torch.Tensor, stage: int, mine: bool) -> torch.Tensor:
        self._copies.append((t, stage, mine, tuple(t.shape)))
        if not mine:
            self.copy_bytes += t.numel() * t.element_size()
        return t

    def sync_weights(self) -> None:
        """Every copy from its owner's current parameters (collective over the
        pipeline group)."""
        for t, src, mine, shape in self._copies:
            if not mine and tuple(t.shape) != shape:  # released: made again
                t.resize_(shape)
            collectives.broadcast(t.data, src, self.pp_group)

    def sync_vocab(self) -> None:
        """The embedding and output-layer copies alone from their owners (collective
        over the pipeline group; nothing with tied embeddings at PP = 2, where each
        end stage reads its own)."""
        for t, src, _, _ in self._copies:
            if t is self.embed_w or t is self.output_w:
                collectives.broadcast(t.data, src, self.pp_group)

    def release_memory(self) -> None:
        """Free the copies of the other stages' layers and final norm between rollouts
        (``rollout.memory``); the next ``sync_weights`` makes and fills them again. The
        vocabulary copies stay: the drafter group's canary reads them after the update
        (``sync_vocab``)."""
        with torch.no_grad():
            for t, _, mine, _ in self._copies:
                if not mine and t is not self.embed_w and t is not self.output_w:
                    t.set_()  # the same tensor object (the layers refer to it), no storage
        super().release_memory()  # this stage's stacked experts

    @property
    def held_copy_bytes(self) -> int:
        """Bytes the copies of other stages' tensors hold now."""
        return sum(t.numel() * t.element_size() for t, _, mine, _ in self._copies
                   if not mine)

    def refresh_copies(self) -> None:
        """This stage's stacked experts, then every copy from its owner (``pack_weights``
        calls this first)."""
        super().refresh_copies()
        self.sync_weights()

    def agree_all(self, tensor: torch.Tensor) -> torch.Tensor:
        """A call-level decision (before the prompts are split): TP rank 0's value,
        then the first stage's, on every rank of the pipeline group too."""
        self.agree(tensor)
        collectives.broadcast(tensor, 0, self.pp_group)
        return tensor

    # ------------------------------------------------------------------ a call's layout
    def call_rows(self, max_batch: int) -> int:
        """The replica's running batch, split like its prompts."""
        return max(1, math.ceil(max_batch / self.stages))

    def run_call(self, prompts: list, decode: Callable[[list[int], bool], list],
                 stats: GenerateStats, hidden_dtype: torch.dtype, grouped: bool = False
                 ) -> tuple[list[RolloutOutput], GenerateStats]:
        """Decode this pipeline rank's share of the prompts (``share_of``) as a PP = 1
        engine, then exchange everyone's outputs (``exchange_outputs``) in prompt order
        and merge the stages' stats."""
        mine = share_of(prompts, self.stages, self.pp_rank, grouped)
        local = decode(mine, True)
        outputs, parts = exchange_outputs(self.pp_group, self.pp_rank, prompts, mine, local,
                                          stats, (self.arch.hidden_size, hidden_dtype))
        return outputs, merge_stats(stats, parts)


def share_of(prompts: Sequence[Sequence[int]], stages: int, rank: int,
             grouped: bool) -> list[int]:
    """The requests pipeline rank ``rank`` decodes: every ``stages``-th from its rank,
    or (``grouped``, rollout.share_prefill) a contiguous block of the requests ordered
    by prompt (first appearance), so the requests of a prompt run on one stage and share
    its prefill there (a block boundary splits at most one group); the blocks' sizes
    differ by at most one, as the strided split's do."""
    n = len(prompts)
    if not grouped:
        return list(range(rank, n, stages))
    first: dict[tuple, int] = {}
    order = sorted(range(n), key=lambda i: first.setdefault(tuple(prompts[i]), i))
    base, extra = divmod(n, stages)
    start = rank * base + min(rank, extra)
    return order[start: start + base + (1 if rank < extra else 0)]


def exchange_outputs(group, rank: int, prompts: list[list[int]], mine: list[int],
                     local: list[RolloutOutput], stats: GenerateStats,
                     hidden: tuple[int, torch.dtype]) -> tuple[list, list]:
    """Every stage's outputs on every stage, in prompt order, and every stage's stats.

    The metadata (indices, lengths, finish reasons, which outputs carry hidden states,
    the stats) goes as a small object; the token ids and log-probs (one float64
    [2, tokens] tensor per stage, exact for both) and the hidden states (one [rows,
    hidden] tensor per stage, kept on the device by the local ``_run``) are broadcast
    stage by stage as tensors on the group's device, each stage's hidden states then
    copied to the host once. No tensor is pickled."""
    meta = dict(indices=mine, lengths=[len(o.token_ids) for o in local],
                reasons=[o.finish_reason for o in local],
                hidden=[o.hidden_states is not None for o in local], stats=stats,
                routes=[None if o.routes is None else tuple(o.routes.shape) for o in local])
    parts = collectives.all_gather_object(meta, group)
    dev = collectives.device_of(group)
    width, dtype = hidden
    outputs: list = [None] * len(prompts)
    for stage, part in enumerate(parts):
        lengths, has = part["lengths"], part["hidden"]
        total = sum(lengths)
        rows = sum(k for k, h in zip(lengths, has) if h)
        if stage == rank:
            values = torch.tensor([[t for o in local for t in o.token_ids],
                                   [x for o in local for x in o.logprobs]],
                                  dtype=torch.float64, device=dev) if total else None
            hs = torch.cat([o.hidden_states for o in local if o.hidden_states is not None]
                           ).to(dev) if rows else None
        else:
            values = torch.empty(2, total, dtype=torch.float64, device=dev) if total else None
            hs = torch.empty(rows, width, dtype=dtype, device=dev) if rows else None
        if values is not None:
            collectives.broadcast(values, stage, group)
            tokens, logprobs = values[0].long().tolist(), values[1].tolist()
        if hs is not None:
            collectives.broadcast(hs, stage, group)
            hs = hs.to("cpu")  # the stage's hidden states, one host copy
        routes = _exchange_routes(group, stage, rank, part["routes"], local, dev)
        off = row = 0
        for i, k, h, reason, rt in zip(part["indices"], lengths, has, part["reasons"], routes):
            hidden_i = None
            if h:
                hidden_i = hs[row: row + k].clone()  # its own storage (the buffer frees it)
                row += k
            outputs[i] = RolloutOutput(i, prompts[i], tokens[off: off + k],
                                       logprobs[off: off + k], reason, hidden_i, rt)
            off += k
    return outputs, [p["stats"] for p in parts]


def _exchange_routes(group, stage: int, rank: int, shapes: list, local: list,
                     dev: torch.device) -> list:
    """Stage ``stage``'s outputs' routes (``RolloutOutput.routes``; None where absent) on
    every stage: one tensor broadcast from it (int32 on the wire: gloo has no int16)."""
    total = sum(s[0] for s in shapes if s is not None)
    if not total:
        return [None] * len(shapes)
    width = next(s[1:] for s in shapes if s is not None)
    if stage == rank:
        buf = torch.cat([o.routes for o in local if o.routes is not None]).to(dev, torch.int32)
    else:
        buf = torch.empty(total, *width, dtype=torch.int32, device=dev)
    collectives.broadcast(buf, stage, group)
    buf, out, off = buf.to("cpu", torch.int16), [], 0
    for s in shapes:
        out.append(None if s is None else buf[off: off + s[0]].clone())
        off += 0 if s is None else s[0]
    return out


def merge_stats(base: GenerateStats, parts: list[GenerateStats]) -> GenerateStats:
    """The call's statistics over the pipeline ranks: counts and seconds summed (the
    ranks decode at the same time, so seconds are busy time, not wall time), per-step
    lists concatenated, speculation counts summed; this rank's KV cache size and the
    whole call's prompts and weight sync time. The paged cache's peaks: rows in flight
    summed (the replica's, the stages decoding at once), blocks and bytes the largest
    stage's (memory per GPU), so every stage holds the same stats."""
    out = replace(base, generated_tokens=0, prefill_tokens=0, prefill_shared_rows=0,
                  decode_steps=0, preemptions=0, rows_peak=0, kv_blocks_peak=0,
                  kv_bytes_peak=0,
                  prefill_seconds=0.0, decode_seconds=0.0, batch_sizes=[],
                  step_seconds=[], step_speculative=[], spec=None)
    for p in parts:
        for name in ("generated_tokens", "prefill_tokens", "prefill_shared_rows",
                     "decode_steps", "prefill_seconds", "decode_seconds", "preemptions",
                     "rows_peak"):
            setattr(out, name, getattr(out, name) + getattr(p, name))
        out.kv_blocks_peak = max(out.kv_blocks_peak, p.kv_blocks_peak)
        out.kv_bytes_peak = max(out.kv_bytes_peak, p.kv_bytes_peak)
        out.batch_sizes += p.batch_sizes
        out.step_seconds += p.step_seconds
        out.step_speculative += p.step_speculative
        if p.spec is not None:
            out.spec = p.spec if out.spec is None else out.spec.merged(p.spec)
    if out.spec is not None and base.spec is not None:
        out.spec.gate = base.spec.gate  # this rank's tuner
        out.spec.segments = base.spec.segments  # and kind timeline
        out.spec.token_steps = base.spec.token_steps
    return out
