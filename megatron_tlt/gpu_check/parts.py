"""The GPU check's in-process parts, each run as its own process under the check's
deadline (``tools/gpu_check.py`` starts them):

    python -m megatron_tlt.gpu_check.parts assets  --shape DIR --cache DIR [--mini] --result R.json
    torchrun --standalone --nproc_per_node 1 -m megatron_tlt.gpu_check.parts grpo \\
        --result R.json -- --config examples/rl/smollm2_cpu.yaml section.field=value ...
    python -m megatron_tlt.gpu_check.parts drafter --result R.json [--steps N]
    python -m megatron_tlt.gpu_check.parts first_step --result R.json -- --config ...

- ``assets``: the one-GPU machine has no SmolLM2 weights and the 98 MB GGUF they come
  from does not fit the 64 MiB that travels with a GPU job, so the check runs on a
  random-weight model of SmolLM2-135M-Instruct's shape (its config, tokenizer and chat
  template, carried in the wheel folder's ``smollm2_shape/``), written where
  ``require_smollm2()`` finds it (``$MEGATRON_TLT_CACHE``) with a marker that says the
  weights are random. ``--mini``: 2 layers, hidden 64 (the CPU dry run).
- ``grpo``: ``pretrain_rl_tlt.py``'s ``main`` with the trainer's two phases (rollout,
  update) wrapped to record peak memory per phase (CUDA: ``max_memory_allocated``
  reset at each phase's start; CPU: the process's peak RSS so far), the first step's
  loss and grad norm from the run's metrics, and the dry run's estimate for the same
  configuration.
- ``drafter``: the drafter group's training micro-step on this process's device. With
  one replica the group never trains (the only replica is the last to finish), so a
  window is run (its synchronisation collectives execute at world size 1) and then
  ``DrafterTrainer.step`` is called directly, as the group calls it, for a few steps
  on one buffered batch: the loss must be finite and fall.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import sys
import time
from pathlib import Path

import torch

SHAPE_FILES = ("config.json", "tokenizer.json", "tokenizer_config.json",
               "chat_template.jinja", "generation_config.json")
MINI = dict(num_hidden_layers=2, hidden_size=64, intermediate_size=128,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16)
GIB = 1024 ** 3
MEMORY_TOLERANCE = 0.15  # measured peak within +-15 % of the dry run's total (flagged)


def _write(path: str, obj: dict) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(obj, indent=1, default=str))


def _peak_rss_gib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / GIB


# ----------------------------------------------------------------------------- assets
def assets(args) -> dict:
    """A random-weight model of SmolLM2's shape at ``smollm2_path(args.cache)``."""
    import shutil

    from transformers import AutoConfig, AutoModelForCausalLM

    from megatron_tlt.assets import MARKER_NAME, RANDOM_WEIGHTS, smollm2_path

    shape = Path(args.shape)
    out = smollm2_path(args.cache)
    out.mkdir(parents=True, exist_ok=True)
    cfg = AutoConfig.from_pretrained(shape)
    if args.mini:
        for k, v in MINI.items():
            setattr(cfg, k, v)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    model.save_pretrained(out)
    for name in SHAPE_FILES:
        if (shape / name).is_file() and name != "config.json":
            shutil.copy(shape / name, out / name)
    params = sum(p.numel() for p in model.parameters())
    marker = {"weights": f"{RANDOM_WEIGHTS} (seed 0): SmolLM2-135M-Instruct's shape and "
                         "tokenizer, made by the GPU check (megatron_tlt.gpu_check.parts assets)",
              "mini": args.mini,
              "parameters": params}
    (out / MARKER_NAME).write_text(json.dumps(marker, indent=1))
    return {"ok": True, "path": str(out), "parameters": params, "mini": args.mini}


# ----------------------------------------------------------------------------- grpo
def _dry_run_numbers(text: str) -> dict:
    """Every 'label X GiB' figure of the dry run's report by label (the last three words
    before the number, parentheses dropped; the first of a label wins), so a rewritten
    report still yields its "total"."""
    out = {}
    for line in text.splitlines():
        start = 0
        for m in re.finditer(r"(-?\d+(?:\.\d+)?) GiB", line):
            prefix = re.sub(r"\([^)]*\)", " ", line[start:m.start()])
            words = re.findall(r"[A-Za-z][A-Za-z0-9-]*", prefix)[-3:]
            if words:
                out.setdefault("_".join(words).lower(), float(m.group(1)))
            start = m.end()
    return out


def grpo(args, rest: list[str]) -> dict:
    """Run the training entry point's main (``cli.main``) with per-phase peak memory
    recorded."""
    from megatron_tlt.rl import trainer as trainer_mod

    cuda = torch.cuda.is_available()
    phases: dict[str, float] = {}
    original = trainer_mod.Trainer._phase

    class _Measured:
        def __init__(self, inner, name):
            self.inner, self.name = inner, name.split(": ", 1)[-1]

        def __enter__(self):
            if cuda:
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
            return self.inner.__enter__()

        def __exit__(self, *exc):
            if cuda:
                torch.cuda.synchronize()
                peak = torch.cuda.max_memory_allocated() / GIB
            else:
                peak = _peak_rss_gib()
            phases[self.name] = max(phases.get(self.name, 0.0), peak)
            return self.inner.__exit__(*exc)

    def measured_phase(self, name, total=None):
        return _Measured(original(self, name, total), name)

    trainer_mod.Trainer._phase = measured_phase
    from megatron_tlt import cli

    _, cfg = cli.parse(rest)
    t0 = time.perf_counter()
    rc = cli.main(rest)
    seconds = time.perf_counter() - t0
    rank = int(os.environ.get("RANK", "0"))
    if rank != 0:
        return {}
    from megatron_tlt.rl.plan import dry_run

    world = int(os.environ.get("WORLD_SIZE", "1"))
    report = dry_run(cfg, world)
    run = Path(cfg.tracking.output_dir).expanduser() / cfg.tracking.run_name
    metrics = []
    path = run / "metrics.jsonl"
    if path.is_file():
        metrics = [json.loads(line) for line in path.read_text().splitlines() if line]
    steps = [m for m in metrics if "grad_norm" in m]
    keys = ("step", "loss/total", "loss/policy", "loss/entropy", "grad_norm", "reward/mean",
            "reward/std", "groups_zero_std", "response_length/mean", "spec", "timing",
            "rollout_tokens_per_second", "drafter/steps", "drafter/identical", "loss_scale")
    predicted = _dry_run_numbers(report)
    measured = max(phases.values()) if phases else None
    total = predicted.get("peak") or predicted.get("total")  # (a report by phase: peak)
    out = {
        "ok": rc == 0 and len(steps) == cfg.train.steps, "rc": rc, "seconds": seconds,
        "device": torch.cuda.get_device_name() if cuda else "cpu",
        "dtype": cfg.model.dtype, "transformer_impl": cfg.model.transformer_impl,
        "steps": [{k: m.get(k) for k in keys if k in m} for m in steps],
        "first_loss": steps[0].get("loss/total") if steps else None,
        "first_grad_norm": steps[0].get("grad_norm") if steps else None,
        "peak_gib_by_phase": phases,
        "peak_gib_overall": torch.cuda.max_memory_allocated() / GIB if cuda else _peak_rss_gib(),
        "memory_kind": "cuda max_memory_allocated" if cuda else "peak RSS (not per phase)",
        "dry_run": {"report": report, "gib": predicted},
        "measured_over_predicted": (measured / total) if measured and total else None,
    }
    out["memory"] = memory_verdict(out)
    return out


def memory_verdict(run: dict) -> dict:
    """Measured peak (CUDA, per phase) against the dry run's total for the same config."""
    pred = run.get("dry_run", {}).get("gib", {})
    ratio = run.get("measured_over_predicted")
    return {"peak_gib_by_phase": run.get("peak_gib_by_phase"),
            "peak_gib_overall": run.get("peak_gib_overall"),
            "memory_kind": run.get("memory_kind"), "predicted_gib": pred,
            "measured_over_predicted": ratio,
            "within_15pct": None if ratio is None else abs(ratio - 1) <= MEMORY_TOLERANCE}


# ----------------------------------------------------------------------------- drafter
def drafter(args) -> dict:
    """The drafter group's micro-step on this device (see the module docstring)."""
    from megatron.core import parallel_state as ps

    from megatron_tlt.assets import require_smollm2
    from megatron_tlt.config import DrafterGroupConfig, RolloutConfig, SpeculativeConfig
    from megatron_tlt.drafter_training.buffer import BufferedResponse
    from megatron_tlt.drafter_training.group import DrafterGroup
    from megatron_tlt.models import load_model
    from megatron_tlt.parallel import initialize_model_parallel
    from megatron_tlt.rollout import RolloutEngine, SamplingParams
    from megatron_tlt.rollout.speculative.drafters import untrained
    from megatron_tlt.runtime_env import init_distributed, silence_expected_warnings

    silence_expected_warnings()
    plat = init_distributed()
    initialize_model_parallel(1, 1, seed=1234)
    dtype = "bfloat16" if plat.device.type == "cuda" else "float32"
    model, arch = load_model(require_smollm2(), device=plat.device, dtype=dtype, impl="local")
    torch.manual_seed(0)
    d = untrained(arch, dtype=getattr(torch, dtype), device=plat.device)
    sc = SpeculativeConfig(policy="fixed", strategy="2_1_2", threshold=1 << 20)
    engine = RolloutEngine(model, None, RolloutConfig(speculative=sc), arch=arch,
                           eos_token_ids=[], drafter=d)
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(0, arch.vocab_size, (n,), generator=g).tolist()
               for n in (5, 9, 7, 12)]
    sampling = SamplingParams(temperature=1.0, max_new_tokens=args.new_tokens, seed=3,
                              return_hidden_states=True)
    outs = engine.generate(prompts, sampling)
    responses = [BufferedResponse.from_output(o, 0) for o in outs]
    cfg = DrafterGroupConfig()
    group = DrafterGroup(d.model, engine.runner, cfg, dp_group=ps.get_data_parallel_group(),
                         mp_group=None, pp_group=None, total_steps=1000, seed=1,
                         sampling=sampling)
    window = group.run_window(0, responses)  # one replica: it is the last, trains nothing
    batch = next(group.buffer.batches(cfg.batch_tokens, seed=0))
    losses, seconds = [], []
    sync = torch.cuda.synchronize if plat.device.type == "cuda" else (lambda: None)
    with group.target.whole_vocab():
        for _ in range(args.steps):
            sync()
            t0 = time.perf_counter()
            parts = group.trainer.step(batch, chunks=cfg.stop_checks, stop=lambda: False)
            sync()
            seconds.append(time.perf_counter() - t0)
            losses.append(float(parts["loss"]))
    finite = all(map(lambda x: x == x and abs(x) != float("inf"), losses))
    weights_ok = all(bool(torch.isfinite(p).all()) for p in group.trainer.params)
    return {
        "ok": finite and weights_ok and losses[-1] < losses[0],
        "device": str(plat.device), "backend": plat.backend, "dtype": dtype,
        "window": {k: window[k] for k in ("steps", "failure", "last_finisher")},
        "batch_rows": len(batch), "batch_tokens": sum(len(s.tokens) for s in batch),
        "losses": losses, "step_seconds": seconds, "finite": finite,
        "weights_finite": weights_ok,
    }


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    rest: list[str] = []
    if "--" in argv:
        i = argv.index("--")
        argv, rest = argv[:i], argv[i + 1:]
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("part", choices=("assets", "grpo", "drafter", "first_step"))
    ap.add_argument("--result", required=True, help="JSON written here")
    ap.add_argument("--shape", default="", help="assets: config + tokenizer folder")
    ap.add_argument("--cache", default=None, help="assets: $MEGATRON_TLT_CACHE to fill")
    ap.add_argument("--mini", action="store_true", help="assets: 2 layers, hidden 64")
    ap.add_argument("--steps", type=int, default=6, help="drafter: micro-steps")
    ap.add_argument("--new-tokens", type=int, default=24, help="drafter: response length")
    args = ap.parse_args(argv)
    try:
        if args.part == "first_step":
            from .first_step import first_step

            out = first_step(rest)
        else:
            out = {"assets": lambda: assets(args), "grpo": lambda: grpo(args, rest),
                   "drafter": lambda: drafter(args)}[args.part]()
    except Exception as e:  # noqa: BLE001 - recorded, then re-raised for the log
        _write(args.result, {"ok": False, "error": f"{type(e).__name__}: {e}"})
        raise
    if out:
        _write(args.result, out)
    return 0 if out.get("ok", True) else 1


if __name__ == "__main__":
    sys.exit(main())
