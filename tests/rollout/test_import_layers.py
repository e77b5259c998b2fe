"""No import circles inside ``megatron_tlt/rollout/``, and the generation loop above the
runners it drives (docs/architecture.md, "Layers point down").

Every import counts: module level, inside functions, and under ``TYPE_CHECKING`` (a
circle hidden in a function or a type annotation still makes two modules need each
other). ``from . import x`` counts as importing the submodule ``x``; importing a
submodule does not count as importing its package's ``__init__``."""

from __future__ import annotations

import ast
from pathlib import Path

import megatron_tlt

PACKAGE = "megatron_tlt.rollout"
ROOT = Path(megatron_tlt.__file__).parent / "rollout"


def module_imports(root: Path, package: str) -> dict[str, set[str]]:
    """{module: the modules of ``package`` (under ``root``) it imports}."""
    mods: dict[str, Path] = {}
    for path in root.rglob("*.py"):
        parts = path.relative_to(root).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        mods[".".join((package,) + parts)] = path
    edges: dict[str, set[str]] = {m: set() for m in mods}
    for name, path in mods.items():
        here = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = here.split(".")[: len(here.split(".")) - node.level + 1]
                    mod = ".".join(base + ([node.module] if node.module else []))
                else:
                    mod = node.module or ""
                for a in node.names:  # a submodule by name, else the module itself
                    sub = f"{mod}.{a.name}"
                    targets.append(sub if sub in mods else mod)
            edges[name].update(t for t in targets if t in mods and t != name)
    return edges


def relative_targets(root: Path, package: str) -> list[tuple[str, int, str]]:
    """(file, line, module) of every relative ``from ... import`` under ``root``."""
    out = []
    for path in root.rglob("*.py"):
        parts = path.relative_to(root).with_suffix("").parts
        here = ".".join((package,) + parts[:-1])  # the package the file is in
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom) and node.level:
                base = here.split(".")[: len(here.split(".")) - node.level + 1]
                out.append((str(path), node.lineno,
                            ".".join(base + ([node.module] if node.module else []))))
    return out


def circles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(edges[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return out


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
