"""From a recipe (``Config``) and a world size to a ``Scenario`` and a prediction.

On a GPU recipe every cost comes from the roofline of ``inputs.HARDWARE`` (modelled);
on a CPU recipe from the 2-core machine's measured tables (``cpu_inputs``). What no
recipe says (the response-length distribution, the drafter's acceptance) is an
assumption with a default, listed in the prediction's ``assumptions`` and overridable.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Optional

from ..rollout.speculative import drafters
from .inputs import (Acceptance, DrafterGroup, LengthModel, ModelShape, StepCost,
                     TrainCost, alpha_curve, roofline)
from .paged import (DEFAULT_MEDIAN_FRACTION, DEFAULT_PROMPT_TOKENS,  # noqa: F401
                    DEFAULT_TRUNCATED, default_lengths, typical_prompt)
from .paged import for_config as paged_for_config
from .report import Prediction, predict
from .sim import EngineSettings, Layout, Scenario

# Defaults for what a recipe does not say (each printed with the prediction; the
# lengths' and the prompt's live in paged.py, which the dry run shares).
DEFAULT_ALPHA_GPU = 0.7  # per-token acceptance of a warmed-up EAGLE drafter at T = 1
# the self-drafter (rollout.speculative.drafter=self): the policy's 8-bit copy, every
# layer, its own cache; SmolLM2's int8 copy measured alpha 0.966 per token at T = 1
# (alpha_kinds_smollm2_demo_recipe_cpu.json): 0.9 assumed for a large model's FP8 copy
SELF_ALPHA = 0.9
SELF_DRAFT_FRACTION = 0.5  # 8-bit weights: half the bf16 bytes streamed per draft
DEFAULT_TOKENS_SCALE = 10.0  # a 7B-32B drafter needs ~10x the tokens of the 135M one


def scaled_curve(final_alpha: float, tokens_scale: float = 1.0, flat: bool = True
                 ) -> Acceptance:
    """The measured alpha-against-tokens curve (SmolLM2, ``drafter_alpha_curves_t1_cpu``)
    rescaled so its last point's depth-1 alpha is ``final_alpha``, its token axis
    multiplied by ``tokens_scale``; ``flat``: every depth takes the depth-1 value (a
    large model's EAGLE drafter keeps its acceptance along the chain far better than
    the 135M one measured here). The curve's shape stands in for a drafter of the
    target model until its own curve (or a drift run) is measured."""
    base = alpha_curve()
    f = final_alpha / base.alphas[-1][0]
    rows = tuple(tuple(min(0.95, (row[0] if flat else a) * f) for a in row)
                 for row in base.alphas)
    return Acceptance(tuple(t * tokens_scale for t in base.tokens), rows,
                      source=f"{base.source}: shape rescaled to alpha {final_alpha:.2f}"
                      f"{' at every depth' if flat else ''}, tokens x {tokens_scale:g}")


def paged_note(pe, ep: int = 1) -> str:
    """The paged engine's budget and rows, as an assumption line."""
    p = pe.plan
    group = " (the EP group's)" if ep > 1 else ""
    return (f"paged KV cache: {pe.budget_bytes / 2 ** 30:.1f} GiB per GPU "
            f"({'rollout.kv_cache_gib' if pe.from_config else 'what max_batch_size slots reserve'})"
            f" = {p.tokens:,.0f} positions per engine{group}; {p.rows} rows in flight "
            f"(limited by {p.limited_by}; {p.held:,.0f} positions held per row on these "
            f"lengths, a group's prompt shared, blocks of {p.block}); a row enters while "
            "the tokens held leave room (preemption not modelled)")


def gpu_train_cost(cost, layout: Layout, *, logprob_passes: float,
                   update_passes: float = 3.0) -> TrainCost:
    """Per DP replica: forward + backward (3 passes; 4 with full recomputation) per
    token for the update and ``logprob_passes`` forwards for the old / reference
    log-probs, over the replica's TP x PP GPUs at the roofline's training efficiency."""
    gpus = layout.tp * layout.pp
    return TrainCost(logprob_per_token=cost.train_seconds_per_token(gpus, logprob_passes),
                     update_per_token=cost.train_seconds_per_token(gpus, update_passes),
                     source=f"roofline training: {cost.hw.mfu_train:.0%} of bf16 peak "
                     "(modelled), pipeline bubble ignored")


def drafter_throughput(cost, layout: Layout, dgc) -> DrafterGroup:
    """Drafter tokens a replica trains per second, and at most per step, as the drafter
    group sizes them (``drafter_training/sizing.py``: 6 x (drafter layer + the target's
    output layer) FLOPs per token at its achieved fraction of the dense bf16 peak, a
    0 ("auto") size derived for the device) on the replica's TP x PP GPUs."""
    from ..drafter_training.sizing import DeviceInfo, DrafterCost, derive

    m, hw = cost.model, cost.hw
    # one layer (a dense target's, or the MoE target's dense drafter layer) + fc (2H -> H)
    layer = (m.draft_layer or m.params / max(m.layers, 1)) + 2 * m.hidden ** 2
    dcost = DrafterCost(hidden=m.hidden, vocab=m.vocab, layer_params=int(layer))
    device = DeviceInfo("cuda", int(hw.memory_gib * 2 ** 30), (9, 0))
    sizes = derive(device, dcost, dgc.stop_checks)
    steps = dgc.max_steps_per_window or sizes["max_steps_per_window"]
    tokens = dgc.batch_tokens or sizes["batch_tokens"]
    rate = layout.tp * layout.pp * hw.bf16_flops * _achieved() / dcost.flops_per_token
    return DrafterGroup(True, rate, float(steps * tokens),
                        source=f"drafter training {rate:,.0f} tok/s per replica (modelled: "
                        f"drafter_training/sizing.py's throughput), at most {steps} x "
                        f"{tokens} tokens per step")


def _achieved() -> float:
    from ..drafter_training.sizing import ACHIEVED_FRACTION

    return ACHIEVED_FRACTION


CPU_MODEL_PARAMS = 2e8  # the CPU tables are SmolLM2-135M's: only a model this small uses them


def default_hardware(cfg, params: float) -> str:
    """cpu for a CPU recipe of a SmolLM2-sized model (the only model our CPU tables
    measure), else the H100 roofline."""
    if cfg.platform.device == "cpu" or (cfg.platform.device == "auto"
                                        and params < CPU_MODEL_PARAMS):
        return "cpu"
    return "h100"


def default_acceptance(cfg, hardware: Optional[str] = None) -> Acceptance:
    """The acceptance a prediction assumes when none is given: the demo drafter's
    measured alpha on the CPU tables, the rescaled curve on a GPU."""
    if hardware is None:
        from ..models.known import architecture

        hardware = default_hardware(cfg, architecture(cfg)[0].num_parameters)
    if hardware == "cpu":
        from .cpu_inputs import demo_drafter_alpha

        return demo_drafter_alpha()
    return scaled_curve(DEFAULT_ALPHA_GPU, tokens_scale=DEFAULT_TOKENS_SCALE)


def predict_for_config(cfg, world_size: int, *, hardware: Optional[str] = None,
                       lengths: Optional[LengthModel] = None,
                       acceptance: Optional[Acceptance] = None, steps: int = 4,
                       band: bool = True, cost: Optional[StepCost] = None,
                       arch=None) -> Prediction:
    """Predict the recipe's step time with and without TLT on ``world_size`` ranks.

    hardware: "h100" / "h200" (roofline) or "cpu" (the 2-core machine's tables);
    default from ``platform.device`` and the model's size. lengths / acceptance
    override the defaults; ``cost`` replaces the decode-step costs (a measured table:
    ``inputs.table_from_bench_rollout``), training keeping the hardware's. ``arch``:
    the model's ``ModelArch`` (the dry run passes the one it resolved)."""
    from ..config import mini_batch_count

    table = cost
    if arch is None:
        from ..models.known import architecture

        arch = architecture(cfg)[0]
    par, g, ro = cfg.parallel, cfg.grpo, cfg.rollout
    tp, pp = par.tensor_model_parallel_size, par.pipeline_model_parallel_size
    layout = Layout(tp, pp, world_size // (tp * pp), ro.pipeline_mode == "gathered")
    hardware = hardware or default_hardware(cfg, arch.num_parameters)
    m = mini_batch_count(cfg) * g.ppo_epochs
    assumptions = []
    if lengths is None:
        lengths = default_lengths(g.max_new_tokens)
    assumptions.append(f"response lengths: {lengths.source}")
    engine = EngineSettings.from_config(ro)
    if ro.kv_cache == "paged":
        pe = paged_for_config(cfg, arch, world_size, lengths=lengths)
        engine = replace(engine, max_batch_size=pe.plan.rows, kv_tokens=pe.plan.tokens)
        assumptions.append(paged_note(pe, par.expert_model_parallel_size))
    engine = engine.per_rank(par.expert_model_parallel_size)
    drafter_on = bool(ro.speculative.drafter) or cfg.drafter_group.enable
    if hardware == "cpu":
        from .cpu_inputs import PROMPT_TOKENS, cpu_1t_corun_table, cpu_train_cost
        cost = cpu_1t_corun_table()
        prompt = PROMPT_TOKENS
        train = cpu_train_cost()
        if arch.num_parameters >= CPU_MODEL_PARAMS:
            assumptions.append("WARNING: the CPU tables were measured on SmolLM2-135M; "
                               "this model's CPU step times are not modelled")
        acc = acceptance or default_acceptance(cfg, hardware)
        dg = DrafterGroup(cfg.drafter_group.enable, 0.0)  # no effect measured on 2 cores
        assumptions += [cost.source, train.source]
    else:
        shape = ModelShape.from_arch(arch, 2.0 if cfg.model.dtype != "float32" else 4.0)
        cost = roofline(hardware, shape, tp, ep=par.expert_model_parallel_size)
        prompt = typical_prompt(cfg.data.max_prompt_tokens)
        fused = m == 1
        train = gpu_train_cost(cost, layout, logprob_passes=(0.0 if fused else 1.0)
                               + (1.0 if g.kl_beta > 0 else 0.0),
                               update_passes=4.0 if cfg.train.recompute_granularity == "full"
                               else 3.0)
        acc = acceptance or default_acceptance(cfg, hardware)
        dgc = cfg.drafter_group
        dg = drafter_throughput(cost, layout, dgc)
        dg.enable = True  # TLT = speculation + the drafter group
        dg.tokens_trained0 = acc.tokens[len(acc.tokens) // 2]  # the warm-up's end
        if drafters.kind_of_value(ro.speculative.drafter).copies_policy \
                and len(drafters.configured_values(ro.speculative)) == 1:
            acc = acceptance or Acceptance.constant(
                (SELF_ALPHA,) * 8, source=f"the self-drafter: alpha {SELF_ALPHA} at every "
                "depth (assumed; SmolLM2's int8 copy measured 0.97), nothing to train")
            cost = replace(cost, draft_fraction=SELF_DRAFT_FRACTION, draft_layers=shape.layers)
            dg = DrafterGroup(False, 0.0, source="the self-drafter trains nothing")
            assumptions.append(f"self-drafter drafts: every layer at {SELF_DRAFT_FRACTION:.0%} "
                               "of the target's weight bytes, over its own cache")
        elif acc.drift_online:
            assumptions.append("per-step acceptance of the online and frozen drafters from "
                               "the drift run (the curve is not walked)")
        else:
            assumptions.append(
                f"the drafter starts at {dg.tokens_trained0:,.0f} tokens trained (alpha "
                f"{acc.at(dg.tokens_trained0)[0]:.2f}); the frozen arm stays there (no drift "
                "data: a frozen drafter is assumed not to decay), the drafter group moves "
                "along the curve")
        assumptions += [cost.source + ": HBM at 80 %, decode/verify compute at 60 %, "
                        "training at 35 % of peak, a 0.3 ms + 10 us/layer floor per step",
                        train.source, dg.source]
        if not drafter_on:
            assumptions.append("the recipe names no drafter: TLT is predicted with a "
                               "warmed-up one")
    assumptions.append(f"acceptance: {acc.source}")
    assumptions.append(f"prompt {prompt:.0f} tokens; gate: speculate where expected tokens "
                       "per step / relative step cost >= 1.05, else plain plus at most "
                       f"{engine.probe_budget:.0%} probing")
    if table is not None:
        assumptions.insert(1, f"decode steps from a measured table (replacing the default costs): {table.source}")
    sc = Scenario(layout, g.prompts_per_step, g.group_size, prompt, lengths, cost, train,
                  engine, acc, dg, steps=steps, seed=cfg.platform.seed, minibatches=m)
    if table is not None:
        sc.cost = table
    return predict(sc, assumptions, band=band)

