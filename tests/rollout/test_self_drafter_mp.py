"""The self-drafter on two processes (tests/support/mp_self_drafter_worker.py): at TP=2
each rank quantizes its shards and speculation stays exact; two data-parallel replicas
re-quantize an updated policy bit-identically; at PP=2 (gathered) each stage quantizes
its copy of the whole model, bit-identically, and speculation stays exact."""

from __future__ import annotations

import pytest

from cli import run_workers

pytestmark = pytest.mark.multiproc


def test_self_drafter_at_tp2_is_exact(tiny_hf_dirs, tmp_path):
    ranks = run_workers("tests/support/mp_self_drafter_worker.py", tmp_path / "out",
                        "--model", tiny_hf_dirs["llama_tied"], "--tp", 2, nproc=2)
    assert ranks[0] == ranks[1]  # the TP ranks agree on every token
    r = ranks[0]
    for case in ("chain", "tree", "chain_vocab"):
        assert r[case] == r["plain"], case  # greedy: plain decoding's tokens
        assert r[case + "/steps"] > 0 and r[case + "/shards"], case
    assert r["coupled_tree"] == r["coupled_plain"]


def test_replicas_refresh_bit_identically(tiny_hf_dirs, tmp_path):
    ranks = run_workers("tests/support/mp_self_drafter_worker.py", tmp_path / "out",
                        "--model", tiny_hf_dirs["llama_tied"], "--tp", 1, nproc=2)
    a, b = ranks
    assert a["before"] == b["before"] and a["after"] == b["after"]
    assert a["after"] != a["before"]  # the update was picked up ...
    assert a["refreshes"] == b["refreshes"] == 2  # ... by one re-quantization
    assert a["tokens"] == b["tokens"]


def test_self_drafter_at_pp2_gathered_is_exact_and_identical_across_stages(
        tiny_hf_dirs, tmp_path, single_process_parallel):
    import torch

    from megatron_tlt.config import RolloutConfig
    from megatron_tlt.models import load_model
    from megatron_tlt.rollout import RolloutEngine, SamplingParams
    from megatron_tlt.runtime_env import apply_cpu_redirection
    from rollout_cases import case_prompts

    ranks = run_workers("tests/support/mp_self_drafter_worker.py", tmp_path / "out",
                        "--model", tiny_hf_dirs["llama_tied"], "--tp", 1, "--pp", 2,
                        nproc=2)
    assert ranks[0] == ranks[1]  # the stages return the same outputs, hold the same copy
    r = ranks[0]
    for case in ("chain", "tree", "chain_fp8"):  # greedy: plain decoding's tokens
        assert r[case] == r["plain"] and r[case + "/steps"] > 0, case
    assert r["coupled_tree"] == r["coupled_plain"] and r["coupled_steps"] > 0
    assert r["layers"][0] == r["layers"][1] == r["layers"][2]  # the whole model
    # an update: re-quantized from the gathered weights, still exact, still identical
    assert r["after"] != r["before"] and r["requantized"]
    assert r["coupled_after"] == r["coupled_plain_after"]
    assert r["deferred_layers"] == 0 and r["deferred_hash"] == r["after"]
    assert r["deferred"] == r["coupled_plain_after"]
    assert "pipeline_mode=gathered" in r["pipelined_error"]
    # and the PP = 2 outputs are the single-process engine's
    apply_cpu_redirection()
    model, arch = load_model(tiny_hf_dirs["llama_tied"], device=torch.device("cpu"),
                             dtype="float32")
    greedy = SamplingParams(temperature=0.0, max_new_tokens=12)  # the worker's GREEDY
    ref = RolloutEngine(model, None, RolloutConfig(), arch=arch, eos_token_ids=[]).generate(
        case_prompts(), greedy)
    assert r["plain"] == [o.token_ids for o in ref]
