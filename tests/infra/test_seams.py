"""Tools reach the trainer and the engine through public seams only: no tool (nor a
helper in tests/support/) reads or sets a private attribute of either
(``trainer._update``, ``engine._cache``, ``setattr(trainer, "_x", ...)``); nor does any
rollout or RL module other than the engine's own reach into the engine's private
state (its helpers take what they need: ``RolloutMemory`` reads ``engine.graphs``,
``expert_call`` runs ``engine.generate_union``, calibration agrees times with
``engine.tp_times``); the Trainer is built from parts (``Trainer(..., verifier=,
online=)``, ``trainer.generate``, ``idle_window_hooks``, ``phase_hooks``) and never
branches on its optional ones."""

from __future__ import annotations

import ast
from pathlib import Path

import megatron_tlt

REPO = Path(megatron_tlt.__file__).resolve().parents[1]
OWNERS = ("trainer", "engine")  # a receiver naming one of these is the trainer / engine
SHORT = ("eng",)  # ... or one named exactly so
# tests/support workers drive a step's parts one by one (the log-probs and the update of
# a step, compared across layouts): reading those is their job; none patches a private
# attribute
SUPPORT_READS = {"_fill_logprobs", "_update"}


def _receiver(node) -> str:
    """``a.b.c`` -> "a.b.c" (names and attributes only)."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        parts.append(node.id)
    return ".".join(reversed(parts))


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def private_uses(source: str) -> list[tuple[int, str, str]]:
    """(line, "read" | "set", expression) of each private attribute of a receiver named
    like the trainer or the engine."""
    out = []
    tree = ast.parse(source)
    stores = {id(t) for n in ast.walk(tree) if isinstance(n, (ast.Assign, ast.AugAssign,
                                                                ast.AnnAssign))
              for t in (n.targets if isinstance(n, ast.Assign) else [n.target])}
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and _private(node.attr):
            owner = _receiver(node.value).lower()
            if any(o in part or part in SHORT for part in owner.split(".") for o in OWNERS):
                out.append((node.lineno, "set" if id(node) in stores else "read",
                            f"{_receiver(node.value)}.{node.attr}"))
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                and node.func.id in ("setattr", "getattr", "delattr") and len(node.args) >= 2
                and isinstance(node.args[1], ast.Constant)
                and isinstance(node.args[1].value, str) and _private(node.args[1].value)):
            owner = _receiver(node.args[0]).lower()
            if any(o in owner for o in OWNERS):
                out.append((node.lineno, "set" if node.func.id != "getattr" else "read",
                            f"{node.func.id}({_receiver(node.args[0])}, "
                            f"{node.args[1].value!r})"))
    return sorted(out)


def test_no_tool_reads_or_sets_a_private_attribute_of_the_trainer_or_the_engine():
    found = [f"{p.relative_to(REPO)}:{line}: {how} {expr}"
             for p in sorted((REPO / "tools").glob("*.py"))
             for line, how, expr in private_uses(p.read_text())]
    assert not found, "use a public seam:\n" + "\n".join(found)


def test_no_test_helper_patches_the_trainer_or_the_engine():
    found = [f"{p.relative_to(REPO)}:{line}: {how} {expr}"
             for p in sorted((REPO / "tests" / "support").glob("*.py"))
             for line, how, expr in private_uses(p.read_text())
             if how == "set" or expr.rsplit(".", 1)[-1] not in SUPPORT_READS]
    assert not found, "use a public seam:\n" + "\n".join(found)


def test_no_rollout_helper_reaches_into_the_engine():
    """The engine's helpers (memory, prefill, scheduler, expert_call, the speculative
    decoders, the runners) and the RL modules that drive it use its public seams."""
    own = REPO / "megatron_tlt" / "rollout" / "engine.py"
    files = [p for d in ("rollout", "rl") for p in sorted((REPO / "megatron_tlt" / d)
                                                           .rglob("*.py")) if p != own]
    assert len(files) > 20
    found = [f"{p.relative_to(REPO)}:{line}: {how} {expr}"
             for p in files for line, how, expr in private_uses(p.read_text())]
    assert not found, "give the engine a public seam:\n" + "\n".join(found)


def test_the_scan_bites():
    src = ("trainer._update = f\nx = trainer.engine._cache\nself.trainer._fill(1)\n"
           "setattr(engine, '_x', 1)\ny = trainer.verifier\nz = runner._w\n"
           "eng._union_call = True\nself.engine._graphs.release()\n")
    assert private_uses(src) == [
        (1, "set", "trainer._update"), (2, "read", "trainer.engine._cache"),
        (3, "read", "self.trainer._fill"), (4, "set", "setattr(engine, '_x')"),
        (7, "set", "eng._union_call"), (8, "read", "self.engine._graphs")]


def test_the_trainer_does_not_branch_on_its_optional_parts():
    """The drafter group's part has a no-op form (``NoDrafterTraining``)."""
    text = (REPO / "megatron_tlt" / "rl" / "trainer.py").read_text()
    assert "if self.online" not in text and "self.online is not None" not in text
