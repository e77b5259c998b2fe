"""GRPO under torchrun (gloo): DP=2, TP=2 and PP=2 compute what one process computes.

One update (2 ppo epochs x 2 mini-batches, KL and entropy terms on, clipping active) on
a fixed global batch: the loss sums, gradient norms and the updated model's log-probs of
a probe batch must match the single-process run. Then whole CLI steps at DP=2 (with
speculative decoding and the paged KV cache) and PP=2 (pipeline decoding) run end to
end.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from cli import run_script
from rl_fixtures import save_tiny_policy

pytestmark = pytest.mark.multiproc

UPDATE = ["grpo.prompts_per_step=4", "grpo.group_size=2", "train.global_batch_size=4",
          "grpo.ppo_epochs=2", "train.micro_batch_size=2", "train.lr=1e-3",
          "data.train_size=16", "grpo.kl_beta=0.1", "grpo.entropy_coef=0.01",
          "grpo.clip_eps_high=0.2", "rollout.cpu_kernels=false"]


@pytest.fixture(scope="module")
def policy(smollm2_dir, tmp_path_factory):
    return save_tiny_policy(tmp_path_factory.mktemp("rlpar") / "policy", smollm2_dir)


# TP=2 with sequence parallelism (auto: on) and selective recomputation, PP=2 with
# variable_seq_lengths and full recomputation: none of them may change the update
LAYOUTS = {"dp2": "",
           "tp2": "parallel.tensor_model_parallel_size=2,train.recompute_granularity=selective",
           "pp2": "parallel.pipeline_model_parallel_size=2,train.recompute_granularity=full"}
# Replica 1's groups all have equal rewards (prompts 2 and 3 go to replica 1: mini-batches
# = 2, replica (p // 2) % 2), without the KL and entropy terms
FLAT = "grpo.kl_beta=0.0,grpo.entropy_coef=0.0,flat_prompts=2/3"


def _results(out) -> dict[str, list]:
    """variant -> the ranks' results of one worker launch."""
    by_variant: dict[str, list] = {}
    for res in json.loads(out.read_text()):
        by_variant.setdefault(res["variant"], []).append(res)
    return by_variant


@pytest.fixture(scope="module")
def single(policy, tmp_path_factory):
    """The single-process update of the common batch ("") and of the FLAT batch, one
    launch."""
    out = tmp_path_factory.mktemp("single") / "r.json"
    r = run_script("tests/support/mp_rl_worker.py", "--out", out, "--variant", "",
                   "--variant", FLAT, f"model.hf_path={policy}", *UPDATE)
    assert r.returncode == 0, r.stderr[-3000:]
    res = _results(out)
    assert sorted(res) == sorted(["", FLAT]) and all(len(v) == 1 for v in res.values())
    return {k: v[0] for k, v in res.items()}


@pytest.fixture(scope="module")
def parallel(policy, tmp_path_factory):
    """DP=2, TP=2 and PP=2 updates of the common batch and the DP=2 update of the FLAT
    batch, one after the other in one torchrun launch (the worker sets each up afresh)."""
    out = tmp_path_factory.mktemp("parallel") / "r.json"
    variants = [arg for v in [*LAYOUTS.values(), FLAT] for arg in ("--variant", v)]
    r = run_script("tests/support/mp_rl_worker.py", "--out", out, *variants,
                   f"model.hf_path={policy}", *UPDATE, nproc=2, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    return _results(out)


def test_dp2_equals_dp1_when_a_replica_has_only_zero_advantages(single, parallel):
    """Replica 1's groups all have equal rewards, so it skips every forward/backward
    (exact: their loss is zero); the replicas must still agree on every reduction."""
    single_res = single[FLAT]
    assert len(parallel[FLAT]) == 2
    for res in parallel[FLAT]:
        np.testing.assert_allclose(res["probe_logprobs"], single_res["probe_logprobs"],
                                   atol=2e-4, rtol=0)
        assert res["sums"]["tokens"] == single_res["sums"]["tokens"]
    # what each replica's update processed (the planner's update model): the flat
    # replica only forwards; each sample is processed once per ppo epoch, padded
    epochs = 2
    flat, other = sorted(parallel[FLAT], key=lambda r: -r["lengths"]["zero"])
    assert flat["lengths"]["advantage"] == 0
    assert flat["work"]["backward_tokens"] == flat["work"]["backward_micro_batches"] == 0
    assert flat["work"]["forward_tokens"] >= epochs * flat["lengths"]["zero"] > 0
    assert other["work"]["backward_tokens"] >= epochs * other["lengths"]["advantage"] > 0
    assert other["work"]["backward_micro_batches"] >= epochs
    for res in parallel[FLAT]:  # rows x padded length^2 per micro-batch: at least each
        # sample's own length^2, once per epoch
        w, n = res["work"], res["lengths"]
        assert w["backward_cells"] >= epochs * n["advantage_sq"]
        assert w["forward_cells"] >= epochs * n["zero_sq"]
        assert (w["forward_cells"] > 0) == (w["forward_tokens"] > 0)
    for res in parallel[FLAT]:
        w = res["work"]
        assert (w["forward_micro_batches"] > 0) == (res["lengths"]["zero"] > 0)
        # the parts' seconds: only where there was work (the optimizer step always runs)
        assert (w["forward_seconds"] > 0) == (w["forward_tokens"] > 0)
        assert w["backward_seconds"] >= 0 and w["step_seconds"] > 0
    assert other["work"]["backward_seconds"] > 0


def test_parallel_update_equals_single_process(single, parallel):
    """DP=2, TP=2 and PP=2, each against the single-process update."""
    single = single[""]
    assert single["sums"]["clip_low_count"] + single["sums"]["clip_high_count"] > 0
    for layout, variant in LAYOUTS.items():
        results = parallel[variant]
        assert len(results) == (1 if layout == "pp2" else 2), layout  # PP: the last stage
        for res in results:
            np.testing.assert_allclose(res["probe_logprobs"], single["probe_logprobs"],
                                       atol=2e-4, rtol=0, err_msg=layout)
            # the first optimizer step sees identical weights; later ones inherit Adam's
            # amplification of last-bit differences (TP all-reduce order)
            np.testing.assert_allclose(res["grad_norm"][0], single["grad_norm"][0],
                                       rtol=1e-5, err_msg=layout)
            np.testing.assert_allclose(res["grad_norm"], single["grad_norm"], rtol=1e-3,
                                       err_msg=layout)
            for key, value in single["sums"].items():
                # counts of clipped tokens may differ where a ratio sits on the clip edge
                tol = 2.0 if key.endswith("_count") else 1e-4 * max(abs(value), 1.0)
                assert abs(res["sums"][key] - value) <= tol, (layout, key, res["sums"][key],
                                                              value)


def test_cli_step_at_dp2_with_speculation_and_at_pp2(policy, tmp_path,
                                                     single_process_parallel):
    from megatron_tlt.models import arch_from_source
    from megatron_tlt.models.drafter import DrafterConfig, EagleDrafter, save_drafter

    arch = arch_from_source(policy)
    drafter = save_drafter(EagleDrafter(DrafterConfig.for_target(arch), arch),
                           tmp_path / "d.safetensors")
    common = [f"model.hf_path={policy}", "grpo.prompts_per_step=2", "grpo.group_size=2",
              "grpo.max_new_tokens=4", "train.steps=1", "data.train_size=8",
              "tracking.progress=false", "tracking.plots=false", "tracking.run_name=run",
              "reward.format_reward=1.0", "reward.format_pattern=k",
              "grpo.dynamic_sampling=true", "grpo.dynamic_sampling_rounds=1"]
    r = run_script("pretrain_rl_tlt.py", *common, f"tracking.output_dir={tmp_path / 'dp'}",
                   f"rollout.speculative.drafter={drafter}",
                   "rollout.speculative.policy=fixed", "rollout.speculative.strategy=2_1_2",
                   "rollout.kv_cache=paged", nproc=2, timeout=600,
                   torchrun=True)  # the user's launch: torchrun's agent and rendezvous
    assert r.returncode == 0, r.stderr[-3000:]
    rec = json.loads((tmp_path / "dp" / "run" / "metrics.jsonl").read_text().splitlines()[0])
    assert len(rec["timeline"]["replica_finish"]) == 2
    assert rec["spec"]["steps"] > 0
    assert rec["timing"]["tail"] >= 0 and rec["idle_replica_seconds"] >= 0
    work = rec["timeline"]["update_work"]  # each replica's: padded tokens, seconds
    assert [len(v) for v in work.values()] == [2] * 9
    assert all(b + f > 0 for b, f in zip(work["backward_tokens"], work["forward_tokens"]))
    # one prefill per prompt: each replica's 1 prompt x 2 runs once, the other copies it
    # (dynamic sampling's round adds its own)
    assert rec["rollout/prefill_tokens"] > 0 and rec["rollout/prefill_seconds"] > 0
    assert rec["rollout/prefill_shared_rows"] >= 2
    assert rec["dynamic_sampling/rounds"] <= 1
    # the paged KV cache's figures, over the replicas: 2 rows each at most, within the
    # default budget (what max_batch_size full-length rows reserve): nothing preempted
    assert rec["rollout/rows_peak"] == 2 and rec["rollout/preemptions"] == 0
    assert rec["rollout/kv_bytes_peak"] > 0
    assert 0 <= rec["dynamic_sampling/replaced"] <= 2  # at most every group of the step
    r = run_script("pretrain_rl_tlt.py", *common, f"tracking.output_dir={tmp_path / 'pp'}",
                   "parallel.pipeline_model_parallel_size=2", nproc=2, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    rec = json.loads((tmp_path / "pp" / "run" / "metrics.jsonl").read_text().splitlines()[0])
    assert rec["response_length/max"] <= 4 and len(rec["timeline"]["replica_finish"]) == 1
