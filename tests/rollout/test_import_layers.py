"""No import circles inside ``megatron_tlt/rollout/``, and the generation loop above the
runners it drives (docs/architecture.md, "Layers"). The scanner is
``tests/support/import_graph.py``; the whole package's layers are checked by
``tests/infra/test_layers.py``."""

from __future__ import annotations

from pathlib import Path

import megatron_tlt
from import_graph import circles, module_imports, relative_targets

PACKAGE = "megatron_tlt.rollout"
ROOT = Path(megatron_tlt.__file__).parent / "rollout"


def test_no_import_circle_in_rollout():
    edges = module_imports(ROOT, PACKAGE)
    assert f"{PACKAGE}.engine" in edges and f"{PACKAGE}.gathered" in edges
    found = circles(edges)
    assert not found, "import circles inside megatron_tlt/rollout/: " + "; ".join(
        " <-> ".join(m.removeprefix(PACKAGE + ".") for m in c) for c in found)


def test_relative_imports_resolve():
    """Every relative import names a module that exists (one inside a function, on a
    GPU-only path, is not run by the CPU suite)."""
    import importlib.util

    def exists(m: str) -> bool:
        try:
            return importlib.util.find_spec(m) is not None
        except ModuleNotFoundError:  # a parent package is missing
            return False

    bad = [f"{f}:{line}: {m}" for f, line, m in relative_targets(ROOT, PACKAGE)
           if not exists(m)]
    assert not bad, bad


def test_the_loop_drives_runners_it_does_not_name():
    """The engine reaches the runners only through ``runners.make_runner``; no runner
    module (nor the outputs they build) imports the engine back, even indirectly."""
    edges = module_imports(ROOT, PACKAGE)
    engine = f"{PACKAGE}.engine"
    assert not edges[engine] & {f"{PACKAGE}.gathered", f"{PACKAGE}.pipeline"}
    assert f"{PACKAGE}.runners" in edges[engine]

    def reach(m: str) -> set[str]:
        seen, todo = set(), [m]
        while todo:
            for n in edges[todo.pop()]:
                if n not in seen:
                    seen.add(n)
                    todo.append(n)
        return seen

    for below in ("runners", "forward", "gathered", "pipeline", "outputs", "memory"):
        assert engine not in reach(f"{PACKAGE}.{below}"), below


def test_the_scan_finds_circles(tmp_path):
    """The checker itself: a circle through a function-level import and one through a
    TYPE_CHECKING import are both found; a one-way package is clean."""
    pkg = tmp_path / "p"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("from .a import A\n")
    (pkg / "a.py").write_text("from .b import B\nA = 1\n")
    (pkg / "b.py").write_text("def f():\n    from . import a\nB = 2\n")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "sub" / "c.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from ..d import D\n")
    (pkg / "d.py").write_text("from .sub.c import x\n")
    (pkg / "e.py").write_text("from .sub import c\nimport p.a\n")
    found = circles(module_imports(pkg, "p"))
    assert sorted(found) == [["p.a", "p.b"], ["p.d", "p.sub.c"]]
    (pkg / "b.py").write_text("B = 2\n")
    (pkg / "d.py").write_text("x = 1\n")
    assert circles(module_imports(pkg, "p")) == []
