"""The dry run's memory model by phase (rl/memory_model.py): its arithmetic, the GPU
recipes against an 80 GB GPU, and the model against measured peak RSS on CPU
(tools/measure_memory.py: each measured cell a fresh process)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from megatron_tlt.config import load_config
from megatron_tlt.models.gpt import ModelArch
from megatron_tlt.rl import memory_model as mm
from megatron_tlt.rl import plan
from megatron_tlt.rl import memory_terms as mt
from megatron_tlt.rollout.kv_cache import kv_bytes
from megatron_tlt.rollout.speculative import self_drafter as sd
from megatron_tlt.rollout.speculative.kind_eagle import EagleKind
from megatron_tlt.rollout.speculative.self_drafter import SelfDrafter
from megatron_tlt.rl.plan import KNOWN_ARCHITECTURES, dry_run

REPO = Path(__file__).resolve().parents[2]


def _arch(**kw) -> ModelArch:
    spec = dict(model_type="llama", vocab_size=32000, hidden_size=1024,
                intermediate_size=4096, num_hidden_layers=8, num_attention_heads=16,
                num_key_value_heads=16, max_position_embeddings=8192,
                tie_word_embeddings=False)
    return ModelArch.from_hf_config({**spec, **kw})


def _settings(**kw) -> mm.Settings:
    cfg = load_config(overrides=["model.hf_path=x", "platform.device=cuda",
                                 "model.dtype=bfloat16", "grpo.prompts_per_step=8",
                                 "grpo.group_size=8", "grpo.max_new_tokens=2048",
                                 "data.max_prompt_tokens=512", "train.micro_batch_size=2",
                                 "rollout.max_batch_size=32"])
    if {"micro_batch", "seq", "loss_tokens"} & set(kw):
        kw.setdefault("shapes", ())  # the micro-batch given, not the budget's worst
    return dataclasses.replace(mm.settings(cfg, 8), **kw)


def test_peak_is_resident_plus_the_larger_phase():
    arch = _arch()
    for kw in ({}, {"kv_released": False}, {"micro_batch": 8}, {"rollout_rows": 512},
               {"reference": True}, {"old_pass": True, "recompute": "full"}):
        est = mm.estimate_settings(arch, _settings(**kw))
        phases = {p: est.total(p) for p in ("rollout", "log-probs", "update")}
        assert est.peak == pytest.approx(est.resident + max(phases.values()))
        assert est.peak_phase == max(phases, key=phases.get)
    assert not mm.estimate_settings(arch, _settings()).total("log-probs")
    assert mm.estimate_settings(arch, _settings(reference=True)).total("log-probs") > 0
    # a KV cache that is not released before the update is resident through both (and
    # the CUDA graphs captured on it with it)
    kept = mm.estimate_settings(arch, _settings(kv_released=False))
    freed = mm.estimate_settings(arch, _settings(kv_released=True))
    kv = freed.as_dict()["KV cache"] + freed.as_dict()["CUDA graph pools"]
    assert kept.resident == pytest.approx(freed.resident + kv)
    assert kept.update_total == pytest.approx(freed.update_total + kv)
    assert kept.rollout_total == pytest.approx(freed.rollout_total)


def test_gpu_activations_are_the_korthikanti_formula():
    """GPU.md's per-layer bytes, 16-bit: without SP s·b·h·(10 + 24/t + 5·a·s/(h·t)),
    with SP s·b·h·(34 + 5·a·s/h)/t. Our MLP term is SwiGLU's 6f, GPT's 4h GELU's 16h:
    an MLP width of 8h/3 makes the two the same."""
    h, a = 768, 12
    arch = _arch(hidden_size=h, num_attention_heads=a, num_key_value_heads=a,
                 intermediate_size=8 * h // 3)
    b, s_len = 2, 1000
    for t, sp in ((1, False), (2, False), (4, False), (2, True), (8, True)):
        st = _settings(tp=t, sequence_parallel=sp, micro_batch=b, seq=s_len)
        got = mt.layer_activation_bytes(arch, st, tokens=b * s_len)
        sbh = s_len * b * h
        want = sbh * ((34 + 5 * a * s_len / h) / t if sp
                      else 10 + 24 / t + 5 * a * s_len / (h * t))
        assert got == pytest.approx(want, rel=1e-9)
        sel = mt.layer_activation_bytes(arch, dataclasses.replace(st, recompute="selective"),
                                        tokens=b * s_len)
        assert sel == pytest.approx(want - sbh * 5 * a * s_len / (h * t), rel=1e-9)


def test_recomputation_lowers_the_update_and_full_keeps_layer_inputs():
    arch = _arch()
    base = _settings()
    none, sel, full = (mm.estimate_settings(arch, dataclasses.replace(base, recompute=r))
                       for r in ("none", "selective", "full"))
    acts = [e.as_dict()["activations"] for e in (none, sel, full)]
    assert acts[0] > acts[1] > acts[2]
    assert none.update_total > sel.update_total > full.update_total
    # full, uniform chunks of one layer: each layer's input (2·s·b·h in 16-bit) plus
    # one layer's full activations while it is recomputed, plus the final norm's
    st = dataclasses.replace(base, recompute="full", recompute_layers=1)
    tokens = st.micro_batch * st.seq
    one = mt.layer_activation_bytes(arch, dataclasses.replace(st, recompute="none"),
                                    tokens=tokens)
    assert mt.activation_bytes(arch, st, layers=arch.num_layers) == pytest.approx(
        arch.num_layers * 2 * tokens * arch.hidden_size + one)
    # sequence parallelism divides what full recomputation keeps by TP
    sp = dataclasses.replace(st, tp=4, sequence_parallel=True)
    nosp = dataclasses.replace(sp, sequence_parallel=False)
    assert mt.activation_bytes(arch, sp, layers=8) < mt.activation_bytes(arch, nosp, layers=8)


def test_loss_chunks_bound_the_vocabulary_temporaries():
    arch = _arch(vocab_size=152064)
    whole = _settings(loss_chunk=None)
    chunked = _settings(loss_chunk=1024)
    a, _ = mt.loss_vocab_bytes(arch, whole)
    b, _ = mt.loss_vocab_bytes(arch, chunked)
    assert b < a


@pytest.mark.parametrize("drafter", [False, True], ids=["plain", "drafter"])
@pytest.mark.parametrize("recipe,world", [("qwen2.5_7b_grpo", 8), ("qwen2.5_32b_grpo", 64)])
def test_gpu_recipes_fit_an_80gb_gpu(recipe, world, drafter):
    cfg = load_config([REPO / "examples/rl" / f"{recipe}.yaml"],
                      ["rollout.speculative.drafter=/drafter"] if drafter else [])
    arch = ModelArch.from_hf_config(KNOWN_ARCHITECTURES[Path(cfg.model.hf_path).name])
    est = mm.estimate(cfg, arch, world)
    assert est.peak <= mm.GPU_BYTES * mm.GPU_USABLE, "\n".join(mm.report_lines(est))
    text = dry_run(cfg, world)
    assert "fits an 80 GB GPU" in text and "does NOT fit" not in text
    assert "[gpu-model]" in text and "[cpu-validated]" in text


def test_the_dry_run_names_what_does_not_fit():
    cfg = load_config([REPO / "examples/rl/qwen2.5_7b_grpo.yaml"],
                      ["rollout.max_batch_size=4096", "train.micro_batch_tokens=0",
                       "train.micro_batch_size=64"])
    text = dry_run(cfg, 8)
    assert "does NOT fit an 80 GB GPU" in text
    assert "rollout total" in text and "update total" in text and "peak" in text


@pytest.mark.parametrize("device", ["cuda", "cpu"])
def test_offload_lends_the_update_only_terms_to_the_rollout(device):
    """train.offload_during_rollout: the rollout phase holds the resident terms less the
    gradient buffers and the optimizer state; the log-prob and update phases keep them;
    the dry run prints the rollout with and without the flag, whichever is set."""
    recipe = [REPO / "examples/rl/qwen3_8b_grpo.yaml"]
    extra = [f"platform.device={device}", "model.dtype=bfloat16"]
    arch = ModelArch.from_hf_config(KNOWN_ARCHITECTURES["Qwen3-8B"])
    off = mm.estimate(load_config(recipe, extra), arch, 8)
    on = mm.estimate(load_config(recipe, [*extra, "train.offload_during_rollout=true"]),
                     arch, 8)
    d = off.as_dict()
    lent = d["grads"] + d["optimizer"]
    assert plan.update_only_bytes(off) == plan.update_only_bytes(on) == lent > 0
    assert on.as_dict()["lent by the update"] == -lent
    assert on.rollout_total == pytest.approx(off.rollout_total - lent)
    assert (on.resident, on.logprobs_total, on.update_total) == \
        (off.resident, off.logprobs_total, off.update_total)
    assert on.peak == pytest.approx(max(on.rollout_total, on.logprobs_total,
                                        on.update_total))
    if device == "cuda":  # the recipe's rollout-bound peak comes down to its update's
        assert off.peak_phase == "rollout" and on.peak < off.peak
    lines = [plan.offload_lines(e)[0] for e in (off, on)]
    assert lines[0].replace("off in", "on in") == lines[1]
    assert f"{on.rollout_total / mm.GIB:8.2f} GiB, =false {off.rollout_total / mm.GIB:8.2f}" \
        in lines[1]
    assert lines[1] in dry_run(load_config(recipe, ["train.offload_during_rollout=true"]), 8) \
        or device == "cpu"


def test_recorded_offload_drops_the_rollout_by_the_lent_bytes():
    """docs/results/offload_rss_cpu.json (tools/measure_memory.py --offload): with the
    flag on, the rollout phase's peak RSS is lower by the bytes the update lent (75-115 %
    of them, and beyond the A/A control's difference), the lent bytes are the
    model's gradient and optimizer terms, and the other phases are unchanged within
    the A/A noise."""
    doc = json.loads((REPO / "docs/results/offload_rss_cpu.json").read_text())
    assert doc["cells"] and doc["cpu"] and doc["date"] and doc["command"]
    for c in doc["cells"]:
        runs = c["runs"]
        lent = runs["on"]["measured"]["lent_bytes"]
        assert all(n == pytest.approx(runs["on"]["update_only"], rel=1e-3) for n in lent)
        assert runs["off"]["measured"]["lent_bytes"] == [0] * len(lent)
        noise = max(abs(x) for x in c["rollout_aa"])
        for drop in c["rollout_drop"]:
            # (short of the lent bytes by what glibc's heap keeps of the tensors under its
            # mmap threshold once they are freed again: docs/memory.md)
            assert 0.75 * lent[0] <= drop <= 1.15 * lent[0] and drop > noise, c["cell"]
        pred = {k: runs[k]["predicted"]["rollout"] for k in ("off", "on")}
        assert pred["off"] - pred["on"] == pytest.approx(lent[0], rel=1e-6)


def _tool():
    import importlib.util

    spec = importlib.util.spec_from_file_location("measure_memory",
                                                  REPO / "tools/measure_memory.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_cpu_measurement_agrees_with_the_model(tmp_path):
    """One small shape, two GRPO steps (the trainer's own code, in fresh subprocesses),
    with and without recomputation: the model within ±15 % of the measured peak RSS,
    and recomputation lowering the update both ways. The tool's ``main`` runs in this
    process (it only writes the model and starts the cells); each cell is a fresh
    ``tools/measure_memory.py --cell`` process, whose peak RSS is measured."""
    from cli import run_main

    out = tmp_path / "cells.json"
    r = run_main("tools/measure_memory.py", "--cells", "small-none,small-full", "--json",
                 out, "--models", tmp_path / "models")
    assert r.returncode == 0, r.stderr[-3000:]
    cells = {c["recompute"]: c for c in json.loads(out.read_text())["cells"]}
    for c in cells.values():
        assert abs(c["error_pct"]["peak"]) <= 15, c
        assert c["measured"]["lengths"] == [c["new_tokens"]]  # the worst case ran
    none, full = cells["none"], cells["full"]
    assert full["predicted"]["update"] < none["predicted"]["update"]
    assert full["measured"]["update"] < none["measured"]["update"]


def test_recorded_grid_cells_are_within_15_percent():
    """The validation grid (docs/results/memory_model_cpu.json, docs/memory.md): cells
    on shapes, lengths below the cap and options (entropy bonus, KL k1 / k3, dual clip,
    TIS, PPO epochs) the model was not fitted on, re-predicted by the model as it is now
    from each cell's recorded config and lengths: every measured peak within ±15 %, and
    the dry run's bound (no lengths: the worst micro-batch the budget allows) never
    below the prediction at the real lengths."""
    tool = _tool()
    cells = json.loads((REPO / "docs/results/memory_model_cpu.json").read_text())["cells"]
    want = tool.GRID + tool.MOE_CELLS  # the MoE cells: a Qwen3-MoE with routing replay
    grid = [c for c in cells if c["name"] in {g["name"] for g in want}]
    assert len(grid) == len(want)
    options = set()
    for c in grid:
        c = tool.repredict(dict(c))
        ratio = c["measured"]["peak"] / c["predicted"]["peak"]
        assert 0.85 <= ratio <= 1.15, (c["name"], ratio)
        assert c["dry_run"]["peak"] >= c["predicted"]["peak"]
        options |= {o.split("=")[0] for o in c["options"]}
        if min(c["lengths"]) < c["new_tokens"]:
            options.add("below the cap")
    assert {"grpo.entropy_coef", "grpo.kl_beta", "grpo.tis_cap", "grpo.dual_clip_c",
            "below the cap"} <= options


def test_planned_micro_batches_are_the_trainers():
    """``memory_terms.planned_shapes`` builds the micro-batches ``plan_micro_batches``
    and ``MicroBatch.fitted`` do (rows, longest sample rounded to the TP multiple, loss
    rows), per mini-batch."""
    import random

    from megatron_tlt.rl.samples import Sample, plan_micro_batches

    rng = random.Random(0)
    for trial in range(40):
        group, mini = rng.choice([2, 4]), rng.choice([1, 2])
        n = group * mini * rng.randint(1, 4)
        lengths = [(rng.randint(5, 60), rng.randint(1, 200)) for _ in range(n)]
        mbs, mbt, mult = rng.randint(1, 5), rng.choice([0, 150, 400]), rng.choice([1, 4])
        samples = [Sample(prompt_index=i // group, prompt_ids=[1] * p, response_ids=[2] * r,
                          rollout_logprobs=[0.0] * r, finish_reason="length")
                   for i, (p, r) in enumerate(lengths)]
        want = set()
        for m in range(mini):
            idx = [i for i, x in enumerate(samples) if x.prompt_index % mini == m]
            for plan in plan_micro_batches(samples, idx, micro_batch_size=mbs,
                                           micro_batch_tokens=mbt):
                longest = max(samples[i].length for i in plan)
                want.add((len(plan), -(-longest // mult) * mult,
                          sum(len(samples[i].response_ids) for i in plan)))
        got = mt.planned_shapes(lengths, group_size=group, mini_batches=mini,
                                micro_batch_size=mbs, micro_batch_tokens=mbt, multiple=mult)
        assert set(got) == want, trial


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_the_dry_run_bounds_any_lengths(device):
    """The dry run does not know the responses' lengths: its micro-batch is the worst
    the budget allows up to the cap, so no step's real lengths model above it (shorter
    samples make micro-batches of more rows: 4 x 1024 positions under a 4096-token
    budget where the cap's is 2 x 1792)."""
    import random

    arch = _arch(vocab_size=49152, hidden_size=512, intermediate_size=1408,
                 num_hidden_layers=6, num_attention_heads=8, num_key_value_heads=2,
                 tie_word_embeddings=True)
    rng = random.Random(1)
    for mbt, rc, kl in ((4096, "none", 0), (0, "full", 0.01), (2048, "selective", 0)):
        cfg = load_config(overrides=[
            "model.hf_path=x", f"platform.device={device}", "grpo.prompts_per_step=4",
            "grpo.group_size=4", "grpo.max_new_tokens=768", "data.max_prompt_tokens=1024",
            "train.micro_batch_size=4", f"train.micro_batch_tokens={mbt}",
            f"train.recompute_granularity={rc}", f"grpo.kl_beta={kl}"])
        bound = mm.estimate(cfg, arch, 1)
        assert bound.settings.shapes_from == "budget"
        for _ in range(25):
            lengths = [(rng.randint(20, 1024), rng.randint(1, 768)) for _ in range(16)]
            real = mm.estimate(cfg, arch, 1, lengths=lengths)
            assert real.peak <= bound.peak
            assert real.settings.shapes_from == "lengths"
    cfg = load_config(overrides=["model.hf_path=x", f"platform.device={device}",
                                 "grpo.max_new_tokens=768", "data.max_prompt_tokens=1024",
                                 "train.micro_batch_size=4", "train.micro_batch_tokens=4096"])
    s = mm.settings(cfg, 1)
    assert (4, 1024, 4 * 768) in s.shapes and (2, 1792, 2 * 768) in s.shapes


def test_options_that_change_the_step_have_terms():
    """The entropy bonus, KL (the reference's weights and its forward), dual clip and
    TIS each add their term; the old policy's forward pass exists with more than one
    epoch or mini-batch and not with the rollout's log-probs; DAPO's extra rounds reuse
    the rollout's KV cache."""
    arch = _arch()

    def est(*over):
        cfg = load_config(overrides=["model.hf_path=x", "platform.device=cpu",
                                     "model.dtype=float32", *over])
        return mm.estimate(cfg, arch, 1)
    base = est()
    assert not base.total("log-probs")
    kl = est("grpo.kl_beta=0.01")
    assert kl.as_dict()["reference"] == base.as_dict()["weights"]
    assert kl.total("log-probs") > 0
    for opt in ("grpo.entropy_coef=1e-3", "grpo.dual_clip_c=3", "grpo.tis_cap=2"):
        assert est(opt).as_dict()["loss per-token"] > base.as_dict()["loss per-token"]
    assert est("grpo.ppo_epochs=2").total("log-probs") > 0
    assert not est("grpo.ppo_epochs=2", "grpo.use_rollout_logprobs=true").total("log-probs")
    dyn = est("grpo.dynamic_sampling=true")
    assert dyn.rollout_total == base.rollout_total
    assert "extra rounds" in next(t.note for t in dyn.terms if t.name == "KV cache")


# ----------------------------------------------------------------------------- CUDA graphs
def test_graph_buckets_are_the_engines():
    from megatron_tlt.rollout.cuda_graphs import bucket_for

    for rows in (1, 2, 3, 8, 24, 33):
        assert mt.graph_buckets(rows) == sorted({bucket_for(b, rows)
                                                 for b in range(1, rows + 1)})


def test_graph_key_and_pool_arithmetic():
    """A key's static tensors are their sizes; its working set grows with the span it
    attends over and its new tokens; one pool holds the outputs and the largest
    working set (the captures reuse each other's freed intermediates)."""
    arch = _arch(num_key_value_heads=4)  # 16 heads, 4 groups: 4 query heads per group
    h, db = arch.hidden_size, 2
    k = mt.graph_key_bytes(arch, tp=1, dtype_bytes=db, bucket=4, tokens=5, width=5,
                           capacity=100, embeds=True)
    n = 4 * 5
    assert k.output == n * h * db
    assert k.inputs == n * 8 + 4 * 8 + n * 8 + n * 5 + n * h * db
    plain = mt.graph_key_bytes(arch, tp=1, dtype_bytes=db, bucket=4, tokens=1, width=0,
                               capacity=100)
    assert plain.inputs == 4 * 8 + 4 * 8 and plain.output == 4 * h * db
    longer = mt.graph_key_bytes(arch, tp=1, dtype_bytes=db, bucket=4, tokens=1, width=0,
                                capacity=1000)
    assert longer.working > plain.working and longer.output == plain.output
    # the mask held through the forward: [4, 1, 5 x 4 query heads per group, 100]
    assert k.working >= 4 * 5 * 4 * 100 * db
    assert mt.graph_key_bytes(arch, tp=2, dtype_bytes=db, bucket=4, tokens=5, width=5,
                              capacity=100).working < k.working
    pool, inputs = mt.graph_pool_bytes([k, plain, longer])
    assert pool == k.output + plain.output + longer.output + max(
        k.working, plain.working, longer.working)
    assert inputs == k.inputs + plain.inputs + longer.inputs
    assert mt.graph_pool_bytes([]) == (0.0, 0.0)


def test_graph_keys_follow_buckets_and_arms():
    arch = _arch()
    plain = _settings(rollout_rows=24, arms=(), spec_threshold=8)
    keys = mt.graph_keys(arch, plain)
    assert len(keys["target"]) == 6 and not keys["drafter"]  # 1, 2, 4, 8, 16, 24
    spec = dataclasses.replace(plain, arms=((4, 1, 4), (3, 2, 5)), kinds=(EagleKind,))
    keys = mt.graph_keys(arch, spec)
    # per bucket up to the threshold (1, 2, 4, 8): a chain of 5 and a tree of 6 x 6
    assert len(keys["target"]) == 6 + 4 * 2
    cut = mt.graph_keys(arch, dataclasses.replace(spec, cut_chains=True))
    assert len(cut["target"]) == 6 + 4 * (4 + 1)  # chains of 2..5 tokens
    slack = max(5, (3 - 1) * 2) + 2
    assert len(keys["drafter"]) == 4 * (slack + 2)  # widths 1..slack, two tree steps
    # the self-drafter alone: the target's verifications, no drafter graphs
    alone = mt.graph_keys(arch, dataclasses.replace(spec, kinds=(SelfDrafter,)))
    assert len(alone["target"]) == len(keys["target"]) and not alone["drafter"]


def test_graph_pools_in_the_estimate():
    arch = _arch()
    on = mm.estimate_settings(arch, _settings(cuda_graphs=True)).as_dict()
    off = mm.estimate_settings(arch, _settings(cuda_graphs=False)).as_dict()
    assert on["CUDA graph pools"] > 0 and "CUDA graph pools" not in off
    s = _settings()
    assert s.cuda_graphs  # the config's auto on a GPU
    cfg_off = load_config(overrides=["model.hf_path=x", "platform.device=cuda",
                                     "rollout.cuda_graphs=false"])
    assert not mm.settings(cfg_off, 1).cuda_graphs
    cpu = load_config(overrides=["model.hf_path=x", "platform.device=cpu"])
    assert not mm.settings(cpu, 1).cuda_graphs
    kept = mm.estimate_settings(arch, _settings(kv_released=False))
    assert any(t.name == "CUDA graph pools" and t.phase == "resident" for t in kept.terms)


# ----------------------------------------------------------------------------- self-drafter
def test_self_drafter_terms_follow_the_config():
    """drafter=self: the copy (resident, no one-layer drafter terms) and its KV cache
    (all layers, rows up to the threshold, released with the others); FP8 on a GPU
    (auto, per-channel scales), int8 with groups; kinds.self.also adds it to the one-layer
    drafter's terms."""
    arch = _arch(vocab_size=49152, hidden_size=576, intermediate_size=1536,  # SmolLM2-135M
                 num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                 tie_word_embeddings=True)
    base = ["model.hf_path=x", "grpo.prompts_per_step=4", "grpo.group_size=8",
            "grpo.max_new_tokens=256", "data.max_prompt_tokens=128",
            "rollout.max_batch_size=32", "rollout.speculative.threshold=8"]
    cpu = load_config(overrides=base + ["platform.device=cpu", "model.dtype=float32",
                                        "rollout.speculative.drafter=self"])
    s = mm.settings(cpu, 1)
    assert (sd.copy_format(s.spec, s.on_gpu), s.kinds, s.cpu_kernels) == (
        "int8", (SelfDrafter,), True)
    terms = {t.name: t for t in mm.estimate_settings(arch, s).terms}
    assert "drafter" not in terms and "drafter KV + features" not in terms
    copy, kv = terms["self-drafter copy"], terms["self-drafter KV"]
    assert copy.phase == "resident" and kv.phase == "rollout"
    policy = terms["weights"].nbytes  # fp32, tied embedding
    assert 0.2 * policy < copy.nbytes <= 0.3 * policy
    positions = 384 + s.draft_slack + 1  # capacity + slack + root (CPU kernels)
    assert s.draft_slack == 10  # SELF_ARMS' 8_1_8 and the fixed 7_1_7: max(8, 7) + 2

    def kv_of(rows, positions):
        return kv_bytes(num_layers=arch.num_layers, rows=rows, kv_heads=3,
                        capacity=positions, head_dim=arch.kv_channels, itemsize=4)
    assert kv.nbytes == kv_of(8, positions)
    # no kernels: q instead of panels (no padding), a capacity more of cache
    off = dataclasses.replace(s, cpu_kernels=False)
    d = mm.estimate_settings(arch, off).as_dict()
    assert d["self-drafter KV"] == kv_of(8, positions + 384)
    assert d["self-drafter copy"] < copy.nbytes  # the panel scales and padding go
    kept = mm.estimate_settings(arch, dataclasses.replace(s, kv_released=False))
    assert {t.name: t.phase for t in kept.terms}["self-drafter KV"] == "resident"
    # a GPU: FP8 by default, int8 with groups (q and scales, no panels)
    gpu = ["platform.device=cuda", "model.dtype=bfloat16", "rollout.speculative.drafter=self"]
    g = mm.settings(load_config(overrides=base + gpu), 1)
    assert sd.copy_format(g.spec, g.on_gpu) == "fp8" and not g.cpu_kernels
    g8 = mm.settings(load_config(overrides=base + gpu + ["rollout.speculative.kinds.self.group=64"]), 1)
    assert sd.copy_format(g8.spec, g8.on_gpu) == "int8"
    mats = sd.copy_matrices(arch, 1)
    int8 = sum(n * k + 4 * n * -(-k // 64) for n, k in mats)
    small = (arch.num_layers * 2 + 1) * arch.hidden_size + arch.kv_channels
    assert sd.copy_bytes(arch, g8, g8.spec, "int8") == int8 + 2 * small
    # kinds.self.also: the one-layer drafter's terms and the copy's
    both = mm.settings(load_config(overrides=base + [
        "platform.device=cpu", "model.dtype=float32", "rollout.speculative.drafter=/d",
        "rollout.speculative.kinds.self.also=true"]), 1)
    names = {t.name for t in mm.estimate_settings(arch, both).terms}
    assert {"drafter", "drafter KV + features", "self-drafter copy",
            "self-drafter KV"} <= names
    assert "self-drafter copy" in "\n".join(mm.report_lines(mm.estimate_settings(arch, s)))


def _self_drafter_engine(folder, *overrides):
    """A tiny model's engine with the self-drafter, built from the config the trainer
    reads, after a greedy generate of 6 prompts: (arch, the memory settings, engine)."""
    import torch

    from megatron_tlt.models import load_model
    from megatron_tlt.rollout import RolloutEngine, SamplingParams
    from megatron_tlt.runtime_env import apply_cpu_redirection

    apply_cpu_redirection()
    model, arch = load_model(folder, device=torch.device("cpu"), dtype="float32")
    cfg = load_config(overrides=[
        f"model.hf_path={folder}", "platform.device=cpu", "model.dtype=float32",
        "grpo.prompts_per_step=3", "grpo.group_size=2", "grpo.max_new_tokens=6",
        "data.max_prompt_tokens=12", "rollout.max_batch_size=8",
        "rollout.speculative.drafter=self", "rollout.speculative.threshold=4", *overrides])
    s = mm.settings(cfg, 1, arch=arch)
    eng = RolloutEngine(model, None, cfg.rollout, arch=arch, eos_token_ids=[],
                        max_prompt_tokens=12, max_new_tokens=6, max_rows=s.rollout_rows)
    prompts = [[3, 5, 7, 11, 2], [2, 4], [9] * 12, [1, 2, 3], [8, 8], [5]]
    eng.generate(prompts, SamplingParams(temperature=0.0, max_new_tokens=6))
    if s.cpu_kernels:
        s = dataclasses.replace(s, panel_rows=eng.spec.draft.kernels.PANEL)
    return arch, s, eng


@pytest.mark.parametrize("kernels", ["true", "false"])
def test_self_drafter_terms_are_what_the_engine_holds(tiny_hf_dirs, single_process_parallel,
                                                      kernels):
    """A tiny model with QKV biases, the engine the trainer builds from the same config,
    after a generate: the copy's bytes (``SelfDraftRunner.nbytes``, every tensor it
    holds: tests/rollout/test_self_drafter_memory.py) and its KV cache's equal the
    model's terms exactly (with the CPU kernels, given their panel width)."""
    arch, s, eng = _self_drafter_engine(tiny_hf_dirs["qwen2"], f"rollout.cpu_kernels={kernels}")
    draft = eng.spec.draft
    assert draft._int8_kernels() == (kernels == "true") == s.cpu_kernels
    est = mm.estimate_settings(arch, s).as_dict()
    assert est["self-drafter copy"] == draft.nbytes
    assert est["self-drafter KV"] == eng.spec.cache.nbytes
    assert eng.spec.cache.max_batch == 4  # min(6 rows, threshold 4)
    assert eng.spec.cache.capacity == sd.copy_kv_positions(s, "int8")


def test_paged_self_drafter_cache_is_in_the_budget(tiny_hf_dirs, single_process_parallel):
    """rollout.kv_cache=paged: the copy's KV cache is a pool of the threshold's rows in
    blocks, the model's term equals its bytes, and the target's blocks take what the
    budget leaves (the engine's and the model's)."""
    gib = 0.004
    arch, s, eng = _self_drafter_engine(tiny_hf_dirs["qwen2"], "rollout.kv_cache=paged",
                                        "rollout.kv_block_size=4",
                                        f"rollout.kv_cache_gib={gib}")
    est = mm.estimate_settings(arch, s).as_dict()
    draft, target = eng.spec.cache, eng.memory.cache
    assert draft.paged and target.paged and draft.pool.used == 0
    assert est["self-drafter KV"] == draft.nbytes
    # 4 rows (the threshold) of 12 + 6 positions, the slack and the root, in blocks of 4
    assert draft.num_blocks == 4 * -(-(18 + s.draft_slack + 1) // 4) + 1
    held = draft.nbytes + target.nbytes - target.block_nbytes  # (its scratch block)
    assert gib * 2**30 - target.block_nbytes < held <= gib * 2**30
    assert est["KV cache"] + est["self-drafter KV"] == pytest.approx(gib * 2**30, rel=1e-9)


# ----------------------------------------------------------------------------- Qwen3 / MoE
@pytest.mark.parametrize("name", ["qwen3_tied", "qwen3_moe"])
def test_qwen3_and_moe_terms_are_what_the_engine_holds(qwen3_hf_dirs, single_process_parallel,
                                                       name):
    """The self-drafter's int8 copy of a tiny Qwen3 (QK norms) and Qwen3-MoE (int8
    experts, a float router) and, for the MoE model, the engine's stacked experts and
    the experts recorded beside the keys (``KVCache.routes``), after a generate with
    the self-drafter: each term equals the bytes the engine's tensors hold; the target's
    KV cache term too (its positions include the drafts' slack)."""
    arch, s, eng = _self_drafter_engine(qwen3_hf_dirs[name])
    draft = eng.spec.draft
    est = mm.estimate_settings(arch, s).as_dict()
    assert est["self-drafter copy"] == draft.nbytes
    assert est["self-drafter KV"] == eng.spec.cache.nbytes
    cache = eng.memory.cache
    assert cache.capacity == s.capacity + s.draft_slack and s.draft_slack > 0
    routes = 0 if cache.routes is None else cache.routes.nbytes
    assert est["KV cache"] == cache.nbytes - routes
    if not arch.is_moe:
        assert "stacked experts" not in est and cache.routes is None
        assert draft.nbytes == sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                                    for t in draft.own_tensors()}.values())
        return
    import torch

    experts = [t for lw in draft.layers for w in (lw.w13, lw.w2) if w is not None
               for t in w.tensors()]
    assert experts and all(t.dtype in (torch.int8, torch.float32) for t in experts)
    assert any(t.dtype == torch.int8 for t in experts)
    stacks = eng.runner._stacks
    assert len(stacks) == len(arch.moe_layers) == 3
    assert est["stacked experts"] == sum(t.nbytes for st in stacks for t in (st.w13, st.w2))
    assert routes > 0 and est["expert routes (KV)"] == routes


def test_moe_parameter_counts_are_the_built_models(qwen3_hf_dirs, single_process_parallel):
    """models/sizes.py on a tiny Qwen3-MoE: at TP = EP = 1 the built megatron-core
    model's parameters; at EP = 2 its dense part and half its experts; one token's
    active parameters are all but the experts its router did not choose."""
    import torch

    from megatron_tlt.models import load_model
    from megatron_tlt.models.sizes import (active_params, expert_params, stage_expert_params,
                                           stage_params)

    model, arch = load_model(qwen3_hf_dirs["qwen3_moe"], device=torch.device("cpu"),
                             dtype="float32")
    named = dict(model.named_parameters())
    total = sum(p.numel() for p in named.values())
    in_experts = sum(p.numel() for n, p in named.items() if ".experts." in n)
    one = sum(p.numel() for p in model.decoder.layers[0].mlp.experts.local_experts[0]
              .parameters())
    assert arch.moe_layers == (0, 2, 3) and arch.num_experts == 8 and arch.moe_topk == 2
    assert expert_params(arch) == one
    assert in_experts == len(arch.moe_layers) * arch.num_experts * one
    assert stage_params(arch, 1, 1, 0) == total
    assert stage_expert_params(arch, 1, 1, 0) == in_experts
    assert stage_params(arch, 1, 1, 0, ep=2) == total - in_experts / 2
    assert stage_expert_params(arch, 1, 1, 0, ep=2) == in_experts / 2
    unpadded = total - (arch.padded_vocab_size(1) - arch.vocab_size) * arch.hidden_size * (
        1 if arch.tie_word_embeddings else 2)
    assert arch.num_parameters == unpadded
    idle = len(arch.moe_layers) * (arch.num_experts - arch.moe_topk) * one
    assert active_params(arch) == unpadded - idle
