#!/usr/bin/env python
"""Measured peak memory of GRPO steps on CPU against the dry run's memory model.

    python tools/measure_memory.py --grid                  # the validation grid
    python tools/measure_memory.py --cells fit             # the cells the model was fitted on
    python tools/measure_memory.py --cells NAME,NAME --json /tmp/m.json
    python tools/measure_memory.py --cells NAME --trace    # live tensors at the peaks

Each cell runs in a fresh subprocess (``--cell``): a random Llama (or a Qwen3-MoE,
``MOE``; SmolLM2's tokenizer and 49,152-token vocabulary, tied embeddings) saved as a
Hugging Face folder, then the trainer's own code: ``launch.setup``, ``rl.trainer.Trainer`` and two
``Trainer.train_step``s (the rollout on the engine, the old / reference log-probs when
the step needs them, the policy update through ``rl.policy.Policy``). Pinned so a step
is repeatable: the verifier gives alternate responses reward 1 and 0 (every group has
reward variance, so every sample is trained), and each response runs to its cell's
length (``lengths``, cycled over the responses; the engine stops it there, below
``grpo.max_new_tokens`` when the cell says so; EOS is ignored). The prompts are one
repeated text; ``data.max_prompt_tokens`` is the cell's cap, at or above their length.

Memory is the resident set size of the whole process, as ``/usr/bin/time -v`` reports
it (the libraries' pages included): the kernel's high-water mark (``VmHWM``), restarted
at each phase's start (``/proc/self/clear_refs`` 5, without returning the heap's free
pages: what the process really holds) and read at its end, for both steps:

- build: ``launch.setup`` and the ``Trainer`` (weights, gradient buffers, Adam state);
- rollout: ``train_step`` up to the idle window (generation and rewards);
- log-probs: from there to the update (the old / reference log-probs' forwards);
- update: the policy update (forward, loss and backward per micro-batch, the
  optimizer step).

The prediction is ``megatron_tlt.rl.memory_model.estimate`` for the same config, given
the responses' real lengths (the micro-batches the trainer builds from them) and with
the rollout's KV cache as the engine had it (released before the update or kept); the
dry run's bound (``estimate`` without lengths: the worst micro-batch the budget allows)
is recorded beside it. ``--trace`` adds, per phase after the rollout, the live tensors
at the phase's peak grouped by what allocated them (torch's profiler; slow).
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
SMALL = 32 * MIB  # glibc's largest dynamic mmap threshold: smaller blocks are its heap's
LARGE = 48 * MIB  # --trace lists allocations and frees of at least this size
PROMPT_WORDS = 40  # the prompt text's words (66 tokens with SmolLM2's chat template)

# (hidden, ffn, layers, heads, kv heads) of the random models
SHAPES = {
    "small": (256, 768, 4, 4, 2),
    "medium": (512, 1536, 8, 8, 4),
    "large": (768, 2048, 6, 12, 4),
    "h512": (512, 1408, 14, 8, 2),
    "h640": (640, 1792, 20, 10, 5),
    "h768": (768, 2048, 10, 12, 4),
    "h896": (896, 2432, 8, 14, 2),
    "h1024": (1024, 2816, 12, 16, 8),
    "h768x14": (768, 2048, 14, 12, 4),
    "moe512": (512, 1536, 8, 8, 2),
}
# shapes that are Qwen3-MoE models (QK norm, head_dim = hidden / heads): their experts
MOE = {"moe512": dict(num_experts=16, num_experts_per_tok=4, moe_intermediate_size=384,
                      norm_topk_prob=True)}


def cell(name, shape, *, new_tokens, lengths=None, prompt_cap=0, responses=8, group=4,
         mbs=4, mbt=0, chunk=1024, recompute="none", options=(), steps=2) -> dict:
    """A cell: ``lengths`` the responses' lengths (cycled; None: all at the cap),
    ``prompt_cap`` data.max_prompt_tokens (0: the prompts' length), ``mbs`` / ``mbt``
    train.micro_batch_size / micro_batch_tokens, ``chunk`` train.loss_chunk_tokens,
    ``options`` further overrides (entropy bonus, KL, ...)."""
    return dict(name=name, shape=shape, new_tokens=new_tokens,
                lengths=list(lengths or [new_tokens]), prompt_cap=prompt_cap,
                responses=responses, group=group, micro_batch_size=mbs,
                micro_batch_tokens=mbt, loss_chunk=chunk, recompute=recompute,
                options=list(options), steps=steps)


ENT = "grpo.entropy_coef=1e-4"
KL3 = ("grpo.kl_beta=0.01", "grpo.kl_type=k3")
KL1 = ("grpo.kl_beta=0.01", "grpo.kl_type=k1")
# the cells the model's CPU terms were fitted on (all responses at the cap)
FIT = [cell(f"{s}-{rc}", s, new_tokens=n, mbs=b, recompute=rc, chunk=1024,
            responses=r)
       for s, n, b, r in (("small", 128, 4, 8), ("medium", 256, 2, 8), ("large", 512, 1, 4))
       for rc in ("none", "full")]
# the validation grid: shapes, lengths and options the model was not fitted on
DYN = ("grpo.dynamic_sampling=true", "grpo.dynamic_sampling_rounds=1")
GRID = [
    cell("h512-none-ent", "h512", new_tokens=512, lengths=[300, 410], prompt_cap=256,
         mbt=2048, options=[ENT]),
    cell("h512-full-kl3", "h512", new_tokens=512, lengths=[300, 410], prompt_cap=256,
         mbt=2048, recompute="full", options=[ENT, *KL3]),
    cell("h512-sel-self", "h512", new_tokens=256, lengths=[256], prompt_cap=128,
         recompute="selective", options=["rollout.speculative.drafter=self"]),
    cell("h640-sel-ent", "h640", new_tokens=256, lengths=[200, 256], prompt_cap=128,
         recompute="selective", options=[ENT]),
    cell("h640-full-tis", "h640", new_tokens=256, lengths=[200, 256], prompt_cap=128,
         recompute="full", options=["grpo.tis_cap=2.0", "grpo.dual_clip_c=3.0"]),
    cell("h768-none-ent", "h768", new_tokens=768, lengths=[450, 600], prompt_cap=128,
         mbt=4096, options=[ENT]),
    cell("h768-full-ent", "h768", new_tokens=768, lengths=[450, 600], prompt_cap=128,
         mbt=4096, recompute="full", options=[ENT]),
    cell("h768-sel-kl1", "h768", new_tokens=1024, lengths=[500, 700], prompt_cap=1024,
         mbt=4096, recompute="selective", options=[*KL1]),
    cell("h896-none-kl3", "h896", new_tokens=384, lengths=[384], prompt_cap=128, mbs=2,
         options=[ENT, *KL3]),
    cell("h896-none-dyn", "h896", new_tokens=256, lengths=[200, 256], prompt_cap=128,
         options=[*DYN]),
    cell("h896-full-epochs", "h896", new_tokens=384, lengths=[250, 384], prompt_cap=128,
         mbs=2, recompute="full", options=["grpo.ppo_epochs=2", ENT]),
    cell("h1024-sel-ent", "h1024", new_tokens=256, lengths=[256], prompt_cap=256, mbs=2,
         recompute="selective", options=[ENT]),
    cell("h1024-full-kl3", "h1024", new_tokens=512, lengths=[400, 512], prompt_cap=256,
         mbs=2, recompute="full", options=[ENT, *KL3]),
    cell("h1024-none-chunk", "h1024", new_tokens=256, lengths=[180, 256], prompt_cap=128,
         mbs=4, chunk=256, options=[ENT]),
]
# a user's run as reported (the defaults: micro-batches of 4 samples / 4096 positions,
# the prompt cap at 1024), one step
# a mixture-of-experts policy (Qwen3-MoE, 16 experts, top-4; routing replay on)
MOE_CELLS = [cell("moe512-none", "moe512", new_tokens=256, lengths=[200, 256],
                  prompt_cap=128),
             cell("moe512-full-ent", "moe512", new_tokens=512, lengths=[300, 410],
                  prompt_cap=256, mbt=2048, recompute="full", options=[ENT])]
ISSUE = [cell(f"user-{rc}{'-ent' if opts else ''}", "h768x14", new_tokens=768,
              prompt_cap=1024, mbt=4096, recompute=rc, options=opts, steps=1)
         for rc, opts in (("none", []), ("none", [ENT]), ("full", [ENT]))]
CELLS = {c["name"]: c for c in FIT + GRID + ISSUE + MOE_CELLS}


# ------------------------------------------------------------------------ the model
def hf_config(shape: str) -> dict:
    """The Hugging Face config of ``SHAPES[shape]``: a Llama, or a Qwen3-MoE (``MOE``)."""
    hidden, ffn, layers, heads, kv = SHAPES[shape]
    base = dict(vocab_size=49152, hidden_size=hidden, intermediate_size=ffn,
                num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv,
                tie_word_embeddings=True, max_position_embeddings=4096)
    if shape in MOE:
        return dict(base, model_type="qwen3_moe", head_dim=hidden // heads, rope_theta=1e6,
                    rms_norm_eps=1e-6, attention_bias=False, decoder_sparse_step=1,
                    mlp_only_layers=[], **MOE[shape])
    return dict(base, model_type="llama", rope_theta=10000.0, rms_norm_eps=1e-5)


def model_folder(shape: str, root: Path) -> Path:
    """A random model of ``SHAPES[shape]`` with SmolLM2's tokenizer files, made once."""
    cfg = hf_config(shape)
    hidden, ffn, layers, heads, kv = SHAPES[shape]
    folder = root / (f"h{hidden}_f{ffn}_l{layers}_a{heads}_g{kv}"
                     + (f"_moe{MOE[shape]['num_experts']}" if shape in MOE else ""))
    if (folder / "config.json").exists():
        return folder
    import torch
    import transformers as tf

    from megatron_tlt.assets import require_smollm2

    smol = require_smollm2()
    torch.manual_seed(0)
    config_cls, model_cls = ((tf.Qwen3MoeConfig, tf.Qwen3MoeForCausalLM) if shape in MOE
                             else (tf.LlamaConfig, tf.LlamaForCausalLM))
    fields = {k: v for k, v in cfg.items() if k != "model_type"}
    tmp = Path(tempfile.mkdtemp(dir=root))
    model_cls(config_cls(bos_token_id=1, eos_token_id=2, **fields)).save_pretrained(tmp)
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


def prompt_tokens(folder: Path, prompts: Path) -> int:
    """Tokens of the cells' prompt after the chat template (every prompt is the same)."""
    from megatron_tlt.config import load_config
    from megatron_tlt.models import load_tokenizer
    from megatron_tlt.rl.data import build_prompt_sets

    cfg = load_config(overrides=[f"model.hf_path={folder}", "data.source=jsonl",
                                 f"data.path={prompts}", "data.instruction=",
                                 "data.eval_size=0"])
    train, _ = build_prompt_sets(cfg.data, load_tokenizer(folder))
    return max(len(p.token_ids) for p in train)


def overrides(c: dict, prompts: Path, tokens: int) -> list[str]:
    """The cell's config (without model.hf_path): one step of ``responses`` samples."""
    out = ["platform.device=cpu", "model.dtype=float32", "data.source=jsonl",
           f"data.path={prompts}", "data.instruction=", "data.eval_size=0",
           "data.train_size=0", f"data.max_prompt_tokens={max(c['prompt_cap'], tokens)}",
           f"grpo.prompts_per_step={c['responses'] // c['group']}",
           f"grpo.group_size={c['group']}", f"grpo.max_new_tokens={c['new_tokens']}",
           "grpo.dynamic_sampling=false", f"train.micro_batch_size={c['micro_batch_size']}",
           f"train.micro_batch_tokens={c['micro_batch_tokens']}",
           f"train.loss_chunk_tokens={c['loss_chunk']}",
           f"train.recompute_granularity={c['recompute']}",
           f"train.steps={c.get('steps', 2)}",
           "train.eval_interval=0", "rollout.cpu_kernels=false", "tracking.progress=false"]
    return out + list(c["options"])


# ------------------------------------------------------------------------ one cell
def _hwm() -> int:
    with open("/proc/self/status") as f:
        return int(re.search(r"VmHWM:\s+(\d+)\s+kB", f.read()).group(1)) * 1024


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _heap() -> tuple:
    """Bytes glibc's main heap spans and of them free (``mallinfo2()``'s arena and
    fordblks: the freed blocks it keeps mapped), (0, 0) where that is not glibc."""
    import ctypes

    class Info(ctypes.Structure):
        _fields_ = [(n, ctypes.c_size_t) for n in (
            "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks",
            "uordblks", "fordblks", "keepcost")]
    try:
        fn = ctypes.CDLL("libc.so.6").mallinfo2
    except (OSError, AttributeError):
        return 0, 0
    fn.restype = Info
    got = fn()
    return int(got.arena), int(got.fordblks)


def _restart_hwm() -> None:
    """Restart the kernel's high-water mark from the current RSS."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


class _Tracer:
    """Torch's profiler over a stretch of the step: the live tensor bytes at each
    marked phase's peak, grouped by the op (and autograd node) that allocated them."""

    def __init__(self):
        from torch.profiler import ProfilerActivity, profile

        self.prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
        self.prof.start()

    def finish(self, top: int = 14) -> dict:
        from torch._C._profiler import _EventType

        self.prof.stop()
        events = []

        def walk(nodes, stack):
            for n in nodes:
                if n.typed[0] == _EventType.Allocation:
                    f = n.typed[1]
                    events.append((n.start_time_ns, f.alloc_size, f.ptr, stack))
                else:
                    walk(n.children, stack + (n.name,))
        walk(self.prof.profiler.kineto_results.experimental_event_tree(), ())
        events.sort(key=lambda e: e[0])
        out = {}
        for phase in ("log-probs", "update"):
            live, where, cur, best, best_at = {}, {}, 0, -1, None
            for t, size, ptr, stack in events:
                if size > 0:
                    live[ptr], where[ptr] = size, stack
                    cur += size
                elif ptr in live:
                    cur -= live.pop(ptr)
                if f"phase:{phase}" in stack and cur > best:
                    best, best_at = cur, {p: (b, where[p]) for p, b in live.items()}
            if best_at is None:
                continue
            groups: dict = {}
            for ptr, (size, stack) in best_at.items():
                key = _label(stack, size)
                n, b = groups.get(key, (0, 0))
                groups[key] = (n + 1, b + size)
            rows = sorted(groups.items(), key=lambda kv: -kv[1][1])
            small = sum(b for b, _ in best_at.values() if b < SMALL)
            out[phase] = {"live_since_start": best, "small_at_peak": small,
                          "groups": [[k, n, b] for k, (n, b) in rows[:top]]}
        cur = peak = 0
        for t, size, ptr, stack in events:  # the heap's share: tensors under glibc's
            if abs(size) < SMALL:  # largest dynamic mmap threshold
                cur += size
                peak = max(peak, cur)
        out["small_peak"] = peak
        t0 = events[0][0] if events else 0
        out["large"] = [[round((t - t0) / 1e6), round(size / MIB), _label(stack, abs(size))]
                        for t, size, _, stack in events if abs(size) >= LARGE]
        return out


def _label(stack: tuple, size: int) -> str:
    keep = [s for s in stack if s.startswith(("phase:", "autograd::engine::evaluate_function"))
            or not s.startswith(("aten::", "autograd::", "cudaStream"))]
    name = " > ".join(s.replace("autograd::engine::evaluate_function: ", "bwd ")
                      for s in keep[-2:])
    leaf = stack[-1] if stack else "?"
    return f"{name} | {leaf} | {size / MIB:.1f} MiB"


def run_cell(spec: dict) -> dict:
    """One cell in this (fresh) process: returns the measured bytes per phase."""
    import dataclasses

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
    torch.set_num_threads(int(spec.get("threads", 1)))
    cfg = load_config(overrides=spec["argv"])
    baseline = _rss()
    _restart_hwm()
    session = setup(cfg)

    class Alternating:  # rewards with variance in every group: every sample trains;
        fresh = False  # with dynamic sampling a step's first round is flat (all 0), so
        # every group is replaced by an extra round's

        def score_many(self, prompts, texts):
            flat, self.fresh = self.fresh, False
            return [RewardResult(reward=0.0 if flat else float(i % 2), score=0.0,
                                 correct=False, format_ok=True, answer=None)
                    for i in range(len(texts))]

    verifier = Alternating()
    trainer = Trainer(cfg, session, verifier=verifier)
    out = {"baseline": baseline, "build": _hwm(), "heap_after_build": _heap(), "steps": []}
    lengths = spec["lengths"]
    generate = trainer.generate  # the rollout's generation (the trainer's seam)

    def at_lengths(prompts, params, **kw):  # each response stops at its cell length
        plist = [dataclasses.replace(params, ignore_eos=True,
                                     max_new_tokens=lengths[i % len(lengths)])
                 for i in range(len(prompts))]
        return generate(prompts, plist, **kw)
    trainer.generate = at_lengths
    phases: dict = {}
    tracer = [None]

    def end_of_rollout(step, roll):
        phases["rollout"] = _hwm()
        phases["heap_after_rollout"] = _heap()
        phases["lengths"] = sorted({len(s.response_ids) for s in roll.samples})
        _restart_hwm()
        if spec.get("trace") and step == int(spec.get("steps", 2)) - 1:
            tracer[0] = _Tracer()
    trainer.idle_window_hooks.append(end_of_rollout)
    labels: dict = {}
    lend = trainer.update_memory.lend

    def measured_lend():  # train.offload_during_rollout: the rollout starts once lent
        lend()
        _restart_hwm()
    trainer.update_memory.lend = measured_lend

    def marks(phase, when):  # the trainer's phase hooks: memory marks, profiler labels
        from torch.profiler import record_function

        if when == "start":
            if phase == "update":
                phases["log-probs"] = _hwm()
                phases["heap_before_update"] = _heap()
                _restart_hwm()
            labels[phase] = record_function(f"phase:{phase}")
            labels[phase].__enter__()
        elif phase in labels:
            labels.pop(phase).__exit__(None, None, None)
    trainer.phase_hooks.append(marks)
    for step in range(int(spec.get("steps", 2))):
        verifier.fresh = cfg.grpo.dynamic_sampling
        _restart_hwm()
        phases.clear()
        metrics = trainer.train_step(step)
        phases["update"] = _hwm()
        phases["heap_after_update"] = _heap()
        cache = trainer.engine.memory.cache  # the engine's rollout memory (public)
        phases["kv_released"] = cache is None or not cache.allocated
        phases["grad_norm"] = metrics["grad_norm"]
        phases["lent_bytes"] = trainer.update_memory.bytes_lent
        phases["offload_seconds"] = dict(trainer.update_memory.seconds)
        out["steps"].append(dict(phases))
    if tracer[0] is not None:
        out["trace"] = tracer[0].finish()
    shutdown()
    for k in ("rollout", "log-probs", "update"):
        out[k] = max(s.get(k, 0) for s in out["steps"])
    out["peak"] = max(out["build"], out["rollout"], out["log-probs"], out["update"])
    out["lengths"] = out["steps"][-1]["lengths"]
    out["kv_released"] = out["steps"][-1]["kv_released"]
    return out


# ------------------------------------------------------------------------ the table
def shape_arch(shape: str):
    """The ``ModelArch`` of ``SHAPES[shape]`` (what its saved config.json reads as)."""
    from megatron_tlt.models.gpt import ModelArch

    return ModelArch.from_hf_config(hf_config(shape))


def predict(c: dict, kv_released: bool, lengths=None) -> dict:
    """The model's phases for cell ``c``'s recorded config; ``lengths`` (prompt,
    response) per sample, or None for the dry run's bound."""
    from megatron_tlt.config import load_config
    from megatron_tlt.rl.memory_model import estimate

    cfg = load_config(overrides=[f"model.hf_path={c['shape']}", *c["config"]])
    est = estimate(cfg, shape_arch(c["shape"]), world_size=1, kv_released=kv_released,
                   lengths=lengths)
    return {"rollout": est.rollout_total, "log-probs": est.logprobs_total,
            "update": est.update_total, "peak": est.peak, "phase": est.peak_phase,
            "micro_batch": [est.settings.micro_batch, est.settings.seq],
            "terms": {f"{t.phase}: {t.name}": int(t.nbytes) for t in est.terms}}


def _errors(c: dict) -> dict:
    p, m = c["predicted"], c["measured"]
    return {k: 100.0 * (p[k] - m[k]) / m[k] for k in ("rollout", "update", "peak")}


def measure(c: dict, root: Path, *, timeout: int = 1800, trace: bool = False,
            threads: int = 1) -> dict:
    folder = model_folder(c["shape"], root)
    prompts = prompt_file(root)
    tokens = prompt_tokens(folder, prompts)
    argv = [f"model.hf_path={folder}", *overrides(c, prompts, tokens)]
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), PYTHONPATH=str(REPO))
    spec = {"argv": argv, "lengths": c["lengths"], "trace": trace, "threads": threads,
            "steps": c.get("steps", 2)}
    r = subprocess.run([sys.executable, __file__, "--cell", json.dumps(spec)], env=env,
                       capture_output=True, text=True, timeout=timeout, cwd=REPO)
    if r.returncode != 0:
        raise RuntimeError(f"cell {c['name']} failed:\n{r.stderr[-4000:]}")
    got = json.loads(r.stdout.strip().splitlines()[-1])
    out = {**c, "hidden": SHAPES[c["shape"]][0], "layers": SHAPES[c["shape"]][2],
           "prompt_tokens": tokens, "config": argv[1:], "threads": threads, "measured": got}
    return repredict(out)


def repredict(c: dict) -> dict:
    """``c`` with its prediction (at the step's lengths), the dry run's bound and the
    errors recomputed from its recorded config."""
    kv = c["measured"]["kv_released"]
    c["predicted"] = predict(c, kv, sample_lengths(c))
    c["dry_run"] = predict(c, kv)
    c["error_pct"] = _errors(c)
    return c


def sample_lengths(c: dict) -> list[tuple]:
    """(prompt, response) tokens of each of the cell's samples, in step order."""
    return [(c["prompt_tokens"], c["lengths"][i % len(c["lengths"])])
            for i in range(c["responses"])]


def describe(c: dict) -> str:
    opts = [o.split(".", 1)[1] for o in c["options"]]
    lens = "/".join(str(n) for n in sorted(set(c["lengths"])))
    mbt = f", {c['micro_batch_tokens']} tok" if c["micro_batch_tokens"] else ""
    return (f"h {c['hidden']}, {c['layers']} layers; {c['responses']} x "
            f"{c['prompt_tokens']}+{lens} (cap {c['new_tokens']}); mb {c['micro_batch_size']}"
            f"{mbt}; chunk {c['loss_chunk']}; {c['recompute']}"
            + (f"; {', '.join(opts)}" if opts else ""))


def markdown(cells: list[dict]) -> str:
    rows = ["| cell | config | micro-batch | predicted | measured | measured / predicted "
            "| dry-run bound |", "|---|---|---|---|---|---|---|"]
    for c in cells:
        p, m, d = c["predicted"], c["measured"], c["dry_run"]
        rows.append(f"| {c['name']} | {describe(c)} | {p['micro_batch'][0]} x "
                    f"{p['micro_batch'][1]} | {p['peak'] / GIB:.2f} GiB ({p['phase']}) | "
                    f"{m['peak'] / GIB:.2f} GiB | {m['peak'] / p['peak']:.3f} | "
                    f"{d['peak'] / GIB:.2f} GiB |")
    return "\n".join(rows)


def compare_offload(names: list, root: Path, out: Path, threads: int) -> dict:
    """Each cell with train.offload_during_rollout off, on, and off again (the A/A
    control: the RSS's run-to-run noise), side by side; ``out`` gets the JSON."""
    import datetime

    from megatron_tlt.rollout.cpu_kernels import cpu_model

    doc = {"command": "python tools/measure_memory.py " + " ".join(sys.argv[1:]),
           "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "cpu": cpu_model(), "threads": threads, "cells": []}
    from concurrent.futures import ThreadPoolExecutor

    for name in names:
        runs, labels = {}, (("off", False), ("on", True), ("off A/A", False))
        cells = [dict(CELLS[name], options=[*CELLS[name]["options"],
                                            f"train.offload_during_rollout={str(on).lower()}"])
                 for _, on in labels]
        prompt_tokens(model_folder(cells[0]["shape"], root), prompt_file(root))  # imports
        with ThreadPoolExecutor(len(cells)) as pool:  # one process each, at once
            measured = list(pool.map(lambda c: measure(c, root, threads=threads), cells))
        for (label, _), r in zip(labels, measured):
            runs[label] = {
                "measured": {k: [st[k] for st in r["measured"]["steps"]]
                             for k in ("rollout", "log-probs", "update", "lent_bytes",
                                       "offload_seconds")},
                "predicted": {k: r["predicted"][k] for k in ("rollout", "log-probs",
                                                            "update", "peak")},
                "update_only": sum(v for k, v in r["predicted"]["terms"].items()
                                   if k in ("resident: grads", "resident: optimizer"))}
        off, on, aa = (runs[k]["measured"]["rollout"] for k in ("off", "on", "off A/A"))
        doc["cells"].append({"cell": name, "config": describe(measured[0]), "runs": runs,
                             "rollout_drop": [a - b for a, b in zip(off, on)],
                             "rollout_aa": [a - b for a, b in zip(off, aa)]})
        out.write_text(json.dumps(doc, indent=1) + "\n")
    for c in doc["cells"]:
        lent = c["runs"]["on"]["measured"]["lent_bytes"][-1]
        for step, (drop, aa) in enumerate(zip(c["rollout_drop"], c["rollout_aa"])):
            print(f"{c['cell']} step {step + 1}: rollout peak RSS off "
                  f"{c['runs']['off']['measured']['rollout'][step] / MIB:.0f} MiB, on "
                  f"{c['runs']['on']['measured']['rollout'][step] / MIB:.0f} MiB: drop "
                  f"{drop / MIB:.0f} MiB (lent {lent / MIB:.0f} MiB; A/A {aa / MIB:+.0f} MiB)")
    return doc


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[1])
    ap.add_argument("--cell", help=argparse.SUPPRESS)
    ap.add_argument("--cells", default="", help="cell names, comma-separated, or 'fit'")
    ap.add_argument("--grid", action="store_true", help="every cell of the validation grid")
    ap.add_argument("--trace", action="store_true",
                    help="live tensors at the log-probs' and the update's peaks")
    ap.add_argument("--threads", type=int, default=1, help="torch threads of a cell")
    ap.add_argument("--append", action="store_true",
                    help="add to (or replace by name in) the cells in --json")
    ap.add_argument("--repredict", action="store_true",
                    help="recompute the predictions of the cells in --json (the model "
                         "changed; the measurements stay)")
    ap.add_argument("--models", default=str(Path(tempfile.gettempdir()) / "megatron_tlt_mem"),
                    help="folder for the random models (kept between runs)")
    ap.add_argument("--offload", action="store_true",
                    help="the cells with train.offload_during_rollout off / on / off (A/A) "
                         "side by side, into --json (default docs/results/offload_rss_cpu.json)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    args.json = args.json or str(REPO / "docs/results" / (
        "offload_rss_cpu.json" if args.offload else "memory_model_cpu.json"))
    if args.cell:
        print(json.dumps(run_cell(json.loads(args.cell))))
        return 0
    root = Path(args.models)
    root.mkdir(parents=True, exist_ok=True)
    out = Path(args.json)
    if args.repredict:
        cells = [repredict(c) for c in json.loads(out.read_text())["cells"]]
        out.write_text(json.dumps({"cells": cells}, indent=1) + "\n")
        print(markdown(cells))
        return 0
    names = [c["name"] for c in GRID] if args.grid else \
        [c["name"] for c in FIT] if args.cells == "fit" else args.cells.split(",")
    unknown = [n for n in names if n not in CELLS]
    if unknown or not names:
        ap.error(f"unknown cells {unknown}; known: {', '.join(CELLS)}")
    if args.offload:
        compare_offload(names, root, out, args.threads)
        return 0
    cells = json.loads(out.read_text())["cells"] if args.append and out.exists() else []
    for name in names:
        c = measure(CELLS[name], root, trace=args.trace, threads=args.threads)
        print(f"{name:18s} predicted {c['predicted']['peak'] / MIB:7.0f} MiB measured "
              f"{c['measured']['peak'] / MIB:7.0f} MiB ({c['error_pct']['peak']:+.1f} %)",
              flush=True)
        if args.trace:
            print(json.dumps(c["measured"].get("trace"), indent=1), flush=True)
        cells = [x for x in cells if x["name"] != name] + [c]
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps({"cells": cells}, indent=1) + "\n")
    print(markdown(cells))
    return 0


if __name__ == "__main__":
    sys.exit(main())
