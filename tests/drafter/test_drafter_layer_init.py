"""A drafter whose decoder layer starts as a copy of one of the target's layers."""

from __future__ import annotations

import pytest
import torch

from megatron_tlt.drafter_training.layer_init import copy_target_layer
from megatron_tlt.models.drafter import DrafterConfig, EagleDrafter


def test_copy_target_layer_makes_the_drafter_layer_compute_the_target_layer(tiny_llama):
    model, arch = tiny_llama
    d = EagleDrafter(DrafterConfig.for_target(arch), arch)
    d.reset_parameters(1)
    src = model.decoder.layers[-1]
    x = torch.randn(5, 1, arch.hidden_size, generator=torch.Generator().manual_seed(0))
    rope = model.rotary_pos_emb(5)
    with torch.no_grad():
        want, _ = src(hidden_states=x, attention_mask=None, rotary_pos_emb=rope)
        before, _ = d.layer(hidden_states=x, attention_mask=None, rotary_pos_emb=rope)
        names = copy_target_layer(d, model, -1)
        after, _ = d.layer(hidden_states=x, attention_mask=None, rotary_pos_emb=rope)
    assert names and (before - want).abs().max() > 1e-3
    assert torch.allclose(after, want, atol=1e-5)
    fc = d.fc.weight.clone()
    copy_target_layer(d, model, 0)  # only the decoder layer changes
    assert torch.equal(d.fc.weight, fc)
    with pytest.raises(ValueError, match="does not exist.*-1 for the last"):
        copy_target_layer(d, model, len(model.decoder.layers))
