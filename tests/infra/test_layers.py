"""The package's layers (docs/architecture.md, "Layers"): every top-level unit of
``megatron_tlt`` imports only units of lower layers, no module imports another one back
through any chain (imports inside functions and under ``TYPE_CHECKING`` count), and no
module outgrows one job (``MAX_LINES``)."""

from __future__ import annotations

from pathlib import Path

import megatron_tlt
from import_graph import circles, module_imports

ROOT = Path(megatron_tlt.__file__).parent

# bottom to top; a unit is a top-level module or package of megatron_tlt
LAYERS = [
    # the base: no megatron_tlt import below them
    ("fileio", "collectives", "runtime_env", "parallel", "heartbeat", "spec_strategy",
     "tasks", "optim_state", "run_files", "import_costs"),
    ("assets", "tracking", "arrival"),
    ("config",),            # typed configuration, recipes, overrides, checks
    ("models",),            # megatron-core GPT from HF configs, conversion, drafter model
    ("rollout",),           # the engine, runners, speculation and the drafter kinds
    ("bench", "drafter_training", "validation"),
    ("checkpoint", "planner"),
    ("rl",),                # the GRPO trainer, the dry run
    ("launch",),            # entry points' start-up
    ("cli",),               # the training entry point (pretrain_rl_tlt.py calls it)
    ("gpu_check",),         # the one-GPU check's parts (tools/gpu_check.py)
]
MAX_LINES = 600


def unit(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def layer_of() -> dict[str, int]:
    return {u: i for i, units in enumerate(LAYERS) for u in units}


def test_every_unit_has_a_layer():
    units = {p.stem for p in ROOT.glob("*.py") if p.stem != "__init__"} | {
        p.name for p in ROOT.iterdir() if (p / "__init__.py").is_file()}
    missing = sorted(units - set(layer_of()))
    assert not missing, f"give these units a layer in LAYERS (and docs/architecture.md): {missing}"


def test_imports_point_down():
    edges = module_imports(ROOT, "megatron_tlt")
    level = layer_of()
    up = [f"{m} -> {t}" for m, ts in sorted(edges.items()) for t in sorted(ts)
          if unit(m) != unit(t) and unit(m) in level and unit(t) in level
          and level[unit(t)] >= level[unit(m)]]
    assert not up, "imports that do not point to a lower layer:\n" + "\n".join(up)


def test_no_module_circle():
    found = circles(module_imports(ROOT, "megatron_tlt"))
    assert not found, "import circles: " + "; ".join(" <-> ".join(c) for c in found)


def test_no_module_over_the_size_limit():
    big = {str(p.relative_to(ROOT)): n for p in ROOT.rglob("*.py")
           if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not big, f"modules over {MAX_LINES} lines (split by job): {big}"


def test_the_layer_check_bites(tmp_path):
    """An upward import through a function-level import is reported."""
    pkg = tmp_path / "megatron_tlt"
    (pkg / "config").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "config" / "__init__.py").write_text("def f():\n    from ..rl import x\n")
    (pkg / "rl.py").write_text("x = 1\n")
    edges = module_imports(pkg, "megatron_tlt")
    level = layer_of()
    up = [(m, t) for m, ts in edges.items() for t in ts
          if unit(m) != unit(t) and level[unit(t)] >= level[unit(m)]]
    assert up == [("megatron_tlt.config", "megatron_tlt.rl")]
