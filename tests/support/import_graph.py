"""The package's import graph, read from the source (no import is executed).

Every import counts: module level, inside functions, and under ``TYPE_CHECKING`` (a
circle hidden in a function or a type annotation still makes two modules need each
other). ``from . import x`` counts as importing the submodule ``x``; importing a
submodule does not count as importing its package's ``__init__``."""

from __future__ import annotations

import ast
from pathlib import Path


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
