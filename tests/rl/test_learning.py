"""rl/learning.py: two runs' curves and the paired held-out comparison (tools/learn.py)."""

from __future__ import annotations

import json

import pytest

from megatron_tlt.rl.evaluation import wilson_interval
from megatron_tlt.rl.learning import compare, paired_difference, read_run, write_figure


def _write_run(folder, evals: dict, rollout_s: float, steps: int = 4):
    folder.mkdir(parents=True)
    with open(folder / "metrics.jsonl", "w") as f:
        for s in range(1, steps + 1):
            f.write(json.dumps({"step": s, "reward/mean": 0.1 * s, "load_1m": float(s),
                                "timing": {"rollout": rollout_s, "tail": 1.0, "step": 9.0}}) + "\n")
        f.write(json.dumps({"step": 2, "reward/mean": 0.5,  # step 2 again: a resumed run
                            "timing": {"rollout": rollout_s, "tail": 1.0, "step": 9.0}}) + "\n")
        f.write('{"step": 5, "reward')  # a line cut by a kill
    with open(folder / "eval_prompts.jsonl", "w") as f:
        for s, correct in evals.items():
            f.write(json.dumps({"step": s, "correct": correct,
                                "reward": [float(c) for c in correct]}) + "\n")


def test_read_run_keeps_the_last_record_of_a_step_and_skips_a_cut_line(tmp_path):
    _write_run(tmp_path / "a", {0: [1, 0, 0, 0], 4: [1, 1, 0, 0]}, 10.0)
    run = read_run(tmp_path / "a")
    assert [s["step"] for s in run["steps"]] == [1, 2, 3, 4]
    assert run["steps"][1]["reward"] == 0.5
    assert [e["step"] for e in run["evals"]] == [0, 4]
    assert run["evals"][1]["accuracy"] == 0.5
    assert (run["evals"][1]["lo"], run["evals"][1]["hi"]) == wilson_interval(2, 4)


def test_paired_difference_counts_the_discordant_prompts():
    from scipy.stats import binomtest

    a = [1] * 30 + [0] * 10 + [1] * 5 + [0] * 55
    b = [1] * 30 + [0] * 10 + [0] * 5 + [1] * 15 + [0] * 40
    d = paired_difference(a, b)
    assert d["prompts"] == 100
    assert d["only_first_correct"] == 5 and d["only_second_correct"] == 15
    assert d["difference"] == pytest.approx(-0.10)
    assert d["lo"] < -0.10 < d["hi"] < 0
    assert d["mcnemar_p"] == pytest.approx(binomtest(5, 20, 0.5).pvalue)
    same = paired_difference([1, 0, 1], [1, 0, 1])
    assert same["difference"] == 0 and same["mcnemar_p"] == 1.0 and not same["significant"]
    with pytest.raises(ValueError, match="differ in number"):
        paired_difference([1, 0], [1])


def test_compare_reports_rise_rollout_ratio_and_the_final_paired_difference(tmp_path):
    n = 200
    base = [1] * 50 + [0] * 150
    later = [1] * 90 + [0] * 110
    _write_run(tmp_path / "off", {0: base, 4: later}, 20.0)
    _write_run(tmp_path / "tlt", {0: base, 4: later[:-1] + [1]}, 15.0)
    res = compare({"off": read_run(tmp_path / "off"), "tlt": read_run(tmp_path / "tlt")})
    off = res["arms"]["off"]
    assert off["rise"]["step0"] == 0.25 and off["rise"]["final"] == 90 / n
    assert off["load_1m_mean"] == pytest.approx((1 + 3 + 4) / 3)  # step 2's last record: none
    assert off["rise"]["final_beyond_step0_interval"]
    assert not off["rise"]["final_below_step0_interval"]
    entry = res["against_off"]["tlt"]
    assert entry["rollout_time_ratio"] == pytest.approx(0.75)
    assert entry["final_step"] == 4
    assert entry["held_out"]["difference"] == pytest.approx(1 / n)
    assert not entry["held_out"]["significant"]
    _write_run(tmp_path / "worse", {0: base, 4: [1] * 20 + [0] * 180}, 20.0)
    worse = compare({"off": read_run(tmp_path / "worse")})["arms"]["off"]["rise"]
    assert worse["final_below_step0_interval"] and not worse["final_beyond_step0_interval"]
    png = write_figure(res, tmp_path / "fig.png")
    assert png.stat().st_size > 10_000


def _bench_row(step, mode, off_s, tlt_s, identical=8):
    arm = lambda s, first: {"rollout": s, "replica_finish": [first, s], "tail": s - first,  # noqa: E731
                            "response_length_mean": 40.0, "response_length_max": 256,
                            "generated_tokens": 320, "spec_on_fraction": 0.2,
                            "accept_len": 4.0, "spec_tokens_by_kind": {"self": 50}}
    return {"mode": mode, "step": step, "responses": 8, "identical": identical,
            "arms": {"off": arm(off_s, 5.0), "tlt": arm(tlt_s, 5.0)}}


def test_speed_reads_the_interleaved_coupled_runs_and_their_aa_control():
    from megatron_tlt.rl.learning import speed

    pair = {"results": [_bench_row(1, "coupled", 12.0, 8.0), _bench_row(2, "coupled", 9.0, 9.0),
                        _bench_row(3, "coupled", 15.0, 10.0, identical=7),
                        _bench_row(1, "standard", 99.0, 1.0)]}  # another mode: not read
    aa = {"results": [_bench_row(s, "coupled", 10.0, t) for s, t in ((1, 9.0), (2, 11.0), (3, 10.0))]}
    sp = speed(pair, aa)
    assert [r["step"] for r in sp["steps"]] == [1, 2, 3]
    assert sp["rollout_speedup_median"] == pytest.approx(1.5)  # 1.5, 1.0, 1.5
    assert sp["rollout_speedup_range"] == pytest.approx([1.0, 1.5])
    assert sp["rollout_speedup_total"] == pytest.approx(36.0 / 27.0)
    assert sp["identical_fraction"] == pytest.approx(23 / 24)
    # the first replica finished at 5 s in both arms: the time TLT saved is the tail's
    assert sp["off_tail_s_mean"] == pytest.approx(7.0) and sp["tlt_tail_s_mean"] == pytest.approx(4.0)
    assert sp["aa_rollout_ratio_median"] == pytest.approx(1.0)
    assert sp["aa_rollout_ratio_range"] == pytest.approx([10 / 11, 10 / 9])
    # every plain rollout of a step's responses: the pair's off arm and both A/A arms
    assert sp["steps"][0]["plain_rollouts_s"] == [12.0, 10.0, 9.0]
    assert sp["steps"][0]["speedup_vs_plain_median"] == pytest.approx(10.0 / 8.0)
    assert sp["speedup_vs_plain_median"] == pytest.approx(10.0 / 9.0)  # 1.25, 10/9, 1.0
    assert sp["speedup_vs_plain_range"] == pytest.approx([1.0, 1.25])
    assert "aa_rollout_ratio_median" not in speed(pair)
