"""Rollout at pipeline parallelism > 1: one stage's share of the incremental forward
(``rollout.pipeline_mode=pipelined``; the default, ``gathered``, is ``rollout.gathered``).

Every pipeline stage runs a ``PipelinedRunner`` over its own decoder layers (the
trained model's parameters, read in place as at PP = 1) and keeps the KV cache of
those layers only. A forward (a prefill chunk, a decode step, a speculative
verification: ``extend`` / ``extend_chains``) goes stage to stage:

- the first stage embeds the tokens; every other stage receives the previous stage's
  activations [rows, hidden] by a point-to-point ``recv`` (gloo on CPU, NCCL on GPU);
- each stage runs its layers against its cache rows (TP inside the stage as at PP = 1)
  and ``send``s its output to the next stage;
- the last stage applies the final norm and broadcasts the final hidden states to the
  stages; ``logits`` is computed there and broadcast likewise (as megatron-core's
  inference engine broadcasts its logits from the last stage).

So every stage holds the same final hidden states and logits and runs the engine's
control logic (admission, sampling with the same random streams or coupled noise,
retirement, the tuner's choices on the last stage's times) on identical values:
``RolloutEngine.generate`` runs unchanged on top, and its outputs (tokens, log-probs,
hidden states for the drafter buffer) are the same on every stage and equal the PP = 1
engine's. A drafter runs on every stage alike; it reads the embedding and the output
layer, which live on the first and last stage, so ``share_vocab_weights`` gives the
other stages copies (refreshed from their owners at every ``generate``).
"""

from __future__ import annotations

from typing import Callable, Optional

import torch

from .. import collectives
from ..models.gpt import ModelArch
from .forward import ModelRunner


class PipelinedRunner(ModelRunner):
    """``ModelRunner`` over this pipeline stage's layers; the forward passes activations
    stage to stage and returns the last stage's final hidden states on every stage."""

    whole_stack = False  # the fused kernel must not end a stage with the final norm
    decides_alone = False  # every decision is agreed over the stages (``agree``)
    supports_graphs = False  # a forward passes activations stage to stage

    def __init__(self, model, arch: ModelArch):
        from megatron.core import parallel_state as ps

        self.pp_group = ps.get_pipeline_model_parallel_group()
        self.pp_size = ps.get_pipeline_model_parallel_world_size()
        self.pp_rank = ps.get_pipeline_model_parallel_rank()
        self.is_first = self.pp_rank == 0
        self.is_last = self.pp_rank == self.pp_size - 1
        self.prev_rank = ps.get_pipeline_model_parallel_prev_rank()  # global ranks
        self.next_rank = ps.get_pipeline_model_parallel_next_rank()
        self.last_stage = self.pp_size - 1  # its rank in the pipeline group
        self._shared: Optional[tuple[torch.Tensor, torch.Tensor]] = None
        super().__init__(model, arch)
        self.local_vocab = arch.padded_vocab_size(self.tp_size) // self.tp_size
        self.vocab_start = self.tp_rank * self.local_vocab

    # ------------------------------------------------------------------ weights
    def refresh(self) -> None:
        m = self.model
        self._own_embed = m.embedding.word_embeddings.weight if self.is_first else None
        self._own_output = None
        if self.is_last:
            self._own_output = (m.shared_embedding_or_output_weight()
                                if m.share_embeddings_and_output_weights
                                else m.output_layer.weight)
        self.set_layers(m.decoder.layers)
        self.final_norm = m.decoder.final_layernorm.weight if self.is_last else None
        if self._shared is not None:  # parameters replaced: re-point the copies
            self._shared = None
            self.share_vocab_weights()
        else:
            self.embed_w, self.output_w = self._own_embed, self._own_output

    def index_layers(self) -> None:
        """As the whole model's, but no routes are recorded: a stage holds its own
        layers' only (routing replay takes its routes from rollout.pipeline_mode=
        gathered, where every rank decodes through all layers)."""
        super().index_layers()
        self.route_shape = None

    def prepare_drafter(self, drafter) -> None:
        """A drafter runs on every stage: refuse EAGLE-3 feature layers (they would be
        captured on several stages), share the embedding and output layer."""
        if drafter.config.feature_layers:
            raise ValueError("EAGLE-3 feature layers span pipeline stages and are not "
                             "captured at pipeline parallelism > 1; use an EAGLE drafter "
                             "without feature_layers or parallel."
                             "pipeline_model_parallel_size=1")
        self.share_vocab_weights()

    def share_vocab_weights(self) -> None:
        """Give every stage the embedding and the output layer (this TP rank's
        vocabulary slice): the stages that own them keep theirs, the others get copies,
        re-sent from the owners by every ``pack_weights``. A drafter, run on every
        stage, needs both. Collective over the pipeline group."""
        if self._shared is None:
            shape = (self.local_vocab, self.arch.hidden_size)
            embed = self._own_embed if self.is_first else torch.empty(
                shape, dtype=self.dtype, device=self.device)
            output = self._own_output if self.is_last else torch.empty(
                shape, dtype=self.dtype, device=self.device)
            self._shared = (embed, output)
            self.embed_w, self.output_w = embed, output
        self._sync_shared()

    def _sync_shared(self) -> None:
        embed, output = self._shared
        collectives.broadcast(embed.data, 0, self.pp_group)
        collectives.broadcast(output.data, self.last_stage, self.pp_group)

    def sync_vocab(self) -> None:
        if self._shared is not None:
            self._sync_shared()

    def kernel_weights(self) -> list[torch.Tensor]:
        return [w for w in super().kernel_weights() if w is not None]

    def pack_weights(self) -> None:
        if self._shared is not None:
            self._sync_shared()
        super().pack_weights()

    # ------------------------------------------------------------------ stage boundaries
    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        if self.embed_w is None:  # a later stage: its input comes from the previous one
            return torch.empty(*tokens.shape, self.arch.hidden_size, dtype=self.dtype,
                               device=self.device)
        return super().embed(tokens)

    def stage_input(self, make: Callable[[], torch.Tensor], shape: tuple) -> torch.Tensor:
        if self.is_first:
            return make()
        x = torch.empty(*shape, self.arch.hidden_size, dtype=self.dtype, device=self.device)
        return collectives.recv(x, self.prev_rank, self.pp_group)

    def stage_output(self, x: torch.Tensor) -> torch.Tensor:
        if self.is_last:
            hidden = self.final_hidden(x).contiguous()
        else:
            collectives.send(x, self.next_rank, self.pp_group)
            hidden = torch.empty_like(x)
        collectives.broadcast(hidden, self.last_stage, self.pp_group)
        return hidden

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.is_last:
            out = super().logits(hidden).contiguous()
        else:
            out = torch.empty(*hidden.shape[:-1], self.arch.vocab_size,
                              dtype=torch.float32, device=self.device)
        collectives.broadcast(out, self.last_stage, self.pp_group)
        return out

    def agree(self, tensor: torch.Tensor) -> torch.Tensor:
        """TP rank 0's value within each stage, then the last stage's on every stage
        (the tuner's decisions follow its step times, and all stages must take the
        same ones)."""
        super().agree(tensor)
        collectives.broadcast(tensor, self.last_stage, self.pp_group)
        return tensor

