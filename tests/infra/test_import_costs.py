"""megatron_tlt/import_costs.py: megatron-core's eager torch.compile and wandb imports
deferred, with what runs unchanged."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

from megatron_tlt.import_costs import lazy_compile


def _run(code: str, **env) -> str:
    out = subprocess.run([sys.executable, "-W", "ignore", "-c", textwrap.dedent(code)],
                         capture_output=True, text=True, timeout=300,
                         env={**os.environ, "OMP_NUM_THREADS": "1", **env})
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout.strip()


def test_megatron_core_imports_without_dynamo_and_wandb_loads_on_first_use():
    out = _run("""
        import sys
        import megatron_tlt
        import megatron.core.models.gpt
        from megatron.core import jit
        from megatron_tlt.import_costs import lazy_compile
        print(jit.jit_fuser is lazy_compile, "torch._dynamo" in sys.modules,
              "wandb.sdk" in sys.modules)
        import wandb
        print(callable(wandb.init), "wandb.sdk" in sys.modules,
              sys.modules["wandb"].__name__ == "wandb", wandb.__file__ is not None)
        import wandb.sdk  # a submodule import works through the stand-in
        wandb.probe_value = 7  # writes go to the real module
        print(sys.modules["wandb"].probe_value)
        """)
    assert out.splitlines() == ["True False False", "True True True True", "7"]


def test_eager_imports_switch_keeps_megatron_core_as_it_is():
    out = _run("""
        import torch
        import megatron_tlt
        from megatron.core import jit
        print(jit.jit_fuser is torch.compile)
        """, MEGATRON_TLT_EAGER_IMPORTS="1")
    assert out == "True"


def test_lazy_compile_compiles_once_at_the_first_call(monkeypatch):
    import torch

    calls = []

    def fake_compile(fn, **options):
        calls.append(options)
        return lambda *a, **k: ("compiled", fn(*a, **k))

    monkeypatch.setattr(torch, "compile", fake_compile)

    @lazy_compile
    def double(x):
        return 2 * x

    @lazy_compile(dynamic=False)
    def triple(x):
        return 3 * x

    assert calls == []  # decorating compiles nothing
    assert double(2) == ("compiled", 4) and double(5) == ("compiled", 10)
    assert triple(1) == ("compiled", 3)
    assert calls == [{}, {"dynamic": False}]
    assert double.__name__ == "double"
