"""Prompts and sampling settings shared by the TP=2 rollout test and its worker."""

from __future__ import annotations

import torch

from megatron_tlt.rollout import SamplingParams
from tiny_models import VOCAB

CASES = {
    "greedy": SamplingParams(temperature=0.0, max_new_tokens=10, return_hidden_states=True),
    "sampled": SamplingParams(temperature=0.9, top_k=50, top_p=0.9, max_new_tokens=10,
                              seed=5),
}


def case_prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(7)
    return [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in (4, 13, 1, 8, 6)]


# speculative decoding at TP=2 vs TP=1 (a drafter checkpoint made for SPEC_MODEL)
SPEC_MODEL = "llama_tied"
SPEC_CASES = {
    "spec_greedy_chain": ("4_1_4", SamplingParams(temperature=0.0, max_new_tokens=12)),
    "spec_greedy_tree": ("3_3_6", SamplingParams(temperature=0.0, max_new_tokens=12)),
    "spec_sampled_chain": ("3_1_3", SamplingParams(temperature=0.9, top_k=50, max_new_tokens=12,
                                                   seed=3)),
    "spec_sampled_tree": ("3_2_5", SamplingParams(temperature=1.0, top_p=0.9,
                                                  max_new_tokens=12, seed=4)),
    "spec_greedy_tuned": ("tuned", SamplingParams(temperature=0.0, max_new_tokens=12)),
}


# coupled sampling (rollout.sampling_mode=coupled) on SPEC_MODEL: plain, chain and tree
# speculation must give the same tokens, at TP=2 as at TP=1
COUPLED_PARAMS = SamplingParams(temperature=1.0, top_p=0.95, max_new_tokens=12, seed=9)
COUPLED_CASES = {"coupled_plain": None, "coupled_chain": "3_1_3", "coupled_tree": "3_2_5"}


def spec_config(strategy: str, sampling_mode: str = "standard", mode: str = "gathered"):
    """``strategy`` fixed ("tuned": the default tuner and break-even gate)."""
    from megatron_tlt.config import RolloutConfig, SpeculativeConfig

    sc = (SpeculativeConfig(threshold=64) if strategy == "tuned" else
          SpeculativeConfig(policy="fixed", strategy=strategy or "3_1_3", threshold=64))
    return RolloutConfig(sampling_mode=sampling_mode, speculative=sc, pipeline_mode=mode)


# one prefill per prompt (rollout.share_prefill) at TP=2 and PP=2: GROUP prompts x
# GROUP_SIZE requests each, run with and without sharing, on SPEC_MODEL; a case is
# (strategy or None for plain decoding, drafter kind, sampling mode, params)
GROUP_SIZE = 4
GROUP_CASES = {
    "group_greedy": (None, None, "standard",
                     SamplingParams(temperature=0.0, max_new_tokens=8,
                                    return_hidden_states=True)),
    "group_sampled": (None, None, "standard",
                      SamplingParams(temperature=1.0, top_p=0.9, max_new_tokens=8, seed=2)),
    "group_coupled": (None, None, "coupled",
                      SamplingParams(temperature=1.0, top_p=0.95, max_new_tokens=8, seed=9)),
    "group_eagle_chain": ("3_1_3", "eagle", "standard",
                          SamplingParams(temperature=1.0, max_new_tokens=8, seed=3)),
    "group_eagle_tree": ("3_2_5", "eagle", "standard",
                         SamplingParams(temperature=0.0, max_new_tokens=8)),
    "group_self_chain": ("3_1_3", "self", "standard",  # (the self-drafter: PP = 1 only)
                         SamplingParams(temperature=1.0, max_new_tokens=8, seed=4)),
}


def group_prompts() -> list[list[int]]:
    """4 prompts of one length (prefill tokens count no padding), each GROUP_SIZE times
    in a row as the RL rollout asks for them."""
    g = torch.Generator().manual_seed(11)
    return [p for p in (torch.randint(0, VOCAB, (6,), generator=g).tolist() for _ in range(4))
            for _ in range(GROUP_SIZE)]


def group_request_seeds() -> list[int]:
    return [100 + 3 * i for i in range(len(group_prompts()))]


def case_engine(model, arch, cfg, kind, strategy, drafter):
    """The engine of a case: ``cfg`` with the fixed ``strategy`` (None: plain decoding),
    drafting with ``drafter`` (kind "eagle"), the policy's int8 copy ("self") or none."""
    from megatron_tlt.config import SpeculativeConfig
    from megatron_tlt.rollout import RolloutEngine
    from megatron_tlt.rollout.speculative.self_drafter import SelfDrafter

    if strategy is not None:
        cfg.speculative = SpeculativeConfig(policy="fixed", strategy=strategy, threshold=64)
    d = None if kind is None else drafter if kind == "eagle" else SelfDrafter()
    return RolloutEngine(model, None, cfg, arch=arch, eos_token_ids=[], drafter=d)
