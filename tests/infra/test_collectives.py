"""megatron_tlt.collectives is the one owner of torch.distributed's collectives.

- No module of the package, its tools or the training script calls a collective
  directly (an AST scan; NCCL's "CPU tensor" crash at DP > 1 came from exactly such a
  call, invisible to a gloo suite).
- The helpers allocate on the group's device, refuse a tensor on the wrong device with a
  message naming the fix (checked on CPU by presenting the group as NCCL), refuse objects
  holding tensors, and run at world size 1.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from megatron_tlt import collectives

ROOT = Path(__file__).resolve().parents[2]
OWNER = ROOT / "megatron_tlt" / "collectives.py"
COLLECTIVES = {
    "all_reduce", "all_gather", "all_gather_object", "all_gather_into_tensor",
    "_all_gather_base", "broadcast", "broadcast_object_list", "barrier", "monitored_barrier",
    "reduce", "reduce_scatter", "reduce_scatter_tensor", "_reduce_scatter_base", "gather",
    "gather_object", "scatter", "scatter_object_list", "send", "recv", "isend", "irecv",
    "batch_isend_irecv", "all_to_all", "all_to_all_single", "send_object_list",
    "recv_object_list",
}


def direct_collective_calls(path: Path, root: Path = ROOT) -> list[str]:
    """``file:line name`` for each torch.distributed collective that ``path`` calls or
    imports directly (through any alias of ``torch.distributed``)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    aliases = {"torch.distributed"}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name == "torch.distributed":
                    aliases.add(a.asname or a.name)
        elif isinstance(node, ast.ImportFrom):
            if node.module == "torch" and any(a.name == "distributed" for a in node.names):
                aliases.update(a.asname or a.name for a in node.names
                               if a.name == "distributed")
            if node.module == "torch.distributed":
                for a in node.names:
                    if a.name in COLLECTIVES:
                        found.append(f"{path.relative_to(root)}:{node.lineno} "
                                     f"from torch.distributed import {a.name}")
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr in COLLECTIVES:
            if ast.unparse(node.value) in aliases:
                found.append(f"{path.relative_to(root)}:{node.lineno} "
                             f"{ast.unparse(node)}")
    return found


def scanned_files() -> list[Path]:
    files = sorted((ROOT / "megatron_tlt").rglob("*.py")) + sorted(
        (ROOT / "tools").rglob("*.py")) + [ROOT / "pretrain_rl_tlt.py"]
    return [f for f in files if f != OWNER]


def test_no_collective_outside_the_owner():
    found = [hit for f in scanned_files() for hit in direct_collective_calls(f)]
    assert not found, ("torch.distributed collectives called outside "
                       "megatron_tlt/collectives.py (use its helpers):\n" + "\n".join(found))


def test_the_scan_finds_each_spelling(tmp_path):
    src = tmp_path / "bad.py"
    src.write_text(
        "import torch\nimport torch.distributed as dist\nimport torch.distributed\n"
        "from torch import distributed as d2\nfrom torch.distributed import barrier\n"
        "def f(t):\n    dist.all_reduce(t)\n    torch.distributed.broadcast(t, 0)\n"
        "    d2.all_gather_object([], t)\n    dist.get_rank()\n")
    hits = direct_collective_calls(src, root=tmp_path)
    assert len(hits) == 4, hits
    assert not any("get_rank" in h for h in hits)


@pytest.fixture
def one_rank_group(single_process_parallel):
    """The suite's one-process gloo group (world size 1)."""
    assert dist.get_world_size() == 1 and dist.get_backend() == "gloo"


def test_without_a_process_group_the_helpers_are_the_identity(monkeypatch):
    # (another test in this process may have left a group: present the state without)
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    assert not collectives.active()
    assert collectives.sum_values([1.5, 2]) == [1.5, 2.0]
    assert collectives.all_gather_object({"a": 1}) == [{"a": 1}]
    assert collectives.broadcast_object([3]) == [3]
    t = torch.ones(2)
    assert collectives.all_gather(t)[0] is t
    assert collectives.all_reduce(t, async_op=True).wait()


def test_helpers_run_at_world_size_one(one_rank_group):
    assert collectives.device_of() == torch.device("cpu")
    assert collectives.sum_values([1, 2.5]) == [1.0, 2.5]
    assert collectives.max_values([-3.0]) == [-3.0]
    assert collectives.broadcast_values([7, 8]) == [7, 8]
    assert collectives.all_gather_object((1, "x")) == [(1, "x")]
    assert collectives.broadcast_object({"k": [1]}) == {"k": [1]}
    t = torch.arange(3.0)
    collectives.all_reduce(t, op="max")
    collectives.broadcast(t, 0)
    assert collectives.all_gather(t)[0].tolist() == [0.0, 1.0, 2.0]
    collectives.barrier()


def test_a_tensor_on_the_wrong_device_is_refused_with_the_fix(one_rank_group, monkeypatch):
    # present the group as NCCL: its tensors live on CUDA, and a CPU tensor (the DP > 1
    # step-1 crash) must fail here, on CPU, with the fix named
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "nccl")
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    assert collectives.device_of() == torch.device("cuda", 0)
    for call in (lambda t: collectives.all_reduce(t), lambda t: collectives.broadcast(t, 0),
                 lambda t: collectives.all_gather(t)):
        with pytest.raises(ValueError, match="device_of"):
            call(torch.zeros(2))


def test_objects_holding_tensors_are_refused():
    class Box:
        def __init__(self):
            self.hidden = torch.zeros(1)

    for obj in (torch.zeros(1), [1, {"h": torch.zeros(1)}], Box()):
        with pytest.raises(TypeError, match="tensor helpers"):
            collectives.all_gather_object(obj)
        with pytest.raises(TypeError, match="tensor helpers"):
            collectives.broadcast_object(obj)


def test_value_helpers_allocate_on_the_groups_device(one_rank_group, monkeypatch):
    seen = []
    real = dist.all_reduce

    def spy(t, *a, **k):
        seen.append(t.device.type)
        return real(t, *a, **k)

    monkeypatch.setattr(dist, "all_reduce", spy)
    collectives.sum_values([1.0])
    assert seen == ["cpu"]
