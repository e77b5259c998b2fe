"""The GPU check's bf16-against-fp32 first step, on identical, teacher-forced responses
(``python -m megatron_tlt.gpu_check.parts first_step --result R.json -- --config RECIPE
section.field=value ...``).

Two GRPO runs that sample their own responses cannot be compared step for step: at
T = 1 on a random model's nearly flat logits, bf16 and fp32 pick different tokens from
the first near-tie on, and the losses differ by whatever the responses do. So this part
fixes the batch instead: 2 prompts x 4 responses of seeded random tokens (lengths
spread up to ``grpo.max_new_tokens``), advantages +-1, the rollout log-probs read once
from the fp32 policy, and then, for fp32 and for bf16, the same weights (the model
folder of ``model.hf_path``) are loaded into a ``Policy`` (the run's optimizer:
megatron-core's distributed optimizer on CUDA) and take one ``train_step`` with the
trainer's GRPO loss (``grpo.micro_batch_loss``), the pre-update log-probs being fp32's
too (so fp32's ratio is exactly 1 and bf16's loss carries its own log-probs' error).
The two losses and gradient norms must agree within ``LOSS_ATOL + LOSS_RTOL x |fp32|``
and ``GRAD_NORM_RTOL x fp32``: any gap is the precision's alone.
"""

from __future__ import annotations

import gc

LOSS_ATOL, LOSS_RTOL, GRAD_NORM_RTOL = 0.02, 0.05, 0.10
PROMPTS, GROUP, PROMPT_TOKENS = 2, 4, 24


def compare_first_step(bf16: dict, fp32: dict) -> dict:
    """bf16's loss and grad norm against fp32's (each a dict with ``loss`` and
    ``grad_norm``)."""
    a, b = bf16.get("loss"), fp32.get("loss")
    ga, gb = bf16.get("grad_norm"), fp32.get("grad_norm")
    if None in (a, b, ga, gb):
        return {"within_tolerance": False, "reason": "a run has no first step"}
    loss_ok = abs(a - b) <= LOSS_ATOL + LOSS_RTOL * abs(b)
    gn_ok = abs(ga - gb) <= GRAD_NORM_RTOL * abs(gb)
    return {"loss_bf16": a, "loss_fp32": b, "grad_norm_bf16": ga, "grad_norm_fp32": gb,
            "grad_norm_ratio": ga / gb if gb else None,
            "loss_tolerance": f"|d| <= {LOSS_ATOL} + {LOSS_RTOL} x |fp32|",
            "grad_norm_tolerance": f"|d| <= {GRAD_NORM_RTOL} x fp32",
            "within_tolerance": bool(loss_ok and gn_ok)}


def teacher_forced_samples(vocab_size: int, max_new_tokens: int, seed: int = 0):
    """PROMPTS x GROUP samples of seeded random tokens; advantages +1 / -1 in each group."""
    import torch

    from megatron_tlt.rl.samples import Sample

    g = torch.Generator().manual_seed(seed)
    out = []
    for p in range(PROMPTS):
        prompt = torch.randint(0, vocab_size, (PROMPT_TOKENS + p,), generator=g).tolist()
        for j in range(GROUP):
            n = max(2, max_new_tokens * (j + 1 + p) // (GROUP + PROMPTS - 1))
            out.append(Sample(prompt_index=p, prompt_ids=prompt,
                              response_ids=torch.randint(0, vocab_size, (n,),
                                                         generator=g).tolist(),
                              rollout_logprobs=[0.0] * n, finish_reason="length",
                              advantage=1.0 if j % 2 == 0 else -1.0, uid=f"{p}-{j}"))
    return out


def first_step(rest: list[str]) -> dict:
    import torch

    from megatron_tlt.models import arch_from_source, load_model, resolve_source
    from megatron_tlt.parallel import initialize_model_parallel
    from megatron_tlt.rl import grpo
    from megatron_tlt.rl.policy import Policy
    from megatron_tlt.rl.samples import collate
    from megatron_tlt.runtime_env import init_distributed, silence_expected_warnings

    silence_expected_warnings()
    from megatron_tlt.cli import parse
    from megatron_tlt.validation import validate

    _, cfg = parse(rest)
    source = resolve_source(cfg.model.hf_path)
    validate(cfg, arch_from_source(source), 1)  # one process: every rule, as the launch
    plat = init_distributed(cfg.platform.device, cfg.platform.backend)
    initialize_model_parallel(1, 1, seed=cfg.platform.seed)
    g = cfg.grpo
    runs: dict[str, dict] = {}
    samples = None
    for dtype in ("float32", "bfloat16"):
        model, arch = load_model(source, device=plat.device, dtype=dtype,
                                 impl=cfg.model.transformer_impl)
        policy = Policy(model, arch, cfg.train, total_optimizer_steps=max(cfg.train.steps, 1))
        if samples is None:  # the rollout log-probs: fp32's, for both runs
            samples = teacher_forced_samples(arch.vocab_size, g.max_new_tokens)
            mb = collate(samples, range(len(samples)), pad_id=0, device=plat.device)
            lp = policy.logprobs([mb], temperature=g.temperature)[0]
            for i, s in enumerate(samples):
                s.rollout_logprobs = lp[i][mb.mask[i] > 0].float().cpu().tolist()
                s.old_logprobs = torch.tensor(s.rollout_logprobs)
        mb = collate(samples, range(len(samples)), pad_id=0, device=plat.device)
        denoms = grpo.LossDenominators(tokens=float(sum(len(s.response_ids) for s in samples)),
                                       sequences=float(len(samples)),
                                       max_len=float(g.max_new_tokens))

        def loss_fn(mb, logits, denoms=denoms, arch=arch):
            return grpo.micro_batch_loss(mb, logits, g, denoms, vocab_size=arch.vocab_size,
                                         chunk_tokens=cfg.train.loss_chunk_tokens)

        result, metrics = policy.train_step([mb], loss_fn)
        runs[dtype] = {"loss": sum(float(m["loss"]) for m in metrics),
                       "grad_norm": float(result.grad_norm), "updated": result.updated,
                       "optimizer": policy.kind}
        del policy, model
        gc.collect()
        if plat.device.type == "cuda":
            torch.cuda.empty_cache()
    comparison = compare_first_step(runs["bfloat16"], runs["float32"])
    return {"ok": comparison["within_tolerance"] and all(r["updated"] for r in runs.values()),
            "device": str(plat.device), "samples": len(samples),
            "response_tokens": [len(s.response_ids) for s in samples], "runs": runs,
            "comparison": comparison}
