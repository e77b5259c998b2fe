"""GRPO on a mixture-of-experts policy (tiny Qwen3-MoE) under torchrun (gloo): DP=2,
EP=2 (each rank holds half the experts; tokens dispatched by all-to-all), TP=2
(sequence parallelism, expert weights sharded over TP) and PP=2 compute what one
process computes: loss sums, gradient norms and the updated model's log-probs of a probe
batch (tests/support/mp_rl_worker.py, one update on a fixed global batch)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from cli import run_script
from rl_fixtures import save_tiny_moe_policy

pytestmark = pytest.mark.multiproc

UPDATE = ["grpo.prompts_per_step=4", "grpo.group_size=2", "train.global_batch_size=4",
          "grpo.ppo_epochs=2", "train.micro_batch_size=2", "train.lr=1e-3",
          "data.train_size=16", "grpo.kl_beta=0.1", "grpo.entropy_coef=0.01",
          "grpo.clip_eps_high=0.2", "rollout.cpu_kernels=false",
          "train.moe_aux_loss_coef=0.0"]
LAYOUTS = {"dp2": "", "ep2": "parallel.expert_model_parallel_size=2",
           "tp2": "parallel.tensor_model_parallel_size=2",
           "pp2": "parallel.pipeline_model_parallel_size=2"}
# replica 1 holds only equal-reward groups (no KL, no entropy: zero advantages): at EP=2
# it still runs as many micro-batches as replica 0 (filler ones), or the all-to-alls
# of replica 0's MoE layers would wait for it forever
FLAT_EP = ("parallel.expert_model_parallel_size=2,grpo.kl_beta=0.0,grpo.entropy_coef=0.0,"
           "flat_prompts=2/3")
FLAT = "grpo.kl_beta=0.0,grpo.entropy_coef=0.0,flat_prompts=2/3"
# the load-balancing loss on: a per-micro-batch statistic, so not layout-invariant; its
# metric and the expert load are reported
AUX = "train.moe_aux_loss_coef=0.01"


def _run(out, variants, policy, nproc):
    args = [a for v in variants for a in ("--variant", v)]
    r = run_script("tests/support/mp_rl_worker.py", "--out", out, *args,
                   f"model.hf_path={policy}", *UPDATE, nproc=nproc, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    by: dict[str, list] = {}
    for res in json.loads(out.read_text()):
        by.setdefault(res["variant"], []).append(res)
    return by


def test_moe_update_at_dp2_ep2_tp2_equals_one_process(smollm2_dir, tmp_path):
    policy = save_tiny_moe_policy(tmp_path / "policy", smollm2_dir)
    single = _run(tmp_path / "one.json", ["", FLAT, AUX], policy, 1)
    parallel = _run(tmp_path / "two.json", [*LAYOUTS.values(), FLAT_EP], policy, 2)
    ref = single[""][0]
    assert ref["sums"]["clip_low_count"] + ref["sums"]["clip_high_count"] > 0
    for layout, variant in LAYOUTS.items():
        assert len(parallel[variant]) == (1 if layout == "pp2" else 2), layout  # PP: last stage
        for res in parallel[variant]:
            np.testing.assert_allclose(res["probe_logprobs"], ref["probe_logprobs"],
                                       atol=2e-4, rtol=0, err_msg=layout)
            np.testing.assert_allclose(res["grad_norm"][0], ref["grad_norm"][0], rtol=1e-5,
                                       err_msg=layout)
            np.testing.assert_allclose(res["grad_norm"], ref["grad_norm"], rtol=1e-3,
                                       err_msg=layout)
            for key, value in ref["sums"].items():
                tol = 2.0 if key.endswith("_count") else 1e-4 * max(abs(value), 1.0)
                assert abs(res["sums"][key] - value) <= tol, (layout, key)
    for res in parallel[FLAT_EP]:
        np.testing.assert_allclose(res["probe_logprobs"], single[FLAT][0]["probe_logprobs"],
                                   atol=2e-4, rtol=0)
    # expert load per MoE layer (1 = balanced, at most experts / k = 4), about equal at
    # every layout (padding positions are routed and counted too, and micro-batches pad
    # differently); the auxiliary loss only where it is on, and it changes the update
    for res in [ref, *parallel[""], *parallel[LAYOUTS["ep2"]]]:
        load = res["moe"]
        assert set(load) == {"moe/load_max/layer0", "moe/load_max/layer1", "moe/load_max"}
        assert 1.0 <= load["moe/load_max"] <= 4.0
        np.testing.assert_allclose(load["moe/load_max"], ref["moe"]["moe/load_max"],
                                   rtol=0.02)
    aux = single[AUX][0]
    assert aux["moe"]["moe/aux_loss"] > 0
    assert aux["probe_logprobs"] != ref["probe_logprobs"]
