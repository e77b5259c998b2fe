"""Qwen3 dense and Qwen3-MoE: megatron-core models vs transformers (one process),
HF <-> megatron conversion at TP / PP / EP, and the errors of unsupported or broken
checkpoints. Multi-process parity (TP=2, PP=2, EP=2) is in test_multiproc.py."""

from __future__ import annotations

import json

import pytest
import torch

from megatron_tlt.models import load_model
from megatron_tlt.models.gpt import ModelArch, UnsupportedModelError
from megatron_tlt.models.hf import HFWeights, expected_hf_keys, hf_to_megatron, megatron_to_hf
from megatron_tlt.models.inference import forward_local_logits, gather_logits, token_logprobs
from cli import run_main
from rl_fixtures import write_run_checkpoint
from tiny_models import QWEN3_CONFIGS, VOCAB, build_tiny_hf

TOL = 1e-4


@pytest.mark.parametrize("name", sorted(QWEN3_CONFIGS))
def test_logits_match_transformers(name, qwen3_hf_dirs, single_process_parallel):
    hf = build_tiny_hf(name)
    model, arch = load_model(qwen3_hf_dirs[name], device=torch.device("cpu"), dtype="float32")
    ids = torch.randint(0, VOCAB, (3, 17), generator=torch.Generator().manual_seed(0))
    targets = torch.roll(ids, -1, dims=1)
    with torch.no_grad():
        ref = hf(ids).logits
        local = forward_local_logits(model, ids)
        logits = gather_logits(local, arch)
        lp = token_logprobs(local, targets, arch)
    assert (logits - ref).abs().max().item() <= TOL
    ref_lp = torch.log_softmax(ref.double(), -1).gather(-1, targets[..., None])[..., 0]
    assert (lp.double() - ref_lp).abs().max().item() <= TOL
    assert torch.equal(logits.argmax(-1), ref.argmax(-1))


def test_arch_reads_the_families(qwen3_hf_dirs):
    dense = ModelArch.from_hf_folder(qwen3_hf_dirs["qwen3_tied"])
    assert dense.qk_layernorm and not dense.qkv_bias and dense.kv_channels == 24
    assert dense.kv_channels * dense.num_attention_heads != dense.hidden_size
    assert dense.tie_word_embeddings and not dense.is_moe
    moe = ModelArch.from_hf_folder(qwen3_hf_dirs["qwen3_moe"])
    assert (moe.num_experts, moe.moe_topk, moe.moe_ffn_hidden_size) == (8, 2, 32)
    assert moe.moe_layers == (0, 2, 3) and moe.moe_norm_topk_prob  # mlp_only_layers=[1]
    unnormed = ModelArch.from_hf_folder(qwen3_hf_dirs["qwen3_moe_unnormed"])
    assert not unnormed.moe_norm_topk_prob and unnormed.moe_layers == (0, 1)
    # every parameter counted: the transformers model's own count
    for name in ("qwen3_untied", "qwen3_moe"):
        arch = ModelArch.from_hf_folder(qwen3_hf_dirs[name])
        assert arch.num_parameters == sum(p.numel() for p in build_tiny_hf(name).parameters())


# (TP, PP, EP) layouts; EP applies to the MoE models whose experts it divides, PP to
# the layer counts it divides
LAYOUTS = [(1, 1, 1), (2, 1, 1), (1, 2, 1), (2, 2, 1), (1, 1, 2), (2, 2, 2), (1, 1, 4)]
CASES = [(name, tp, pp, ep) for name, c in sorted(QWEN3_CONFIGS.items())
         for tp, pp, ep in LAYOUTS
         if c["num_hidden_layers"] % pp == 0 and (ep == 1 or c.get("num_experts", 0) % ep == 0
                                                 and c.get("num_experts", 0))]


@pytest.mark.parametrize("name,tp,pp,ep", CASES)
def test_round_trip_is_bit_exact(name, tp, pp, ep, qwen3_hf_dirs):
    arch = ModelArch.from_hf_folder(qwen3_hf_dirs[name])
    hf = dict(HFWeights(qwen3_hf_dirs[name]))
    assert set(hf) == set(expected_hf_keys(arch))
    shards = {(t, p, e): hf_to_megatron(hf, arch, tp_size=tp, tp_rank=t, pp_size=pp,
                                        pp_rank=p, ep_size=ep, ep_rank=e)
              for t in range(tp) for p in range(pp) for e in range(ep)}
    if ep == 1:
        shards = {k[:2]: v for k, v in shards.items()}
    back = megatron_to_hf(shards, arch, tp_size=tp, pp_size=pp, ep_size=ep)
    assert set(back) == set(hf)
    for key in hf:
        assert back[key].dtype == hf[key].dtype and torch.equal(back[key], hf[key]), key


def test_expert_shards_hold_their_experts(qwen3_hf_dirs):
    arch = ModelArch.from_hf_folder(qwen3_hf_dirs["qwen3_moe"])
    hf = HFWeights(qwen3_hf_dirs["qwen3_moe"])
    rank1 = hf_to_megatron(hf, arch, ep_size=2, ep_rank=1)
    # EP rank 1 of 2 holds experts 4..7 as local experts 0..3; the dense layer 1 and the
    # router are whole on every rank
    fc2 = rank1["decoder.layers.0.mlp.experts.local_experts.0.linear_fc2.weight"]
    assert torch.equal(fc2, hf["model.layers.0.mlp.experts.4.down_proj.weight"])
    assert "decoder.layers.0.mlp.experts.local_experts.4.linear_fc1.weight" not in rank1
    assert rank1["decoder.layers.0.mlp.router.weight"].shape == (8, 64)
    assert "decoder.layers.1.mlp.linear_fc1.weight" in rank1
    assert torch.equal(rank1["decoder.layers.0.self_attention.q_layernorm.weight"],
                       hf["model.layers.0.self_attn.q_norm.weight"])


def test_converted_ep_checkpoint_loads_back(qwen3_hf_dirs, tmp_path):
    """The CLI at TP=2 x EP=2 writes Megatron-LM's rank folders; converted back it is
    the source, bit for bit."""
    src = qwen3_hf_dirs["qwen3_moe"]
    ckpt, back = tmp_path / "ckpt", tmp_path / "back"
    r = run_main("tools/convert_hf_checkpoint.py", "--out", ckpt, f"model.hf_path={src}",
                 "parallel.tensor_model_parallel_size=2",
                 "parallel.expert_model_parallel_size=2")
    assert r.returncode == 0, r.stderr
    assert (ckpt / "release/mp_rank_01_001/model_optim_rng.pt").is_file()
    meta = json.loads((ckpt / "megatron_tlt.json").read_text())
    assert meta["expert_model_parallel_size"] == 2
    r = run_main("tools/convert_hf_checkpoint.py", "--out", back, f"model.hf_path={ckpt}")
    assert r.returncode == 0, r.stderr
    a, b = HFWeights(src), HFWeights(back)
    assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)


# ----------------------------------------------------------------------------- errors

def _moe_config(**changes) -> dict:
    spec = {k: v for k, v in QWEN3_CONFIGS["qwen3_moe"].items() if k != "family"}
    return {"model_type": "qwen3_moe", **spec, **changes}


def test_unsupported_family_lists_the_supported_ones():
    with pytest.raises(UnsupportedModelError) as e:
        ModelArch.from_hf_config({**_moe_config(), "model_type": "deepseek_v3"})
    msg = str(e.value)
    assert "'deepseek_v3' is not supported" in msg and "\n" not in msg
    for t in ("llama", "qwen2", "qwen3", "qwen3_moe"):
        assert t in msg


@pytest.mark.parametrize("change,field", [
    (dict(num_experts_per_tok=9), "num_experts_per_tok"),   # top-k > experts
    (dict(attention_bias=True), "attention_bias"),
    (dict(use_sliding_window=True), "use_sliding_window"),
    (dict(mlp_only_layers=[0, 1, 2, 3]), "mlp_only_layers"),
    (dict(hidden_act="gelu"), "hidden_act"),
])
def test_bad_moe_configs_name_the_field(change, field):
    with pytest.raises(UnsupportedModelError) as e:
        ModelArch.from_hf_config(_moe_config(**change))
    assert f"config.json: {field}=" in str(e.value) and "\n" not in str(e.value)


def test_conversion_errors_write_nothing(qwen3_hf_dirs, tmp_path):
    """Experts that EP does not divide, and a checkpoint whose expert tensors are
    missing: one line naming the field or the tensor, no output folder."""
    src = qwen3_hf_dirs["qwen3_moe"]
    out = tmp_path / "a"
    r = run_main("tools/convert_hf_checkpoint.py", "--out", out, f"model.hf_path={src}",
                 "parallel.expert_model_parallel_size=3")
    assert r.returncode == 2 and not out.exists()
    assert "parallel.expert_model_parallel_size=3 does not divide the model's 8 experts" \
        in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1
    broken = tmp_path / "broken"
    broken.mkdir()
    from safetensors.torch import save_file

    state = {k: v for k, v in HFWeights(src).items() if ".experts.5." not in k}
    save_file(state, str(broken / "model.safetensors"))
    (broken / "config.json").write_text((src / "config.json").read_text())
    out = tmp_path / "b"
    r = run_main("tools/convert_hf_checkpoint.py", "--out", out, f"model.hf_path={broken}")
    assert r.returncode == 2 and not out.exists()
    assert "model.layers.0.mlp.experts.5.gate_proj.weight" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1


def test_expert_parallel_needs_experts(qwen3_hf_dirs, tmp_path):
    r = run_main("tools/convert_hf_checkpoint.py", "--out", tmp_path / "c",
                 f"model.hf_path={qwen3_hf_dirs['qwen3_tied']}",
                 "parallel.expert_model_parallel_size=2")
    assert r.returncode == 2 and "needs a mixture-of-experts model" in r.stderr


def test_start_up_checks_accept_drafters_for_qwen3_and_moe(qwen3_hf_dirs):
    """The checks ``launch.setup`` runs before any process group: the self-drafter,
    a one-layer drafter with the drafter group at DP = 2, and both kinds together, on
    Qwen3 and Qwen3-MoE."""
    from megatron_tlt.config import load_config
    from megatron_tlt.models import arch_from_source
    from megatron_tlt.validation import validate

    for name in ("qwen3_tied", "qwen3_moe"):
        arch = arch_from_source(qwen3_hf_dirs[name])
        for over in (["rollout.speculative.drafter=self"], ["drafter_group.enable=true"],
                     ["rollout.speculative.drafter=/d.safetensors",
                      "rollout.speculative.kinds.self.also=true"]):
            cfg = load_config([], [f"model.hf_path={qwen3_hf_dirs[name]}", *over])
            validate(cfg, arch, 2)


def test_moe_run_checkpoint_exports_bit_exact(qwen3_hf_dirs, tmp_path):
    """A run checkpoint of an MoE policy as megatron-core's sharded state dict writes it
    (per-layer keys: the layers' specs differ; TE norm names; each MoE layer's experts
    stacked on an expert axis under ``mlp.experts.experts``) exports to the source HF
    weights, bit for bit."""
    from megatron_tlt.checkpoint.export import export_run_checkpoint
    from megatron_tlt.models.hf import to_te_names

    src = qwen3_hf_dirs["qwen3_moe"]
    arch = ModelArch.from_hf_folder(src)
    local = to_te_names(hf_to_megatron(HFWeights(src), arch))
    sd: dict = {}
    for key, value in local.items():
        if ".local_experts." in key:
            head, rest = key.split(".local_experts.")
            e, name = rest.split(".", 1)
            sd.setdefault(f"{head}.experts.{name}", {})[int(e)] = value
        else:
            sd[key] = value
    sd = {k: torch.stack([v[e] for e in sorted(v)]) if isinstance(v, dict) else v
          for k, v in sd.items()}
    assert sd["decoder.layers.0.mlp.experts.experts.linear_fc1.weight"].shape == (8, 64, 64)
    write_run_checkpoint(tmp_path / "ckpt", 3, sd, arch, src, dp=2)
    out = export_run_checkpoint(tmp_path / "ckpt", tmp_path / "hf")
    a, b = HFWeights(src), HFWeights(out)
    assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)
