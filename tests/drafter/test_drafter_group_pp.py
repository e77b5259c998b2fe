"""The drafter group at pipeline parallelism 2 under torchrun (4 gloo ranks, PP = 2 x
DP = 2, rollout.pipeline_mode=gathered, a tiny untied model): a replica's pipeline ranks
train together, every rank ends with the same drafter, a failure on one stage is the
replica's and turns speculation off everywhere, a checkpoint restores the same drafter
on every rank, and the loss and the after-update canary equal PP = 1's (scenarios in
tests/support/mp_drafter_group_pp_worker.py)."""

from __future__ import annotations

import pytest
import torch

from cli import run_workers

pytestmark = pytest.mark.multiproc


@pytest.fixture(scope="module")
def results(tiny_hf_dirs, tmp_path_factory):
    return run_workers("tests/support/mp_drafter_group_pp_worker.py",
                       tmp_path_factory.mktemp("dgroup_pp"), "--model",
                       tiny_hf_dirs["llama_untied"], nproc=4)


def test_uneven_finish_at_pp2_early_replica_trains_and_all_ranks_agree(results):
    assert {(r["dp_rank"], r["pp_rank"]) for r in results} == {(0, 0), (0, 1), (1, 0), (1, 1)}
    for r in results:
        u = r["uneven"]
        early = r["dp_rank"] == 0
        assert u["failure"] is None and not u["healed"]
        # one announcement per replica: the early one's stages do not count as two
        assert (u["steps"] >= 3) if early else (u["steps"] == 0)
        assert u["last_finisher"] == (not early)  # on both stages of the replica
        assert u["changed"] and u["identical"] and u["checksums_equal"]
        assert u["version"] == 1 and u["policy_untouched"]
        assert 0.0 <= u["alpha"] <= 1.0 and u["alphas_equal"]
    assert len({r["uneven"]["steps"] for r in results if r["dp_rank"] == 0}) == 1


def test_a_failure_on_one_stage_restores_the_replica_and_pauses_speculation(results):
    for r in results:
        f = r["pp_failure"]
        assert f["restored"] and f["identical"] and f["speculation_off"]
        assert f["steps"] == 0
        assert f["guarded_spec_steps"] == 0 and f["after_spec_steps"] > 0
        if r["dp_rank"] == 0:
            assert f["failure"] is not None
            if r["pp_rank"] == 0:  # its own loss was finite: told by the other stage
                assert "another model-parallel rank" in f["failure"]


def test_checkpoint_restores_the_same_drafter_on_every_rank(results):
    for r in results:
        assert r["resume"]["differed_before"]
        assert all(r["resume"].values()), r["resume"]


def test_loss_and_clipped_gradient_at_pp2_equal_pp1_on_both_stages(results):
    for r in results:
        for vocab in ("full", "pruned"):
            a, b = r["pp2"][vocab], r["pp1"][vocab]
            assert a["loss"] == pytest.approx(b["loss"], rel=1e-5, abs=1e-6), vocab
            assert a["alpha"] == pytest.approx(b["alpha"], rel=1e-5, abs=1e-6), vocab
            ga, gb = torch.tensor(a["grad"]), torch.tensor(b["grad"])
            assert torch.allclose(ga, gb, rtol=1e-4, atol=1e-6 * float(gb.abs().max())), vocab


def test_canary_after_a_policy_update_reads_the_updated_vocabulary_on_every_stage(results):
    for r in results:
        c = r["canary"]
        assert c["alphas_equal"]
        assert c["alpha"] != c["before_update"]  # the update reaches the measurement
        assert c["alpha"] == pytest.approx(c["pp1_alpha"], rel=1e-5, abs=1e-6)
