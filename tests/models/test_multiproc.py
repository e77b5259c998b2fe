"""TP=2, PP=2 and (mixture-of-experts models) EP=2 under `torchrun --nproc_per_node 2`
(gloo): parity with transformers, Qwen3 and Qwen3-MoE included; at EP=2 also the
rollout's paged KV cache against fixed slots (paged_cases.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from cli import run_main, run_script
from paged_cases import PAGED_MOE_MODEL, check_paged
from tiny_models import QWEN3_CONFIGS, TINY_CONFIGS

TOL = 1e-4
pytestmark = pytest.mark.multiproc


@pytest.fixture(scope="module")
def all_hf_dirs(tiny_hf_dirs, qwen3_hf_dirs) -> dict:
    return {**tiny_hf_dirs, **qwen3_hf_dirs}


@pytest.fixture(scope="module")
def tp2_checkpoints(all_hf_dirs, tmp_path_factory) -> Path:
    """Every tiny model converted to a megatron checkpoint sharded for TP=2, PP=1
    (tools/convert_hf_checkpoint.py's main in this process: no interpreter start-up per
    model; its command line is tested in test_conversion.py)."""
    root = tmp_path_factory.mktemp("ckpt_tp2")
    for name, folder in all_hf_dirs.items():
        r = run_main("tools/convert_hf_checkpoint.py", "--out", root / name,
                     f"model.hf_path={folder}", "parallel.tensor_model_parallel_size=2",
                     "parallel.pipeline_model_parallel_size=1")
        assert r.returncode == 0, r.stderr
    return root


def test_parallel_parity(all_hf_dirs, tp2_checkpoints, tmp_path):
    """TP=2 (a checkpoint at the run's own layout: shards load directly), PP=2 (the
    TP=2 checkpoint resharded on load) and EP=2 (the MoE models; each rank holds half
    the experts, tokens dispatched by all-to-all), one after the other in one torchrun
    launch."""
    models = tmp_path / "models"
    models.mkdir()
    for name, folder in all_hf_dirs.items():
        (models / name).symlink_to(folder)
    out = tmp_path / "result.json"
    r = run_script("tests/support/mp_parity_worker.py", "--models", models, "--ckpt-root",
                   tp2_checkpoints, "--layout", "2x1", "--layout", "1x2", "--layout",
                   "1x1x2", "--out", out, nproc=2, timeout=600)
    assert r.returncode == 0, r.stderr[-4000:]
    results = json.loads(out.read_text())
    # TP=2 and EP=2: both ranks hold logits; PP=2: only the last stage does
    n = len(TINY_CONFIGS) + len(QWEN3_CONFIGS)
    moe = [k for k, v in QWEN3_CONFIGS.items() if v["family"] == "qwen3_moe"]
    tp2 = [res for res in results if res["layout"] == "2x1"]
    pp2 = [res for res in results if res["layout"] == "1x2"]
    ep2 = [res for res in results if res["layout"] == "1x1x2"]
    assert len(tp2) == 2 * n and len(pp2) == n
    assert sorted(res["model"] for res in ep2) == sorted(moe * 2)
    assert {res["tp_rank"] for res in tp2} == {0, 1}
    assert {res["pp_rank"] for res in pp2} == {1}
    assert {res["ep_rank"] for res in ep2} == {0, 1}
    assert all(res["uneven_max_diff"] <= TOL for res in ep2)
    # rollout.kv_cache=paged at EP=2 (rows preempted; routes compared too), each rank
    # its own requests decoded in the EP group's union
    paged = [res for res in ep2 if res["model"] == PAGED_MOE_MODEL]
    assert len(paged) == 2 and paged[0]["paged"] != paged[1]["paged"]
    for res in paged:
        check_paged(res["paged"], f"ep2/rank{res['ep_rank']}")
    for res in results:
        assert res["logits_max_diff"] <= TOL, res
        assert res["logprobs_max_diff"] <= TOL, res
        assert res["argmax_equal"], res
        assert res["checkpoint_equal"], res
        assert res["greedy_equal"], res
