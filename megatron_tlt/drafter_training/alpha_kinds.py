"""The exact α of several drafter kinds side by side: the one-layer (EAGLE) drafter
and the self-drafter (the policy's weight-only int8 copy), and optionally other copies
(another checkpoint's weights quantized: how stale a copy that is not refreshed would
be), on the same held-out samples with the same sampling settings.

Per kind: α by draft depth over the same positions (``alpha.measure_alpha`` /
``alpha.measure_self_alpha``: depth d covers every response position but the first d-1),
E[max p̃], the draft vocabulary's mass, the chain acceptance length predicted from α
and, where measured, the engine's (``alpha.measured_accept_len``). ``compare`` returns
it as JSON-able data, ``table_lines`` as text; ``tools/alpha_kinds.py`` is the command
line.
"""

from __future__ import annotations

from typing import Optional, Sequence

from .alpha import AlphaReport, measure_alpha, measure_self_alpha, measured_accept_len

__all__ = ["alpha_by_kind", "compare", "table_lines"]


def alpha_by_kind(runner, drafters: dict, samples: Sequence, *, temperature: float,
                  top_k: int = 0, top_p: float = 1.0, depth: int = 4) -> dict[str, AlphaReport]:
    """Name -> ``AlphaReport`` of each drafter of ``drafters`` (a ``Drafter`` or a
    one-layer drafter module) on ``samples`` (``alpha.held_out_samples``; with a
    one-layer drafter reading EAGLE-3 feature layers, sampled with those layers'
    features): a feature-fed drafter through its model, a token-fed one through the
    runner that drafts (``Drafter.token_runner``, e.g. the self-drafter's copy)."""
    from ..rollout.speculative.drafters import as_drafter

    out = {}
    for name, d in drafters.items():
        d = as_drafter(d)
        kw = dict(temperature=temperature, top_k=top_k, top_p=top_p, depth=depth)
        copy = d.token_runner(runner)  # a token-fed kind's copy drafts through it
        if copy is not None:
            rep = measure_self_alpha(copy, runner, samples, **kw)
        elif d.model is not None:  # a trained drafter's model, fed the target's features
            rep = measure_alpha(d.model, runner, samples, **kw)
        else:
            raise ValueError(f"{d.label} ({name}) has no model whose alpha can be "
                             "measured on held-out responses")
        rep.extra["kind"] = d.name
        out[name] = rep
    return out


def compare(engine, drafters: dict, samples: Sequence, *, temperature: float,
            top_k: int = 0, top_p: float = 1.0, depth: int = 4,
            measure_prompts: Optional[Sequence[Sequence[int]]] = None,
            measure_sampling=None) -> dict:
    """Each drafter's α by depth on the same ``samples`` (``alpha_by_kind``) and, with
    ``measure_prompts`` and ``measure_sampling``, the engine's measured acceptance
    length of a depth-``depth`` chain on them. JSON-able: ``kinds`` (name -> the
    report's dict), ``alpha_by_depth`` (per depth, name -> α), the settings and the
    tokens measured per depth (the same for every kind)."""
    reps = alpha_by_kind(engine.runner, drafters, samples, temperature=temperature,
                         top_k=top_k, top_p=top_p, depth=depth)
    if measure_prompts:
        for name, d in drafters.items():
            reps[name].measured_accept_len = measured_accept_len(
                engine, d, measure_prompts, measure_sampling, depth)["accept_len"]
    first = next(iter(reps.values()))
    return {
        "temperature": temperature, "top_k": top_k, "top_p": top_p, "depth": depth,
        "samples": len(samples), "tokens_by_depth": first.extra["tokens_by_depth"],
        "alpha_by_depth": [{"depth": j + 1, **{n: r.alpha[j] for n, r in reps.items()}}
                           for j in range(depth)],
        "kinds": {n: r.to_dict() for n, r in reps.items()},
    }


def table_lines(result: dict) -> list[str]:
    """``compare``'s result as a text table: one column per drafter, one row per
    depth, then E[max p̃], the draft-vocabulary mass, the predicted and the measured
    acceptance length of the depth-k chain."""
    kinds = result["kinds"]
    names = list(kinds)
    w = max(12, *(len(n) + 2 for n in names))
    head = f"{'':<24}" + "".join(f"{n:>{w}}" for n in names)
    lines = [f"exact alpha at T={result['temperature']:g} top_k={result['top_k']} "
             f"top_p={result['top_p']:g} on {result['samples']} held-out responses "
             f"({result['tokens_by_depth'][0]} tokens)", head]
    for row in result["alpha_by_depth"]:
        lines.append(f"{'alpha depth ' + str(row['depth']):<24}"
                     + "".join(f"{row[n]:>{w}.3f}" for n in names))

    def row(label, key):
        vals = [kinds[n].get(key) for n in names]
        return f"{label:<24}" + "".join(f"{'-':>{w}}" if v is None else f"{v:>{w}.3f}"
                                        for v in vals)

    lines += [row("E[max p]", "e_max_p"), row("draft-vocabulary mass", "vocab_mass"),
              row(f"accept len predicted", "predicted_accept_len"),
              row(f"accept len measured", "measured_accept_len")]
    return lines
