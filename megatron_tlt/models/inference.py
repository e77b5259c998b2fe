"""Forward passes over a megatron-core GPTModel for training and checks: full-vocabulary
logits and per-token log-probs (generation is ``rollout.RolloutEngine``'s).

Everything here is tensor- and pipeline-parallel aware: logits are sharded over the
vocabulary across TP ranks (padding rows masked out), and with PP>1 the forward goes
through megatron-core's pipeline schedule (results live on the last stage).
"""

from __future__ import annotations

from typing import Optional

import torch

from ..runtime_env import cuda_placements_on_cpu
from .gpt import ModelArch


def _position_ids(input_ids: torch.Tensor) -> torch.Tensor:
    b, s = input_ids.shape
    return torch.arange(s, device=input_ids.device).unsqueeze(0).expand(b, s)


def forward_local_logits(model, input_ids: torch.Tensor) -> Optional[torch.Tensor]:
    """This TP rank's vocabulary slice of the logits, [batch, seq, padded_vocab / tp].

    With pipeline parallelism every stage must call this; only the last stage gets a
    tensor, the others get None.
    """
    from megatron.core import parallel_state as ps

    config = getattr(model, "config", None)
    tp = ps.get_tensor_model_parallel_world_size()
    s = input_ids.shape[1]
    if getattr(config, "sequence_parallel", False) and s % tp:
        # sequence parallelism splits the sequence over the TP group: pad on the right
        # (causal attention: no earlier position sees the padding) and cut it off again
        pad = input_ids.new_zeros(input_ids.shape[0], tp - s % tp)
        out = forward_local_logits(model, torch.cat([input_ids, pad], dim=1))
        return None if out is None else out[:, :s]
    position_ids = _position_ids(input_ids)
    if ps.get_pipeline_model_parallel_world_size() == 1:
        return model(input_ids, position_ids, attention_mask=None)

    from megatron.core.pipeline_parallel import get_forward_backward_func

    def forward_step(data_iterator, stage_model):
        ids, pos = next(data_iterator)
        output = stage_model(ids, pos, attention_mask=None)

        def keep_output(output_tensor, non_loss_data=False):
            return output_tensor

        return output, keep_output

    b, s = input_ids.shape
    with cuda_placements_on_cpu():
        outputs = get_forward_backward_func()(
            forward_step_func=forward_step,
            data_iterator=iter([(input_ids, position_ids)]),
            model=[model],
            num_microbatches=1,
            seq_length=s,
            micro_batch_size=b,
            forward_only=True,
            collect_non_loss_data=True,
        )
    return outputs[0] if ps.is_pipeline_last_stage() else None


def _mask_vocab_padding_(local_logits: torch.Tensor, arch: ModelArch) -> torch.Tensor:
    """In place: logits of padding vocabulary rows (ids >= vocab_size) become -inf."""
    from megatron.core import parallel_state as ps

    per_rank = local_logits.shape[-1]
    start = ps.get_tensor_model_parallel_rank() * per_rank
    if start + per_rank > arch.vocab_size:
        first_pad = max(arch.vocab_size - start, 0)
        local_logits[..., first_pad:].fill_(float("-inf"))
    return local_logits


def gather_logits(local_logits: torch.Tensor, arch: ModelArch) -> torch.Tensor:
    """Full-vocabulary logits [batch, seq, vocab_size] on every TP rank."""
    from megatron.core import tensor_parallel

    full = tensor_parallel.gather_from_tensor_model_parallel_region(local_logits)
    return full[..., : arch.vocab_size]


def token_logprobs(local_logits: torch.Tensor, targets: torch.Tensor,
                   arch: ModelArch, temperature: float = 1.0) -> torch.Tensor:
    """log p(targets) under softmax(logits / temperature), computed vocabulary-parallel.

    ``local_logits`` [b, s, v/tp] from ``forward_local_logits``; ``targets`` [b, s].
    Differentiable (megatron-core's vocab-parallel cross-entropy); no full-vocabulary
    tensor is ever materialised.
    """
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    # megatron-core's kernel works on [s, b, v], returns [s, b], and overwrites its
    # input: hand it a private fp32 copy (a transpose alone may alias when b == 1).
    seq_first = local_logits.transpose(0, 1)
    if seq_first.dtype == torch.float32:
        logits = seq_first.clone(memory_format=torch.contiguous_format)
    else:
        logits = seq_first.to(torch.float32, memory_format=torch.contiguous_format)
    if temperature != 1.0:
        logits.div_(temperature)
    _mask_vocab_padding_(logits, arch)
    nll = vocab_parallel_cross_entropy(logits, targets.transpose(0, 1).contiguous())
    return -nll.transpose(0, 1)
