"""Reruns and resumes with speculation active (docs/running_at_scale.md,
"Reproducibility"): in the configurations the contract calls exact, a run killed
mid-update and resumed logs the uninterrupted run's metrics at every step. The killed
run is a second run of the same command up to the kill (step 1 compares two fresh
runs), the resumed one continues from the checkpoint (step 2 compares a resume). The
step-cost table is calibrated by the first run, written to the table file, and read by
the others; speculation runs in every decode step (``fault_inject.SPEC_ON``).

The three runs cover the self-drafter and the one-layer drafter (both kinds side by
side on the Llama), standard sampling without the drafter group, and coupled sampling
with the group training the drafter, on a tiny Llama and a tiny Qwen3-MoE at EP 2;
``tools/fault_inject.py sweep --config`` runs every combination."""

from __future__ import annotations

import json

import pytest

from cli import forked_fault_inject
from rl_fixtures import save_tiny_moe_policy, save_tiny_policy

fault_inject = forked_fault_inject()  # its launches' ranks forked from a warm interpreter

STEPS = 2
CASES = ["moe_ep2_self_standard", "llama_both_standard", "moe_ep2_eagle_coupled_group"]
# coupled sampling with the drafter group: the drafter's own numbers follow idle time
DRAFTER_OWN = ("drafter", "accept", "alpha", "on_fraction", "emitted", "drafted", "arms",
               "chosen", "steps", "rows", "catchup", "bucket_choice", "declined", "probes")


@pytest.fixture(scope="module")
def policies(smollm2_dir, tmp_path_factory, single_process_parallel):
    root = tmp_path_factory.mktemp("spec_resume")
    out = {"llama": save_tiny_policy(root / "llama", smollm2_dir, layers=1),
           "moe": save_tiny_moe_policy(root / "moe", smollm2_dir)}
    for p in out.values():
        fault_inject.make_drafter(p)
    return out


@pytest.mark.multiproc
@pytest.mark.timeout(1800)  # three launches of two ranks (a loaded 2-core machine)
@pytest.mark.parametrize("name", CASES)
def test_speculating_runs_rerun_and_resume_exactly(name, policies, tmp_path):
    model, _, overrides = fault_inject.CONFIGS[name]
    policy, costs = policies[model], tmp_path / "step_costs.json"
    extra = fault_inject.config_args(name, policy, costs)
    ref_root = tmp_path / "reference"
    r = fault_inject.launch(fault_inject.run_args(policy, ref_root / "runs", ref_root / "ckpt",
                                                  STEPS) + extra)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "reproducible: bit-exact reruns and resumes" in r.stdout, r.stdout[-2000:]
    table = json.loads(costs.read_text())  # calibrated once, by the first run
    assert json.loads((ref_root / "runs" / "run" / "step_costs.json").read_text()) == table
    coupled_group = "drafter_group.enable=true" in overrides
    skip = fault_inject.VOLATILE + (DRAFTER_OWN if coupled_group else ())
    ref = fault_inject.metrics(ref_root / "runs" / "run", skip)
    full = fault_inject.metrics(ref_root / "runs" / "run")
    on = [full[s]["spec"]["on_fraction"] for s in sorted(full)]
    print(f"{name}: speculation on in {on} of the decode steps")
    assert sorted(ref) == list(range(1, STEPS + 1)) and min(on) >= 1 / 3
    res = fault_inject.killed_and_resumed(policy, tmp_path / "killed", STEPS,
                                          f"update:{STEPS}", extra=tuple(extra))
    assert res["killed_rc"] != 0 and res["resume_rc"] == 0, res["stderr"]
    assert res["resumed_from"] == f"step_{STEPS - 1:07d}"
    got = fault_inject.metrics(res["run"], skip)
    assert fault_inject.compare(ref, got) == []
    assert "reward/mean" in got[1] and "grad_norm" in got[STEPS]
