#!/usr/bin/env python
"""Measured peak memory of one GRPO step on CPU against the dry run's memory model.

    python tools/measure_memory.py                     # every cell, docs/results JSON
    python tools/measure_memory.py --cells small --json /tmp/m.json

Each cell runs in a fresh subprocess (``--cell``): a random Llama (SmolLM2's tokenizer
and 49,152-token vocabulary, tied embeddings) saved as a Hugging Face folder, then the
trainer's own code: ``launch.setup`` (the model loaded through ``models.load_model``),
``rl.trainer.Trainer`` and one ``Trainer.train_step`` (the rollout on the engine, the
old log-probs when the step needs them, the policy update through ``rl.policy.Policy``).
Two things are pinned so the step is the dry run's worst case and repeatable: the
verifier gives alternate responses reward 1 and 0 (every group has reward variance, so
every sample is trained), and the engine's end-of-sequence ids are cleared (every
response runs to ``grpo.max_new_tokens``). The prompts are one repeated text, so they
all have ``data.max_prompt_tokens`` tokens.

Memory is the resident set size. The baseline is the RSS after the imports (torch,
megatron-core, transformers), before the process group, the model or the tokenizer
exist; the peak of each phase is the kernel's high-water mark (``VmHWM``) reset at the
phase's start (``/proc/self/clear_refs`` 5) and read at its end, minus the baseline:

- build: ``launch.setup`` and the ``Trainer`` (weights, DDP's gradient buffers, ...);
- rollout: ``train_step`` up to the idle window (generation and rewards);
- update: the rest of the step (old / reference log-probs, the optimizer step).

The prediction is ``megatron_tlt.rl.memory_model.estimate`` for the same config, with
the rollout's KV cache counted as released before the update when the engine had
dropped it after the step (``rollout.release_memory``) and resident otherwise, and the
loss path the trainer ran (``rl/token_stats.py`` in chunks, or an inline loss with
full-size copies in a trainer that predates it).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
GIB = 1024 ** 3
MIB = 1024 ** 2

# (name, hidden, ffn, layers, heads, kv heads, responses, response tokens, micro-batch)
SHAPES = {
    "small": dict(hidden=256, ffn=768, layers=4, heads=4, kv_heads=2, responses=8,
                  new_tokens=128, micro_batch_size=4),
    "medium": dict(hidden=512, ffn=1536, layers=8, heads=8, kv_heads=4, responses=8,
                   new_tokens=256, micro_batch_size=2),
    "large": dict(hidden=768, ffn=2048, layers=6, heads=12, kv_heads=4, responses=4,
                  new_tokens=512, micro_batch_size=1),
}
RECOMPUTE = ("none", "selective", "full")
PROMPT_WORDS = 40  # the prompt text's words (about 60 tokens with the chat template)


# ------------------------------------------------------------------------ the model
def model_folder(shape: dict, root: Path) -> Path:
    """A random Llama of ``shape`` with SmolLM2's tokenizer files, made once."""
    key = "h{hidden}_f{ffn}_l{layers}_a{heads}_g{kv_heads}".format(**shape)
    folder = root / key
    if (folder / "config.json").exists():
        return folder
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from megatron_tlt.assets import require_smollm2

    smol = require_smollm2()
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=49152, hidden_size=shape["hidden"],
                      intermediate_size=shape["ffn"], num_hidden_layers=shape["layers"],
                      num_attention_heads=shape["heads"],
                      num_key_value_heads=shape["kv_heads"], tie_word_embeddings=True,
                      max_position_embeddings=2048, rope_theta=10000.0, rms_norm_eps=1e-5,
                      bos_token_id=1, eos_token_id=2)
    tmp = Path(tempfile.mkdtemp(dir=root))
    LlamaForCausalLM(cfg).save_pretrained(tmp)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                 "chat_template.jinja", "generation_config.json"):
        if (smol / name).exists():
            shutil.copy(smol / name, tmp / name)
    tmp.rename(folder)
    return folder


def prompt_file(root: Path) -> Path:
    path = root / "prompts.jsonl"
    if not path.exists():
        text = " ".join(["apple"] * PROMPT_WORDS)
        path.write_text("".join(json.dumps({"prompt": text, "answer": "1"}) + "\n"
                                for _ in range(8)))
    return path


def overrides(shape: dict, recompute: str, folder: Path, prompts: Path,
              prompt_tokens: int, cpu_kernels: str = "false",
              loss_chunk: int = 0) -> list[str]:
    """The cell's config: one step of ``responses`` samples (one group per 4)."""
    group = 4
    out = [f"model.hf_path={folder}", "platform.device=cpu", "model.dtype=float32",
           "data.source=jsonl", f"data.path={prompts}", "data.instruction=",
           "data.eval_size=0", "data.train_size=0", f"data.max_prompt_tokens={prompt_tokens}",
           f"grpo.prompts_per_step={shape['responses'] // group}", f"grpo.group_size={group}",
           f"grpo.max_new_tokens={shape['new_tokens']}", "grpo.dynamic_sampling=false",
           f"train.micro_batch_size={shape['micro_batch_size']}", "train.micro_batch_tokens=0",
           "train.steps=2", "train.eval_interval=0", f"rollout.cpu_kernels={cpu_kernels}",
           "tracking.progress=false"]
    if recompute != "none":
        out.append(f"train.recompute_granularity={recompute}")
    if loss_chunk:
        out.append(f"train.loss_chunk_tokens={loss_chunk}")
    return out


def prompt_tokens(folder: Path, prompts: Path) -> int:
    """Tokens of the cell's prompt after the chat template (every prompt is the same)."""
    from megatron_tlt.config import load_config
    from megatron_tlt.models import load_tokenizer
    from megatron_tlt.rl.data import build_prompt_sets

    cfg = load_config(overrides=[f"model.hf_path={folder}", "data.source=jsonl",
                                 f"data.path={prompts}", "data.instruction=",
                                 "data.eval_size=0"])
    train, _ = build_prompt_sets(cfg.data, load_tokenizer(folder))
    return max(len(p.token_ids) for p in train)


# ------------------------------------------------------------------------ one cell
def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _hwm() -> int:
    with open("/proc/self/status") as f:
        return int(re.search(r"VmHWM:\s+(\d+)\s+kB", f.read()).group(1)) * 1024


def _reset_hwm() -> None:
    """Return the allocator's free heap pages to the system (glibc keeps freed memory
    of one phase resident; the next phase would otherwise start with it counted), then
    restart the kernel's high-water mark from the current RSS."""
    import ctypes

    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:  # not glibc
        pass
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def _count_calls(module: str, name: str):
    """Count calls of ``module.name`` (looked up at call time by its callers)."""
    import importlib

    try:
        mod = importlib.import_module(module)
    except ImportError:
        return lambda: 0
    fn, calls = getattr(mod, name), [0]

    def counted(*a, **k):
        calls[0] += 1
        return fn(*a, **k)

    setattr(mod, name, counted)
    return lambda: calls[0]


def run_cell(argv: list[str]) -> dict:
    """One cell in this (fresh) process: returns the measured bytes per phase."""
    import megatron.core.distributed  # noqa: F401  (imports before the baseline)
    import megatron.core.optimizer  # noqa: F401
    import megatron.core.pipeline_parallel  # noqa: F401
    import torch
    import transformers  # noqa: F401

    from megatron_tlt.config import load_config
    from megatron_tlt.launch import setup, shutdown
    from megatron_tlt.rl.rewards import RewardResult
    from megatron_tlt.rl.trainer import Trainer
    from megatron_tlt.runtime_env import silence_expected_warnings

    silence_expected_warnings()
    torch.set_num_threads(1)
    cfg = load_config(overrides=argv)
    baseline = _rss()
    _reset_hwm()
    session = setup(cfg)
    trainer = Trainer(cfg, session)
    build = _hwm() - baseline

    class Alternating:  # rewards with variance in every group: every sample trains
        def score_many(self, prompts, texts):
            return [RewardResult(reward=float(i % 2), score=float(i % 2), correct=bool(i % 2),
                                 format_ok=True, answer=None) for i in range(len(texts))]

    trainer.verifier = Alternating()
    trainer.engine.eos_token_ids = ()  # every response runs to grpo.max_new_tokens
    phases = {}

    def end_of_rollout(step, roll):
        phases["rollout"] = _hwm() - baseline
        phases["kv_cache_bytes"] = int(roll.stats.get("kv_cache_bytes", 0) or 0) \
            if isinstance(roll.stats, dict) else 0
        phases["lengths"] = sorted({len(s.response_ids) for s in roll.samples})
        _reset_hwm()

    # step 1 creates the optimizer state; step 2 is the steady state the dry run models
    metrics = trainer.train_step(0)
    first = _hwm() - baseline
    trainer.idle_window_hooks.append(end_of_rollout)
    chunked = _count_calls("megatron_tlt.rl.token_stats", "token_stats")
    _reset_hwm()
    resident = _rss() - baseline  # weights, gradient buffers, optimizer state, KV cache
    metrics = trainer.train_step(1)
    phases["update"] = _hwm() - baseline
    mem = getattr(trainer.engine, "memory", None)  # the rollout's memory lifecycle
    released = (mem.cache is None or not mem.cache.allocated) if mem is not None \
        else trainer.engine._cache is None
    inline_loss = chunked() == 0  # the trainer's loss predates rl/token_stats.py
    out = {"baseline": baseline, "build": build, "rollout": phases["rollout"],
           "update": phases["update"], "first_step": first, "resident": resident,
           "peak": max(build, first, phases["rollout"], phases["update"]),
           "kv_released": released, "inline_loss": inline_loss, "lengths": phases["lengths"],
           "grad_norm": metrics["grad_norm"]}
    shutdown()
    return out


# ------------------------------------------------------------------------ the table
def predict(argv: list[str], kv_released: bool, inline_loss: bool) -> dict:
    from megatron_tlt.config import load_config
    from megatron_tlt.rl.memory_model import estimate
    from megatron_tlt.rl.plan import architecture

    cfg = load_config(overrides=argv)
    arch, _ = architecture(cfg)
    est = estimate(cfg, arch, world_size=1, kv_released=kv_released,
                   inline_loss=inline_loss)
    return {"rollout": est.rollout_total, "update": est.update_total, "peak": est.peak,
            "terms": {k: int(v) for k, v in est.as_dict().items()}}


def measure(shape_name: str, recompute: str, root: Path, cpu_kernels: str = "false",
            timeout: int = 900, loss_chunk: int = 0) -> dict:
    shape = SHAPES[shape_name]
    folder = model_folder(shape, root)
    prompts = prompt_file(root)
    tokens = prompt_tokens(folder, prompts)
    argv = overrides(shape, recompute, folder, prompts, tokens, cpu_kernels, loss_chunk)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    r = subprocess.run([sys.executable, __file__, "--cell",
                        json.dumps({"argv": argv})], env=env,
                       capture_output=True, text=True, timeout=timeout, cwd=REPO)
    if r.returncode != 0:
        raise RuntimeError(f"cell {shape_name}/{recompute} failed:\n{r.stderr[-4000:]}")
    got = json.loads(r.stdout.strip().splitlines()[-1])
    pred = predict(argv, got["kv_released"], got["inline_loss"])
    cell = {"shape": shape_name, **shape, "recompute": recompute, "cpu_kernels": cpu_kernels,
            "prompt_tokens": tokens, "config": argv[1:], "measured": got,
            "predicted": pred}
    cell["error_pct"] = {k: 100.0 * (pred[k] - got[k]) / got[k]
                         for k in ("rollout", "update", "peak")}
    return cell


def _loss(cell: dict) -> str:
    """inline (a trainer before grpo.micro_batch_loss), or chunked N (its chunk rows)."""
    if cell["measured"].get("inline_loss"):
        return "inline"
    key = "train.loss_chunk_tokens="
    chunk = [c[len(key):] for c in cell["config"] if c.startswith(key)]
    return f"chunked {chunk[0] if chunk else 1024}"


def repredict(cell: dict, root: Path) -> dict:
    """``cell`` with its prediction and errors recomputed from its recorded config."""
    folder = model_folder(SHAPES[cell["shape"]], root)
    got = cell["measured"]
    cell["predicted"] = predict([f"model.hf_path={folder}", *cell["config"]],
                                got["kv_released"], got["inline_loss"])
    cell["error_pct"] = {k: 100.0 * (cell["predicted"][k] - got[k]) / got[k]
                         for k in ("rollout", "update", "peak")}
    return cell


def markdown(cells: list[dict]) -> str:
    rows = ["| shape | recompute | loss | predicted rollout | predicted update | "
            "predicted peak | measured rollout | measured update | measured peak | "
            "peak error |",
            "|---|---|---|---|---|---|---|---|---|---|"]
    for c in cells:
        p, m = c["predicted"], c["measured"]
        rows.append(
            f"| {c['shape']}: h {c['hidden']}, {c['layers']} layers, {c['responses']} x "
            f"{c['prompt_tokens']}+{c['new_tokens']} tokens, micro-batch "
            f"{c['micro_batch_size']} | {c['recompute']} | {_loss(c)} | "
            f"{p['rollout'] / MIB:.0f} MiB | "
            f"{p['update'] / MIB:.0f} MiB | {p['peak'] / MIB:.0f} MiB | "
            f"{m['rollout'] / MIB:.0f} MiB | {m['update'] / MIB:.0f} MiB | "
            f"{m['peak'] / MIB:.0f} MiB | {c['error_pct']['peak']:+.1f} % |")
    return "\n".join(rows)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[1])
    ap.add_argument("--cell", help=argparse.SUPPRESS)
    ap.add_argument("--cells", default=",".join(SHAPES), help="shapes, comma-separated")
    ap.add_argument("--recompute", default=",".join(RECOMPUTE))
    ap.add_argument("--cpu-kernels", default="false")
    ap.add_argument("--loss-chunk", type=int, default=0,
                    help="train.loss_chunk_tokens of the cells (0: the config's default)")
    ap.add_argument("--append", action="store_true", help="add to the cells in --json")
    ap.add_argument("--repredict", action="store_true",
                    help="recompute the predictions of the cells in --json (the model "
                         "changed; the measurements stay)")
    ap.add_argument("--models", default=str(Path(tempfile.gettempdir()) / "megatron_tlt_mem"),
                    help="folder for the random models (kept between runs)")
    ap.add_argument("--json", default=str(REPO / "docs/results/memory_model_cpu.json"))
    args = ap.parse_args(argv)
    if args.cell:
        cell = json.loads(args.cell)
        cell = cell if isinstance(cell, dict) else {"argv": cell}
        print(json.dumps(run_cell(cell["argv"])))
        return 0
    root = Path(args.models)
    root.mkdir(parents=True, exist_ok=True)
    out = Path(args.json)
    if args.repredict:
        cells = [repredict(c, root) for c in json.loads(out.read_text())["cells"]]
        out.write_text(json.dumps({"cells": cells}, indent=1) + "\n")
        print(markdown(cells))
        return 0
    cells = json.loads(out.read_text())["cells"] if args.append and out.exists() else []
    for shape in args.cells.split(","):
        for rc in args.recompute.split(","):
            cell = measure(shape, rc, root, args.cpu_kernels, loss_chunk=args.loss_chunk)
            print(f"{shape:7s} {rc:9s} predicted {cell['predicted']['peak'] / MIB:7.0f} MiB "
                  f"measured {cell['measured']['peak'] / MIB:7.0f} MiB "
                  f"({cell['error_pct']['peak']:+.1f} %)", flush=True)
            cells.append(cell)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"cells": cells}, indent=1) + "\n")
    print(markdown(cells))
    return 0


if __name__ == "__main__":
    sys.exit(main())
