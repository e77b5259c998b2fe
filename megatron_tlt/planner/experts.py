"""The planner's view of a mixture-of-experts model: which experts a forward touches
(``distinct_experts``) and the ``ModelShape`` fields of an MoE architecture."""

from __future__ import annotations


def distinct_experts(experts: int, topk: int, tokens: float) -> float:
    """Expected distinct experts of one MoE layer that ``tokens`` tokens choose, each
    ``topk`` distinct of ``experts`` with every expert equally likely and the tokens
    independent: E (1 - (1 - k/E)^n). k for one token, all E as n grows; a real router's
    uneven load touches fewer (this is the upper end)."""
    if experts <= 0 or tokens <= 0:
        return 0.0
    return experts * (1.0 - (1.0 - topk / experts) ** tokens)


def moe_fields(arch) -> dict:
    """``ModelShape``'s expert fields for ``arch`` (none for a dense model): experts per
    MoE layer, top-k, one expert's parameters summed over the MoE layers, and the
    one-layer drafter's (dense) decoder layer."""
    if not arch.is_moe:
        return {}
    from ..models.drafter import drafter_layer_arch
    from ..models.sizes import expert_params, layer_params

    return dict(experts=arch.num_experts, topk=arch.moe_topk,
                expert_params=expert_params(arch) * len(arch.moe_layers),
                draft_layer=layer_params(drafter_layer_arch(arch), 1))
