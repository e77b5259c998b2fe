"""Warmed drafters kept in the asset cache (``$MEGATRON_TLT_CACHE/drafters``), made by a
bounded ``run_warmup`` on first use and reused after:

* ``demo_drafter``: the demo's (``make demo``; also the default of bench_e2e,
  bench_drift, sweep_drafter_lr and bench_rollout ``--spec-drafter demo``), warmed at
  the demo recipe's sampling settings (shipped as ``data/demo_sampling.yaml``);
* ``default_drafter_path`` / ``ensure_drafter``: the speculative benchmark's SmolLM2
  drafters on basic_arithmetic, ``full`` (8,192 prompts, about 2 h on 2 cores; its
  responses kept beside it, so an interrupted warm-up resumes) and ``quick`` (64
  prompts, a few minutes).
"""

from __future__ import annotations

import time
from pathlib import Path

from ..assets import default_cache_dir
from .warmup import WarmupConfig, run_warmup

__all__ = ["DEMO_RECIPE", "DEMO_WARMUP", "demo_drafter", "default_drafter_path",
           "ensure_drafter"]

# the demo recipe's model, task and sampling, shipped with the package (package data)
DEMO_RECIPE = Path(__file__).resolve().parent / "data" / "demo_sampling.yaml"
# bounded to a few minutes on 2 cores: the recipe's sampling, fewer and shorter responses
DEMO_WARMUP = dict(train_prompts=8, max_new_tokens=128, epochs=4, batch_tokens=1024,
                   draft_vocab=1024, eval_prompts=2, eval_strategy="4_1_4",
                   eval_new_tokens=64)


def demo_drafter(recipe: Path = DEMO_RECIPE) -> Path:
    """The demo's drafter: the cached one, or a warm-up at ``recipe``'s sampling settings
    (``DEMO_WARMUP``) whose held-out alpha by depth is printed."""
    path = default_cache_dir() / "drafters" / "smollm2-chain_sum-demo-sampled.safetensors"
    if path.is_file():
        print(f"[demo] drafter: {path} (cached)", flush=True)
        return path
    print(f"[demo] warming up a drafter for the demo at the recipe's sampling settings "
          f"(bounded, a few minutes on 2 cores) -> {path}", flush=True)
    from ..runtime_env import silence_expected_warnings

    silence_expected_warnings()
    t0 = time.perf_counter()
    result = run_warmup(WarmupConfig.from_recipe(recipe, out=str(path), **DEMO_WARMUP))
    a = result.report.get("alpha")
    if a:
        print(f"[demo] drafter alpha by depth at T={a['temperature']:g}: "
              f"{' '.join(f'{x:.2f}' for x in a['alpha'])} (E[max p] {a['e_max_p']:.2f}); "
              f"acceptance length predicted {a['predicted_accept_len']:.2f}, measured "
              f"{result.report['accept_len']:.2f}", flush=True)
    print(f"[demo] drafter ready in {time.perf_counter() - t0:.0f} s", flush=True)
    return path


def default_drafter_path(quick: bool = False) -> Path:
    """Where the speculative benchmark's warmed SmolLM2 drafter is cached (``quick``:
    the bounded warm-up's)."""
    name = "smollm2-basic_arithmetic" + ("-quick" if quick else "")
    return default_cache_dir() / "drafters" / f"{name}.safetensors"


def ensure_drafter(path: Path, quick: bool) -> Path:
    """``path`` when it holds a drafter, else a greedy warm-up on basic_arithmetic saved
    there first (``quick``: 64 prompts x 128 tokens, 4 epochs; otherwise 8,192 prompts x
    256 tokens, 3 epochs at depth 2, the responses kept in ``PATH.responses.jsonl``).
    Raises ``WarmupError`` when the warm-up cannot run (its message says why)."""
    if path.is_file():
        return path
    print(f"no drafter at {path}: warming one up (tools/warmup_drafter.py)", flush=True)
    fields = dict(out=str(path), draft_vocab=1024, eval_prompts=4)
    if quick:
        fields.update(train_prompts=64, max_new_tokens=128, epochs=4, batch_tokens=1024)
    else:  # responses are kept next to the drafter: an interrupted warm-up resumes
        fields.update(train_prompts=8192, max_new_tokens=256, epochs=3, unroll=2,
                      batch_tokens=1024, lr=3e-3,
                      responses=str(path.with_suffix(".responses.jsonl")))
    run_warmup(WarmupConfig(**fields))
    return path
