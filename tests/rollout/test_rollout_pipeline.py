"""The rollout's per-stage memory in the dry-run plan (the PP=2 engine's outputs are
tests/rollout/test_rollout_tp.py's pp2 case)."""

from __future__ import annotations

from megatron_tlt.models.gpt import ModelArch
from megatron_tlt.rl.plan import GIB, rollout_memory_lines
from tiny_models import TINY_CONFIGS


def _arch(name: str) -> ModelArch:
    spec = dict(TINY_CONFIGS[name])
    family = spec.pop("family")
    return ModelArch.from_hf_config({**spec, "model_type": family})


def test_rollout_memory_per_stage_splits_the_kv_cache_and_counts_vocab_copies():
    arch = _arch("llama_untied")
    one = rollout_memory_lines(arch, 1, 1, 4, seqs=8, capacity=100, drafter=False)
    two = rollout_memory_lines(arch, 1, 2, 4, seqs=8, capacity=100, drafter=True)
    assert len(one) == 2 and len(two) == 3  # a header and a line per stage

    def kv(line):
        return float(line.split("KV cache")[1].split("GiB")[0]) * GIB

    full = 2 * arch.num_layers * 8 * arch.num_query_groups * 100 * arch.kv_channels * 4
    assert abs(kv(one[1]) - full) < 0.01 * GIB
    assert abs(kv(two[1]) - full / 2) < 0.01 * GIB and kv(two[1]) == kv(two[2])
    # with a drafter each stage gets a copy of the vocabulary matrix it does not own
    assert "vocabulary copies" in two[1] and "vocabulary copies" in two[2]
    assert "vocabulary copies" not in one[1]
    assert "layers 0-1" in two[1] and "layers 2-3" in two[2]
