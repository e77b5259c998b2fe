"""The repository's import hygiene: the package is installed, nothing edits sys.path,
and no module of the package shadows a standard-library module."""

from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PACKAGE = REPO / "megatron_tlt"


def _python_files():
    for folder in (REPO / "megatron_tlt", REPO / "tools", REPO / "tests", REPO / "tests_gpu",
                   REPO / "scripts", REPO / "examples"):
        yield from folder.rglob("*.py")
    yield from REPO.glob("*.py")


def test_no_sys_path_edits():
    needle = "sys.path." + "insert"  # split so this file does not match itself
    offenders = [f"{p.relative_to(REPO)}:{i}" for p in _python_files()
                 for i, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1)
                 if needle in line]
    assert not offenders, f"scripts and tests import the installed package: {offenders}"


def test_no_module_shadows_the_standard_library():
    names = {p.stem for p in PACKAGE.rglob("*.py")} | {p.name for p in PACKAGE.rglob("*")
                                                       if p.is_dir()}
    shadowing = sorted(names & set(sys.stdlib_module_names))
    assert not shadowing, f"package modules named like standard-library ones: {shadowing}"


def test_files_are_replaced_only_through_fileio():
    """Every "write a temporary, then rename it over the target" goes through
    ``megatron_tlt/fileio.py`` (atomic_write, write_bytes_atomic, publish_dir,
    atomic_dir): one owner of the crash-safe write."""
    import ast

    owner = PACKAGE / "fileio.py"
    found = []
    for path in PACKAGE.rglob("*.py"):
        if path == owner:
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and node.func.attr in ("replace", "rename")
                    and isinstance(node.func.value, ast.Name) and node.func.value.id == "os"):
                found.append(f"{path.relative_to(REPO)}:{node.lineno}")
    assert not found, f"os.replace / os.rename outside fileio.py: {found}"
