"""The package never runs or reads the repository's files: no module of
``megatron_tlt`` builds a path to ``examples/``, ``docs/`` or ``pretrain_rl_tlt.py``, or
climbs above the package (``Path(__file__).parents[k]`` past its root). What it needs
ships as package data; a folder of the repository is an argument a tool passes."""

from __future__ import annotations

import ast
from pathlib import Path

import megatron_tlt

PKG = Path(megatron_tlt.__file__).resolve().parent
OUTSIDE = ("examples", "docs", "pretrain_rl_tlt.py")


def _docstrings(tree) -> set[int]:
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                out.add(id(body[0].value))
    return out


def _path_args(tree) -> set[int]:
    """Constants that are path parts: operands of ``/``, arguments of ``Path(...)``,
    ``open(...)``, ``.joinpath(...)``, ``runpy.run_path(...)``."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Div):
            out |= {id(node.left), id(node.right)}
        if isinstance(node, ast.Call):
            f = node.func
            name = f.id if isinstance(f, ast.Name) else f.attr if isinstance(
                f, ast.Attribute) else ""
            if name in ("Path", "open", "joinpath", "run_path", "PurePath"):
                out |= {id(a) for a in node.args}
    return out


def reaches_outside(source: str, depth: int) -> list[tuple[int, str]]:
    """(line, what) of each path out of the package in ``source``, a module ``depth``
    folders below the repository root (megatron_tlt/x.py: 2)."""
    tree = ast.parse(source)
    docs, parts = _docstrings(tree), _path_args(tree)
    found = []
    for node in ast.walk(tree):
        if (isinstance(node, ast.Constant) and isinstance(node.value, str)
                and id(node) not in docs and id(node) in parts):
            first = node.value.strip("/").split("/")[0]
            if first in OUTSIDE:
                found.append((node.lineno, repr(node.value)))
        if (isinstance(node, ast.Subscript) and isinstance(node.value, ast.Attribute)
                and node.value.attr == "parents" and isinstance(node.slice, ast.Constant)
                and isinstance(node.slice.value, int) and node.slice.value >= depth - 1):
            found.append((node.lineno, f"parents[{node.slice.value}] (above the package)"))
    return sorted(found)


def test_no_module_reaches_the_repositorys_files():
    found = []
    for p in sorted(PKG.rglob("*.py")):
        depth = len(p.relative_to(PKG.parent).parts)
        found += [f"{p.relative_to(PKG.parent)}:{line}: {what}"
                  for line, what in reaches_outside(p.read_text(), depth)]
    assert not found, ("ship it as package data or take the folder as an argument:\n"
                       + "\n".join(found))


def test_the_scan_bites():
    src = ('"""docs/ in a docstring is prose."""\nfrom pathlib import Path\n'
           'R = Path(__file__).resolve().parents[2] / "docs" / "results"\n'
           'E = Path("examples/rl/x.yaml")\nmsg = "see docs/errors.md"\n'
           'runpy.run_path(str(REPO / "pretrain_rl_tlt.py"))\n')
    assert reaches_outside(src, 3) == [
        (3, "'docs'"), (3, "parents[2] (above the package)"), (4, "'examples/rl/x.yaml'"),
        (6, "'pretrain_rl_tlt.py'")]
