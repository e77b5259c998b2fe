"""HF <-> megatron weight conversion: bit-exact round trips, TP sharding, PP slicing, CLI."""

from __future__ import annotations

import pytest
import torch

from megatron_tlt.models.megatron_weights import load_megatron_shards, shard_for_rank
from megatron_tlt.models.gpt import ModelArch
from megatron_tlt.models.hf import (HFWeights, from_te_names, hf_to_megatron, megatron_to_hf,
                                    to_te_names)
from cli import run_main, run_script
from tiny_models import TINY_CONFIGS, VOCAB

LAYOUTS = [(1, 1), (2, 1), (1, 2), (2, 2)]


def _shards(hf, arch, tp, pp):
    return {(t, p): hf_to_megatron(hf, arch, tp_size=tp, tp_rank=t, pp_size=pp, pp_rank=p)
            for t in range(tp) for p in range(pp)}


@pytest.mark.parametrize("tp,pp", LAYOUTS)
@pytest.mark.parametrize("name", sorted(TINY_CONFIGS))
def test_round_trip_is_bit_exact(name, tp, pp, tiny_hf_dirs):
    arch = ModelArch.from_hf_folder(tiny_hf_dirs[name])
    hf = {k: v for k, v in HFWeights(tiny_hf_dirs[name]).items()}
    back = megatron_to_hf(_shards(hf, arch, tp, pp), arch, tp_size=tp, pp_size=pp)
    assert set(back) == set(hf)
    for key in hf:
        assert back[key].dtype == hf[key].dtype
        assert torch.equal(back[key], hf[key]), key


def test_tp_shards_partition_the_weights(tiny_hf_dirs):
    arch = ModelArch.from_hf_folder(tiny_hf_dirs["qwen2"])
    hf = HFWeights(tiny_hf_dirs["qwen2"])
    shards = _shards(hf, arch, 2, 1)
    emb = [shards[(t, 0)]["embedding.word_embeddings.weight"] for t in range(2)]
    assert [e.shape[0] for e in emb] == [126, 126]  # 251 padded to 252, split in two
    assert torch.count_nonzero(emb[1][-1]) == 0  # the padding row
    qkv = shards[(0, 0)]["decoder.layers.0.self_attention.linear_qkv.bias"]
    d, per = arch.kv_channels, arch.num_attention_heads // arch.num_query_groups
    # rank 0 owns query group 0: its q heads, then k, then v
    assert torch.equal(qkv[: per * d], hf["model.layers.0.self_attn.q_proj.bias"][: per * d])
    assert torch.equal(qkv[per * d: (per + 1) * d], hf["model.layers.0.self_attn.k_proj.bias"][:d])


def test_pp_stages_own_their_layers(tiny_hf_dirs):
    arch = ModelArch.from_hf_folder(tiny_hf_dirs["llama_tied"])
    hf = HFWeights(tiny_hf_dirs["llama_tied"])
    first, last = (hf_to_megatron(hf, arch, pp_size=2, pp_rank=r) for r in (0, 1))
    assert "embedding.word_embeddings.weight" in first and "output_layer.weight" not in first
    assert "decoder.final_layernorm.weight" in last
    # tied embeddings: the last stage carries the output copy of the embedding
    assert torch.equal(last["output_layer.weight"], hf["model.embed_tokens.weight"])
    assert torch.equal(last["decoder.layers.0.input_layernorm.weight"],
                       hf["model.layers.2.input_layernorm.weight"])


def test_te_names_round_trip(tiny_hf_dirs):
    arch = ModelArch.from_hf_folder(tiny_hf_dirs["llama_untied"])
    local = hf_to_megatron(HFWeights(tiny_hf_dirs["llama_untied"]), arch)
    te = to_te_names(local)
    assert "decoder.layers.0.self_attention.linear_qkv.layer_norm_weight" in te
    assert "decoder.layers.0.mlp.linear_fc1.layer_norm_weight" in te
    te["decoder.layers.0.self_attention.core_attention._extra_state"] = torch.empty(0)
    assert from_te_names(te).keys() == local.keys()


def _run_tool(*args):
    return run_script("tools/convert_hf_checkpoint.py", *args)


def _tool_main(*args):
    """The tool's main in this process (errors are turned into exit status 2 by main
    itself, so the status and messages are the command line's; the command line runs in
    test_cli_round_trip_and_transformers_loads_result)."""
    return run_main("tools/convert_hf_checkpoint.py", *args)


def test_cli_round_trip_and_transformers_loads_result(tiny_hf_dirs, tmp_path):
    from transformers import AutoModelForCausalLM

    src = tiny_hf_dirs["qwen2"]
    ckpt, back = tmp_path / "ckpt", tmp_path / "back"
    r = _run_tool("--out", str(ckpt), f"model.hf_path={src}",
                  "parallel.tensor_model_parallel_size=2", "parallel.pipeline_model_parallel_size=2")
    assert r.returncode == 0, r.stderr
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text() == "release"
    assert (ckpt / "release/mp_rank_01_001/model_optim_rng.pt").is_file()
    r = _tool_main("--out", str(back), f"model.hf_path={ckpt}")
    assert r.returncode == 0, r.stderr
    orig, new = HFWeights(src), HFWeights(back)
    assert set(orig) == set(new)
    assert all(torch.equal(orig[k], new[k]) for k in orig)
    a = AutoModelForCausalLM.from_pretrained(src).eval()
    b = AutoModelForCausalLM.from_pretrained(back).eval()
    ids = torch.randint(0, VOCAB, (2, 9))
    with torch.no_grad():
        assert torch.equal(a(ids).logits, b(ids).logits)


def test_checkpoint_reshards_on_load(tiny_hf_dirs, tmp_path):
    """A TP=2 checkpoint loaded at TP=1/PP=2 equals converting the HF folder directly."""
    src = tiny_hf_dirs["llama_untied"]
    assert _tool_main("--out", str(tmp_path / "c"), f"model.hf_path={src}",
                      "parallel.tensor_model_parallel_size=2").returncode == 0
    _, arch, meta = load_megatron_shards(tmp_path / "c")
    assert meta["tensor_model_parallel_size"] == 2
    for pp_rank in range(2):
        got = shard_for_rank(tmp_path / "c", arch, tp_size=1, tp_rank=0, pp_size=2,
                             pp_rank=pp_rank)
        want = hf_to_megatron(HFWeights(src), arch, pp_size=2, pp_rank=pp_rank)
        assert got.keys() == want.keys()
        assert all(torch.equal(got[k], want[k]) for k in want)


def test_cli_errors_are_clear(tiny_hf_dirs, tmp_path):
    r = _tool_main("--out", str(tmp_path / "x"), f"model.hf_path={tiny_hf_dirs['qwen2']}",
                   "parallel.tensor_model_parallel_size=3")
    assert r.returncode == 2
    assert "tensor_model_parallel_size=3 does not divide" in r.stderr
    r = _tool_main("--out", str(tmp_path / "y"), f"model.hf_path={tmp_path / 'missing'}")
    assert r.returncode == 2 and "does not exist" in r.stderr
    r = _tool_main("--out", str(tmp_path / "z"), "model.hf_path=smollm2",
                   "parallel.tensor_model_parallel_sz=2")
    assert r.returncode == 2 and "did you mean 'parallel.tensor_model_parallel_size'" in r.stderr


def test_heads_not_a_multiple_of_kv_heads_is_refused_before_writing(tiny_hf_dirs, tmp_path):
    """A config.json whose attention heads are not a multiple of its key/value heads (14
    and 3) ends in one line naming both fields, and nothing is written."""
    import json
    import shutil

    src = tmp_path / "bad"
    shutil.copytree(tiny_hf_dirs["llama_untied"], src)
    cfg = json.loads((src / "config.json").read_text())
    cfg.update(num_attention_heads=14, num_key_value_heads=3)
    (src / "config.json").write_text(json.dumps(cfg))
    r = _tool_main("--out", str(tmp_path / "out"), f"model.hf_path={src}")
    assert r.returncode == 2
    assert "num_attention_heads=14 is not a multiple of num_key_value_heads=3" in r.stderr
    assert "Traceback" not in r.stderr and not (tmp_path / "out").exists()


def test_sharded_hf_checkpoint_loads_lazily(tmp_path):
    """Big checkpoints come as several safetensors files with an index."""
    from tiny_models import build_tiny_hf

    folder = tmp_path / "sharded"
    build_tiny_hf("llama_untied").save_pretrained(folder, max_shard_size="100KB")
    assert (folder / "model.safetensors.index.json").is_file()
    weights = HFWeights(folder)
    whole = build_tiny_hf("llama_untied").state_dict()
    assert set(weights) == set(whole)
    assert all(torch.equal(weights[k], whole[k]) for k in whole)
    with pytest.raises(FileNotFoundError, match="no model.safetensors"):
        HFWeights(tmp_path)
