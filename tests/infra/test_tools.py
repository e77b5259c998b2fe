"""tools/ holds entry points only: every file there is a command line over the package
(it runs as a script, ``if __name__ == "__main__":``) and none imports another one
(imports inside functions count): code two tools share lives in ``megatron_tlt``."""

from __future__ import annotations

import ast
from pathlib import Path

TOOLS = Path(__file__).resolve().parents[2] / "tools"


def _imported(node: ast.AST) -> list[str]:
    """The top-level names an import statement reaches (``tools.x`` counts as ``x``)."""
    if isinstance(node, ast.Import):
        names = [a.name for a in node.names]
    elif isinstance(node, ast.ImportFrom):
        base = node.module or ""
        names = [base] if base and base != "tools" else []
        if node.level or base == "tools":  # from . import x / from tools import x
            names += [a.name for a in node.names]
    else:
        return []
    out = []
    for name in names:
        parts = name.split(".")
        out.append(parts[1] if parts[0] == "tools" and len(parts) > 1 else parts[0])
    return out


def tool_imports(folder: Path) -> list[str]:
    """``file:line imports other`` for every import of one tool module by another."""
    tools = {p.stem for p in folder.glob("*.py")}
    found = []
    for path in sorted(folder.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
            for name in _imported(node):
                if name in tools and name != path.stem:
                    found.append(f"{path.name}:{node.lineno} imports {name}")
    return found


def without_entry_point(folder: Path) -> list[str]:
    """Files with no top-level ``if __name__ == "__main__":``."""
    def is_main_guard(node: ast.stmt) -> bool:
        t = node.test if isinstance(node, ast.If) else None
        return (isinstance(t, ast.Compare) and isinstance(t.left, ast.Name)
                and t.left.id == "__name__" and len(t.comparators) == 1
                and isinstance(t.comparators[0], ast.Constant)
                and t.comparators[0].value == "__main__")

    return [p.name for p in sorted(folder.glob("*.py"))
            if not any(is_main_guard(n) for n in ast.parse(p.read_text(encoding="utf-8")).body)]


def test_no_tool_imports_another():
    found = tool_imports(TOOLS)
    assert not found, ("a tool imports another tool; move what they share into megatron_tlt "
                       "(the module whose job it is) and import it from there:\n"
                       + "\n".join(found))


def test_every_tool_is_an_entry_point():
    found = without_entry_point(TOOLS)
    assert not found, (f"tools/ holds command lines only; these have no `if __name__ == "
                       f"\"__main__\":` (library code belongs in megatron_tlt): {found}")


def test_the_checks_bite(tmp_path):
    """Imports of another tool at module level, inside a function, through ``tools.``
    and relative ones are all reported; the standard library and the package are not;
    a module without a main guard is reported."""
    (tmp_path / "helper.py").write_text("def f():\n    return 1\n")
    (tmp_path / "a.py").write_text(
        "import json\nfrom megatron_tlt.bench import stats\n\n\n"
        "def main():\n    from helper import f\n    return f()\n\n\n"
        "if __name__ == '__main__':\n    main()\n")
    (tmp_path / "b.py").write_text(
        "import helper\nimport tools.a\nfrom tools import helper as h\nfrom . import a\n"
        "\n\nif __name__ == \"__main__\":\n    pass\n")
    assert tool_imports(tmp_path) == [
        "a.py:6 imports helper", "b.py:1 imports helper", "b.py:2 imports a",
        "b.py:3 imports helper", "b.py:4 imports a"]
    assert without_entry_point(tmp_path) == ["helper.py"]
