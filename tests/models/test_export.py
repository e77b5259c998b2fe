"""Trained runs -> Hugging Face: run checkpoints at any TP/PP, the end-of-run export,
the drafter as a standalone file the engine loads."""

from __future__ import annotations

import json
import math

import pytest
import torch

from megatron_tlt.checkpoint.export import ExportError, export_run_checkpoint
from megatron_tlt.models.gpt import ModelArch
from megatron_tlt.models.hf import HFWeights, hf_to_megatron, to_te_names
from cli import run_main, run_script
from rl_fixtures import save_tiny_policy, write_run_checkpoint

UPDATE = ["grpo.prompts_per_step=4", "grpo.group_size=2", "train.micro_batch_size=4",
          "train.lr=1e-2", "data.train_size=16", "rollout.cpu_kernels=false"]


def _fake_run_checkpoint(root, hf_dir, step: int, te_names: bool = False):
    """A checkpoint.save folder holding one step of ``hf_dir``'s weights, laid out as
    checkpoint.save writes it: the model in policy/ (torch.distributed.checkpoint, the
    per-layer tensors stacked on a layer axis under TransformerEngine names, as
    megatron-core's sharded state dict keys them) and run.json with the file sizes."""
    arch = ModelArch.from_hf_folder(hf_dir)
    model = to_te_names(hf_to_megatron(HFWeights(hf_dir), arch, tp_size=1, tp_rank=0,
                                       pp_size=1, pp_rank=0))
    stacked: dict = {}
    for key, value in model.items():
        parts = key.split(".")
        if key.startswith("decoder.layers."):
            stacked.setdefault("decoder.layers." + ".".join(parts[3:]), []).append(value)
        else:
            stacked[key] = value
    sd = {k: torch.stack(v) if isinstance(v, list) else v for k, v in stacked.items()}
    if not te_names:
        sd["optimizer.state.exp_avg.embedding.word_embeddings.weight"] = torch.zeros(1)
    return write_run_checkpoint(root, step, sd, arch, hf_dir)


@pytest.mark.parametrize("te", [False, True])
def test_run_checkpoint_exports_bit_exact(te, tiny_hf_dirs, tmp_path):
    src = tiny_hf_dirs["llama_untied"]
    run = _fake_run_checkpoint(tmp_path / "ckpt", src, 5, te_names=te)
    out = export_run_checkpoint(run, tmp_path / "hf")
    orig, new = HFWeights(src), HFWeights(out)
    assert set(orig) == set(new)
    assert all(torch.equal(orig[k], new[k]) for k in orig)
    assert json.loads((out / "config.json").read_text())["dtype"] == "float32"
    assert not (out / "drafter").exists()


def test_newest_step_by_default_or_a_named_one(tiny_hf_dirs, tmp_path):
    old, new = tiny_hf_dirs["llama_tied"], tiny_hf_dirs["qwen2"]
    root = tmp_path / "ckpt"
    _fake_run_checkpoint(root, old, 2)
    _fake_run_checkpoint(root, new, 4)  # the newest, marked latest
    r = run_script("tools/convert_hf_checkpoint.py", "--out", tmp_path / "a",
                   f"model.hf_path={root}")
    assert r.returncode == 0, r.stderr
    assert "q_proj.bias" in " ".join(HFWeights(tmp_path / "a"))  # qwen2: step 4
    # --step: the same entry point's main in this process (no second interpreter start)
    r = run_main("tools/convert_hf_checkpoint.py", "--out", tmp_path / "b",
                 f"model.hf_path={root}", "--step", "2")
    assert r.returncode == 0, r.stderr
    assert set(HFWeights(tmp_path / "b")) == set(HFWeights(old))
    r = run_main("tools/convert_hf_checkpoint.py", "--out", tmp_path / "c",
                 f"model.hf_path={root}", "--step", "3")
    assert r.returncode == 2 and "no checkpoint of step 3; saved steps: [2, 4]" in r.stderr
    assert "Traceback" not in r.stderr


def test_export_errors_name_the_fix(tiny_hf_dirs, tmp_path):
    root = _fake_run_checkpoint(tmp_path / "ckpt", tiny_hf_dirs["qwen2"], 1)
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("")
    with pytest.raises(FileExistsError, match="not empty"):
        export_run_checkpoint(root, tmp_path / "full")
    (root / "step_0000001" / "policy" / "__0_0.distcp").unlink()
    with pytest.raises(ExportError, match="__0_0.distcp: missing"):
        export_run_checkpoint(root, tmp_path / "out")
    with pytest.raises(ExportError, match="no complete run checkpoint"):
        export_run_checkpoint(tmp_path / "full", tmp_path / "out2")


# -------------------------------------------------------------------------------------
# a real TP=2 run (torchrun, gloo): update, run checkpoint, end-of-run export
# -------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tp2_run(smollm2_dir, tmp_path_factory, single_process_parallel):
    from megatron_tlt.models import arch_from_source
    from megatron_tlt.models.drafter import DrafterConfig, EagleDrafter, save_drafter

    root = tmp_path_factory.mktemp("export_tp2")
    policy = save_tiny_policy(root / "policy", smollm2_dir)
    arch = arch_from_source(policy)
    drafter = save_drafter(EagleDrafter(DrafterConfig.for_target(arch), arch),
                           root / "d.safetensors")
    r = run_script("tests/support/mp_export_worker.py", "--out", root / "run",
                   f"model.hf_path={policy}", "parallel.tensor_model_parallel_size=2",
                   f"rollout.speculative.drafter={drafter}", *UPDATE, nproc=2, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    return {"policy": policy, "run": root / "run", "drafter": drafter,
            "trained": torch.load(root / "run" / "trained.pt", weights_only=True)}


@pytest.mark.multiproc
def test_tp2_run_checkpoint_to_transformers_gives_the_trained_logits(tp2_run, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    # the tool's main in this process (test_newest_step_by_default_or_a_named_one
    # runs its command line on a run checkpoint)
    r = run_main("tools/convert_hf_checkpoint.py", "--out", tmp_path / "hf",
                 f"model.hf_path={tp2_run['run'] / 'ckpt'}")
    assert r.returncode == 0, r.stderr
    trained = tp2_run["trained"]
    ids = trained["ids"]
    with torch.no_grad():
        initial = AutoModelForCausalLM.from_pretrained(tp2_run["policy"]).eval()(ids).logits
        assert (initial - trained["logits"]).abs().max() > 1e-2  # the update moved it
        for folder in (tmp_path / "hf", tp2_run["run"] / "live_hf"):  # tool, export_hf
            model = AutoModelForCausalLM.from_pretrained(folder).eval()
            assert model.dtype == torch.float32
            torch.testing.assert_close(model(ids).logits, trained["logits"], atol=1e-4,
                                       rtol=1e-4)
            assert AutoTokenizer.from_pretrained(folder).eos_token is not None


@pytest.mark.multiproc
def test_exported_drafter_is_the_trained_one_and_the_engine_speculates_with_it(tp2_run):
    from megatron_tlt.config import RolloutConfig, SpeculativeConfig
    from megatron_tlt.models import arch_from_source
    from megatron_tlt.models.drafter import load_drafter
    from megatron_tlt.rollout import RolloutEngine, SamplingParams

    hf = tp2_run["run"] / "live_hf"
    info = json.loads((hf / "drafter" / "config.json").read_text())
    assert info["target"]["hf_folder"] == ".." and info["target"]["step"] == 1
    assert info["target"]["hidden_size"] == arch_from_source(hf).hidden_size
    drafter = load_drafter(hf / "drafter", arch_from_source(hf))
    want = tp2_run["trained"]["drafter"]
    got = drafter.own_state()
    assert got.keys() == want.keys()
    assert all(torch.equal(got[k], want[k]) for k in want)
    engine = RolloutEngine.from_pretrained(hf, RolloutConfig(
        cpu_kernels="false", speculative=SpeculativeConfig(
            drafter=str(hf / "drafter"), policy="fixed", strategy="2_1_2")))
    engine.generate([[1, 5, 9, 13]], SamplingParams(max_new_tokens=6, ignore_eos=True))
    assert engine.last_stats.summary()["spec"]["steps"] > 0


def test_cli_run_exports_at_the_end_and_evaluates_before_and_after(smollm2_dir, tmp_path,
                                                                    single_process_parallel):
    from transformers import AutoModelForCausalLM

    from megatron_tlt.models import arch_from_source
    from megatron_tlt.models.drafter import DrafterConfig, EagleDrafter, save_drafter

    policy = save_tiny_policy(tmp_path / "policy", smollm2_dir)
    arch = arch_from_source(policy)
    drafter = save_drafter(EagleDrafter(DrafterConfig.for_target(arch), arch),
                           tmp_path / "d.safetensors")
    r = run_script("pretrain_rl_tlt.py", f"model.hf_path={policy}", "grpo.prompts_per_step=2",
                   "grpo.group_size=2", "grpo.max_new_tokens=6", "train.steps=1",
                   "data.train_size=8", "data.eval_size=3", "train.eval_interval=5",
                   f"tracking.output_dir={tmp_path / 'out'}", "tracking.run_name=run",
                   "tracking.progress=false", "tracking.wandb_project=",
                   "checkpoint.export_hf=true", f"rollout.speculative.drafter={drafter}",
                   timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    run = tmp_path / "out" / "run"
    records = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in records if "eval/accuracy_lo" in x] == [0, 1]
    assert "held-out" in r.stdout and f"HF export  : {run / 'hf'}" in r.stdout
    assert not (run / "wandb").exists()  # tracking.wandb_project= : W&B off
    assert AutoModelForCausalLM.from_pretrained(run / "hf").config.vocab_size == arch.vocab_size
    assert (run / "hf" / "drafter" / "drafter.safetensors").is_file()
    # the export (not the run folder) is what model.hf_path takes; a run checkpoint is
    # refused with the way to resume or export it
    r = run_script("tools/generate.py", f"model.hf_path={run / 'hf'}",
                   "generate.max_new_tokens=2")
    assert r.returncode == 0, r.stderr[-3000:]
    fake = _fake_run_checkpoint(tmp_path / "ckpt", policy, 1)
    r = run_script("tools/generate.py", f"model.hf_path={fake}")
    assert r.returncode == 2 and "is a run checkpoint" in r.stderr and "Traceback" not in r.stderr


def test_export_folder_follows_the_umask(tiny_hf_dirs, tmp_path):
    import os

    run = _fake_run_checkpoint(tmp_path / "ckpt", tiny_hf_dirs["qwen2"], 1)
    mask = os.umask(0o022)
    try:
        out = export_run_checkpoint(run, tmp_path / "hf")
    finally:
        os.umask(mask)
    assert out.stat().st_mode & 0o777 == 0o755
    assert (out / "model.safetensors").stat().st_mode & 0o777 == 0o644


@pytest.mark.multiproc
def test_tp2_run_checkpoint_resumes_at_tp1_with_the_trained_weights(tp2_run):
    """The TP=2 checkpoint loads into a TP=1 trainer (resharded by dist_checkpointing):
    the trained logits, the optimizer state and the drafter come back, and it trains on."""
    from megatron_tlt.config import load_config
    from megatron_tlt.launch import setup
    from megatron_tlt.models.inference import forward_local_logits, gather_logits
    from megatron_tlt.rl.trainer import Trainer

    cfg = load_config([], [f"model.hf_path={tp2_run['policy']}",
                           f"rollout.speculative.drafter={tp2_run['drafter']}", *UPDATE])
    session = setup(cfg)
    trainer = Trainer(cfg, session)
    trainer.resume(tp2_run["run"] / "ckpt")
    assert trainer.state.step == 1
    trained = tp2_run["trained"]
    with torch.no_grad():
        logits = gather_logits(forward_local_logits(trainer.policy.module, trained["ids"]),
                               session.arch)
    torch.testing.assert_close(logits.float(), trained["logits"], rtol=1e-5, atol=1e-5)
    drafter = trainer.state.drafter.own_state()
    assert all(torch.equal(drafter[k], v) for k, v in trained["drafter"].items())
    opt = trainer.policy.optimizer
    inner = opt.chained_optimizers[0].optimizer if hasattr(opt, "chained_optimizers") else opt
    moments = list(inner.state.values())
    assert moments and all(s["exp_avg"].abs().sum() > 0 for s in moments)
    metrics = trainer.train_step(1)
    assert trainer.state.step == 2 and math.isfinite(metrics["loss/total"])
