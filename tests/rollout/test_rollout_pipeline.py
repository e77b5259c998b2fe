"""The rollout's per-stage memory in the dry-run plan (the PP=2 engine's outputs are
tests/rollout/test_rollout_tp.py's pp2 case)."""

from __future__ import annotations

from megatron_tlt.models.gpt import ModelArch
from megatron_tlt.rl.plan import GIB, rollout_memory_lines
from tiny_models import TINY_CONFIGS


def _arch(name: str, **overrides) -> ModelArch:
    spec = dict(TINY_CONFIGS[name], **overrides)
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
    # rollout.pipeline_mode=gathered: every rank the KV cache of all layers for half the
    # sequences, and copies of the other stage's layers and its vocabulary matrix
    # (a model large enough for the printed GiB to resolve the terms)
    arch = _arch("llama_untied", hidden_size=2048, intermediate_size=8192,
                 vocab_size=50000, num_attention_heads=16, num_key_value_heads=4)
    pip = rollout_memory_lines(arch, 1, 2, 4, seqs=8, capacity=20000, drafter=False)
    gat = rollout_memory_lines(arch, 1, 2, 4, seqs=8, capacity=20000, drafter=False,
                               mode="gathered")
    assert kv(pip[1]) > 0.1 * GIB
    assert abs(kv(gat[1]) - kv(pip[1])) < 0.01 * GIB and kv(gat[1]) == kv(gat[2])

    def copies(line):
        return float(line.split("other stages' weights")[1].split("GiB")[0]) * GIB

    h, v = arch.hidden_size, arch.padded_vocab_size(1)
    layer = sum(p.numel() for p in _layer_params(arch))
    assert abs(copies(gat[1]) - (2 * layer + v * h) * 4) < 0.01 * GIB
    assert copies(gat[1]) == copies(gat[2])


def _layer_params(arch):
    """One decoder layer's weights (QKV, projection, fc1 (gate and up), fc2, norms)."""
    import torch

    h, q = arch.hidden_size, arch.num_attention_heads * arch.kv_channels
    kvw = arch.num_query_groups * arch.kv_channels
    return [torch.empty(q + 2 * kvw, h), torch.empty(h, q),
            torch.empty(2 * arch.ffn_hidden_size, h), torch.empty(h, arch.ffn_hidden_size),
            torch.empty(h), torch.empty(h)]


def test_gathered_mode_merges_the_pipeline_ranks_statistics():
    """rollout.pipeline_mode=gathered: each pipeline rank decodes a share of the call;
    its statistics are the shares' counts summed (speculation's included), per-step lists
    concatenated, this rank's tuner gate and KV cache; the paged cache's preemptions and
    rows in flight summed, its peak blocks and bytes the largest share's."""
    from megatron_tlt.rollout.engine import GenerateStats
    from megatron_tlt.rollout.gathered import merge_stats
    from megatron_tlt.rollout.speculative.stats import SpecStats
    from megatron_tlt.spec_strategy import Strategy

    def share(steps, accepted, arm, gate, paged=(0, 0, 0, 0)):
        spec = SpecStats(gate=gate)
        for _ in range(steps):
            spec.record(Strategy.parse(arm), "1-4", accepted, [a + 1 for a in accepted])
        spec.record_tuned("1-4", declined=False, probe=True, rows=len(accepted),
                          tokens=sum(accepted) + len(accepted), seconds=0.5)
        spec.by_position["0-63"] = [len(accepted), sum(accepted)]
        spec.record_kind("self", "1-4", Strategy.parse(arm), probe=True, rows=len(accepted),
                         emitted=sum(accepted) + len(accepted), seconds=0.5)
        spec.mark(0.0, 0.5, arm)
        pre, rows, blocks, nbytes = paged
        return GenerateStats(prompts=5, generated_tokens=10 * steps, decode_steps=steps,
                             decode_seconds=0.1 * steps, batch_sizes=[2] * steps,
                             kv_cache_bytes=100, spec=spec, preemptions=pre, rows_peak=rows,
                             kv_blocks=9, kv_blocks_peak=blocks, kv_bytes_peak=nbytes)

    mine = share(2, [1, 3], "3_1_3", {"best": "mine"}, (1, 4, 7, 70))
    other = share(3, [0], "4_1_4", {}, (2, 3, 8, 80))
    out = merge_stats(mine, [mine, other])
    assert (out.prompts, out.generated_tokens, out.decode_steps) == (5, 50, 5)
    assert abs(out.decode_seconds - 0.5) < 1e-9 and out.batch_sizes == [2] * 5
    assert out.kv_cache_bytes == 100
    assert (out.preemptions, out.rows_peak, out.kv_blocks) == (3, 7, 9)
    assert (out.kv_blocks_peak, out.kv_bytes_peak) == (8, 80)
    s = out.spec
    assert (s.steps, s.rows, s.emitted) == (5, 7, 15)
    assert s.arms == {"3_1_3": 2, "4_1_4": 3}
    assert s.accept_hist == {1: 2, 3: 2, 0: 3}
    assert (s.by_bucket["1-4"].rows, s.by_bucket["1-4"].emitted) == (7, 15)
    assert s.tuned["1-4"].steps == 2 and s.tuned["1-4"].probes == 2
    assert s.by_position["0-63"] == [3, 4]
    assert s.gate == {"best": "mine"}
    k = s.kinds["self"]  # per drafter kind too; the timeline is this rank's
    assert (k.chosen, k.steps, k.rows, k.emitted) == (2, 2, 3, 7)
    assert k.bucket_arms == {"1-4": {"3_1_3": 1, "4_1_4": 1}}
    assert s.segments == [[0.0, 0.5, "3_1_3"]]
    assert mine.spec.steps == 2  # the shares are left as they were
