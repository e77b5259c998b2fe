"""Every declared runtime dependency is used: imported by the package, its tools or the
entry point, or listed with its reason as runtime-only (used by another package)."""

from __future__ import annotations

import ast
import importlib.metadata as md
import re
import tomllib

from cli import REPO


def _pyproject() -> dict:
    return tomllib.loads((REPO / "pyproject.toml").read_text())


def _name(requirement: str) -> str:
    """PEP 503 normalised distribution name of a requirement string."""
    name = re.match(r"[A-Za-z0-9._-]+", requirement.strip()).group(0)
    return re.sub(r"[-_.]+", "-", name).lower()


def _imported_modules() -> set[str]:
    files = [*(REPO / "megatron_tlt").rglob("*.py"), *(REPO / "tools").glob("*.py"),
             REPO / "pretrain_rl_tlt.py"]
    mods = set()
    for f in files:
        for node in ast.walk(ast.parse(f.read_text(), str(f))):
            if isinstance(node, ast.Import):
                mods |= {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                mods.add(node.module.split(".")[0])
    return mods


def test_every_runtime_dependency_is_imported_or_documented_as_runtime_only():
    project = _pyproject()
    declared = {_name(r) for r in project["project"]["dependencies"]}
    runtime_only = {_name(k): v for k, v in
                    project["tool"]["megatron_tlt"]["runtime-only"].items()}
    modules_of: dict[str, set[str]] = {}
    for module, dists in md.packages_distributions().items():
        for d in dists:
            modules_of.setdefault(_name(d), set()).add(module)
    imported = _imported_modules()
    unused = sorted(d for d in declared - set(runtime_only)
                    if not modules_of.get(d, set()) & imported)
    assert not unused, (f"declared in pyproject.toml but imported nowhere: {unused}; drop "
                        f"them or list them with a reason under [tool.megatron_tlt.runtime-only]")
    assert set(runtime_only) <= declared, "runtime-only entries must be declared dependencies"
    assert all(reason.strip() for reason in runtime_only.values())


def test_every_runtime_dependency_has_a_known_good_pin():
    pinned = {_name(line) for line in (REPO / "requirements.txt").read_text().splitlines()
              if line.strip() and not line.startswith("#")}
    declared = {_name(r) for r in _pyproject()["project"]["dependencies"]}
    assert declared <= pinned, f"not pinned in requirements.txt: {sorted(declared - pinned)}"
