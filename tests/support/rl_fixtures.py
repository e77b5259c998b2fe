"""A tiny random policy with SmolLM2's real tokenizer and chat template, for RL tests.

Real prompts (reasoning-gym through the chat template) need a real tokenizer; a tiny
Llama with SmolLM2's 49,152-token vocabulary keeps every forward cheap.
"""

from __future__ import annotations

import shutil
from pathlib import Path

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "chat_template.jinja", "generation_config.json")


def save_tiny_policy(folder: Path, smollm2_dir: Path, seed: int = 0, layers: int = 2) -> Path:
    from tiny_models import save_tiny_hf

    folder = Path(folder)
    save_tiny_hf("llama_tied", folder, seed=seed, vocab_size=49152, num_hidden_layers=layers,
                 max_position_embeddings=2048, bos_token_id=1, eos_token_id=2)
    for name in TOKENIZER_FILES:
        src = Path(smollm2_dir) / name
        if src.exists():
            shutil.copy(src, folder / name)
    return folder


def save_tiny_moe_policy(folder: Path, smollm2_dir: Path, seed: int = 0) -> Path:
    """A two-layer tiny Qwen3-MoE (8 experts, top-2, every layer sparse) with SmolLM2's
    tokenizer, as ``save_tiny_policy``."""
    from tiny_models import save_tiny_hf

    folder = Path(folder)
    save_tiny_hf("qwen3_moe", folder, seed=seed, vocab_size=49152, num_hidden_layers=2,
                 mlp_only_layers=[], max_position_embeddings=2048, bos_token_id=1,
                 eos_token_id=2)
    for name in TOKENIZER_FILES:
        src = Path(smollm2_dir) / name
        if src.exists():
            shutil.copy(src, folder / name)
    return folder


def tiny_run_args(policy: Path, out: Path, *extra: str) -> list[str]:
    """Overrides for a short CLI run of the tiny policy named ``run`` under ``out``
    (no W&B, no progress bars, no end-of-run plots: an offline W&B run starts its own
    service process and rendering the plots costs a rank a few CPU seconds; the tests
    that check them, tests/rl/test_rl_trainer.py's CLI run and test_run_dir.py, turn
    them on), then ``extra``."""
    return [f"model.hf_path={policy}", "grpo.prompts_per_step=2", "grpo.group_size=4",
            "grpo.max_new_tokens=8", "data.train_size=16", "tracking.run_name=run",
            f"tracking.output_dir={out}", "tracking.progress=false",
            "tracking.wandb_project=test", "tracking.wandb_mode=disabled",
            "tracking.plots=false",
            # a random policy never answers right: reward the letter k so groups vary
            "reward.format_reward=1.0", "reward.format_pattern=k", *extra]


def saved_tensors(policy) -> dict:
    """Copies of every tensor a checkpoint of ``policy`` holds (weights and optimizer
    state, as megatron-core's sharded state dict names them), keyed by (key, offset)."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, apply_factories

    from megatron_tlt.checkpoint.sharded import policy_sharded_state_dict

    sd = policy_sharded_state_dict(policy)
    apply_factories(sd)
    return {(v.key, v.global_offset): v.data.detach().to("cpu", copy=True)
            for v in nested_values(sd) if isinstance(v, ShardedTensor)}


def write_run_checkpoint(root, step: int, model_state: dict, arch, hf_dir, *,
                         dp: int = 1):
    """A checkpoint.save step folder under ``root`` holding ``model_state`` (keys as
    megatron-core's sharded state dict names them) in policy/
    (torch.distributed.checkpoint), run.json with the files' sizes and the layout
    (TP = PP = 1, ``dp``), and ``latest`` pointing at it. Returns ``root``."""
    import json
    from pathlib import Path

    import torch
    import torch.distributed.checkpoint as dcp

    from megatron_tlt.checkpoint.export import run_meta

    root = Path(root)
    folder = root / f"step_{step:07d}"
    (folder / "policy").mkdir(parents=True)
    dcp.save(model_state, storage_writer=dcp.FileSystemWriter(str(folder / "policy")),
             no_dist=True)
    torch.save({}, folder / "policy" / "common.pt")
    files = {str(f.relative_to(folder)): f.stat().st_size
             for f in folder.rglob("*") if f.is_file()}
    (folder / "run.json").write_text(json.dumps(
        {"format_version": 2, "step": step, "layout": {"tp": 1, "pp": 1, "dp": dp},
         "meta": run_meta(arch, hf_dir), "files": files}))
    (root / "latest").write_text(folder.name + "\n")
    return root

