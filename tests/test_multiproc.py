"""TP=2 and PP=2 under `torchrun --nproc_per_node 2` (gloo): parity with transformers."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from cli import run_script
from tiny_models import TINY_CONFIGS

TOL = 1e-4
pytestmark = pytest.mark.multiproc


def _convert(src: Path, out: Path, tp: int, pp: int) -> None:
    r = run_script("tools/convert_hf_checkpoint.py", "--out", out, f"model.hf_path={src}",
                   f"parallel.tensor_model_parallel_size={tp}",
                   f"parallel.pipeline_model_parallel_size={pp}")
    assert r.returncode == 0, r.stderr


@pytest.mark.parametrize("tp,pp,ckpt_tp,ckpt_pp", [
    (2, 1, 2, 1),  # checkpoint at the run's own layout: shards load directly
    (1, 2, 2, 1),  # checkpoint written for TP=2, loaded at PP=2: resharded on load
])
def test_parallel_parity(tp, pp, ckpt_tp, ckpt_pp, tiny_hf_dirs, tmp_path):
    models = tmp_path / "models"
    models.mkdir()
    for name, folder in tiny_hf_dirs.items():
        (models / name).symlink_to(folder)
        _convert(folder, tmp_path / "ckpt" / name, ckpt_tp, ckpt_pp)
    out = tmp_path / "result.json"
    r = run_script("tests/mp_parity_worker.py", "--models", models, "--ckpt-root",
                   tmp_path / "ckpt", "--tp", tp, "--pp", pp, "--out", out, nproc=2,
                   timeout=600)
    assert r.returncode == 0, r.stderr[-4000:]
    results = json.loads(out.read_text())
    # TP=2: both ranks hold logits; PP=2: only the last stage does
    assert len(results) == len(TINY_CONFIGS) * (2 if tp == 2 else 1)
    if pp == 2:
        assert {r["pp_rank"] for r in results} == {1}
    for res in results:
        assert res["logits_max_diff"] <= TOL, res
        assert res["logprobs_max_diff"] <= TOL, res
        assert res["argmax_equal"], res
        assert res["checkpoint_equal"], res
        assert res["greedy_equal"], res
