"""tools/alpha_kinds.py (drafter_training/alpha_kinds.py): the exact α by depth of the
one-layer drafter and the self-drafter side by side on the same held-out samples, with
a deliberately degraded copy (another model's weights quantized) as a third column."""

from __future__ import annotations

import json

import pytest

from cli import run_script
from rl_fixtures import save_tiny_policy


@pytest.fixture(scope="module")
def two_policies(smollm2_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("alpha_kinds")
    return (save_tiny_policy(root / "policy", smollm2_dir, seed=0),
            save_tiny_policy(root / "other", smollm2_dir, seed=3))


def test_cli_reports_both_kinds_on_the_same_samples(two_policies, tmp_path):
    policy, other = two_policies
    out = tmp_path / "alpha.json"
    r = run_script("tools/alpha_kinds.py", "--model", policy, "--drafter", "random",
                   "--self-source", other, "--prompts", "2", "--max-new-tokens", "12",
                   "--temperature", "1.0", "--depth", "3", "--json", out, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(out.read_text())
    kinds = res["kinds"]
    assert list(kinds) == ["eagle", "self", "self@other"]
    assert [k["extra"]["kind"] for k in kinds.values()] == ["eagle", "self", "self"]
    # the same positions for every kind, depth by depth (depth d: all but the first
    # d-1 of each response)
    n = res["tokens_by_depth"]
    assert len(n) == 3 and n[0] > n[1] > n[2] > 0
    assert all(k["extra"]["tokens_by_depth"] == n for k in kinds.values())
    assert all(k["temperature"] == 1.0 and len(k["alpha"]) == 3 for k in kinds.values())
    a = {name: k["alpha"] for name, k in kinds.items()}
    assert [row["self"] for row in res["alpha_by_depth"]] == a["self"]
    # the policy's own int8 copy is nearly exact; another model's copy and an
    # untrained one-layer drafter are far from it
    assert min(a["self"]) > 0.95
    assert max(a["self@other"]) < a["self"][0] - 0.3
    assert max(a["eagle"]) < 0.5
    # the engine's measured chain acceptance follows α
    meas = {name: k["measured_accept_len"] for name, k in kinds.items()}
    assert meas["self"] > 3.0 and meas["self"] > meas["self@other"] > 0.99
    assert meas["eagle"] < meas["self"]
    # the text table: one column per kind, one row per depth
    lines = r.stdout.splitlines()
    head = next(x for x in lines if "self@other" in x and "eagle" in x)
    assert head.split() == ["eagle", "self", "self@other"]
    assert sum(x.startswith("alpha depth") for x in lines) == 3
