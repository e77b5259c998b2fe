"""The drafter group at tensor parallelism 2 under torchrun (4 gloo ranks, TP = 2 x DP = 2,
a tiny model): a replica's TP ranks train together, every rank ends with the same
drafter, a failure on one TP rank is the replica's, and the loss and its clipped
gradient equal TP = 1's (scenarios in tests/support/mp_drafter_group_tp_worker.py)."""

from __future__ import annotations

import pytest
import torch

from cli import run_workers

pytestmark = pytest.mark.multiproc


@pytest.fixture(scope="module")
def results(tiny_hf_dirs, tmp_path_factory):
    return run_workers("tests/support/mp_drafter_group_tp_worker.py",
                       tmp_path_factory.mktemp("dgroup_tp"), "--model",
                       tiny_hf_dirs["llama_tied"], nproc=4)


def test_uneven_finish_at_tp2_early_replica_trains_and_all_ranks_agree(results):
    assert {(r["dp_rank"], r["tp_rank"]) for r in results} == {(0, 0), (0, 1), (1, 0), (1, 1)}
    for r in results:
        u = r["uneven"]
        early = r["dp_rank"] == 0
        assert u["failure"] is None and not u["healed"]
        assert (u["steps"] >= 3) if early else (u["steps"] == 0)
        assert u["last_finisher"] == (not early)  # on both TP ranks of the replica
        # the whole (unsharded) drafter and its moments: trained, the same on all 4 ranks
        assert u["changed"] and u["identical"] and u["checksums_equal"]
        assert u["version"] == 1 and u["policy_untouched"]
        assert 0.0 <= u["alpha"] <= 1.0
    steps = {r["dp_rank"]: r["uneven"]["steps"] for r in results}
    assert len({r["uneven"]["steps"] for r in results if r["dp_rank"] == 0}) == 1, steps


def test_a_failure_on_one_tp_rank_restores_the_whole_replica(results):
    for r in results:
        f = r["tp_failure"]
        assert f["restored"] and f["identical"] and f["speculation_off"]
        assert f["steps"] == 0
        if r["dp_rank"] == 0:
            assert f["failure"] is not None
            if r["tp_rank"] == 0:  # its own loss was finite: told by its TP peer
                assert "another model-parallel rank" in f["failure"]


def test_loss_and_clipped_gradient_at_tp2_equal_tp1(results):
    for r in results:
        for vocab in ("full", "pruned"):
            a, b = r["tp2"][vocab], r["tp1"][vocab]
            assert a["loss"] == pytest.approx(b["loss"], rel=1e-5, abs=1e-6), vocab
            assert a["alpha"] == pytest.approx(b["alpha"], rel=1e-5, abs=1e-6), vocab
            ga, gb = torch.tensor(a["grad"]), torch.tensor(b["grad"])
            # clipped to the same total norm (grad_clip 0.05 binds)
            assert float(gb.norm()) == pytest.approx(0.05, rel=1e-4)
            assert torch.allclose(ga, gb, rtol=1e-4, atol=1e-6 * float(gb.abs().max())), vocab
        assert "WholeVocabTarget" in r["bare_runner_error"]


def test_a_fresh_drafter_is_the_same_at_tp2_and_tp1(results):
    # the unsharded matrices are drawn and sharded, not one shard drawn per TP rank
    # (TP copies of one shard would stay copies: a drafter with duplicated heads)
    assert all(r["init_same"] for r in results)
