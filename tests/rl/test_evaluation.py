"""Held-out evaluation: Wilson intervals, when evaluations run, what the report shows."""

from __future__ import annotations

import json
import types

import pytest

from megatron_tlt.rl.evaluation import eval_metrics, wilson_interval


@pytest.mark.parametrize("k,n", [(0, 10), (1, 10), (5, 10), (10, 10), (13, 64), (64, 64),
                                 (0, 1), (250, 1000)])
def test_wilson_interval_matches_scipy(k, n):
    from scipy.stats import binomtest

    want = binomtest(k, n).proportion_ci(confidence_level=0.95, method="wilson")
    lo, hi = wilson_interval(k, n)
    assert lo == pytest.approx(want.low, abs=1e-9) and hi == pytest.approx(want.high, abs=1e-9)
    assert 0.0 <= lo <= k / n <= hi <= 1.0


def test_eval_metrics():
    m = eval_metrics([(1.0, 1.0), (0.0, 0.0), (0.5, 0.0), (1.0, 1.0)])
    assert m["eval/prompts"] == 4 and m["eval/accuracy"] == 0.5
    assert (m["eval/accuracy_lo"], m["eval/accuracy_hi"]) == wilson_interval(2, 4)
    assert m["eval/reward"] == pytest.approx(0.625)
    assert eval_metrics([]) == {}


def _stub_trainer(steps: int, interval: int):
    """A Trainer whose step and evaluation are stand-ins: only the loop runs."""
    from megatron_tlt import checkpoint as checkpointing
    from megatron_tlt.config import load_config
    from megatron_tlt.rl.safe_point import SafePoints
    from megatron_tlt.rl.trainer import Trainer

    trainer = Trainer.__new__(Trainer)
    trainer.cfg = load_config([], [f"train.steps={steps}", f"train.eval_interval={interval}"])
    trainer.state = checkpointing.RunState()
    trainer.safe = SafePoints(trainer.state, checkpointing.Saver(asynchronous=False),
                              trainer.cfg.checkpoint, None, last_step=steps)
    trainer.evaluated_at = []
    trainer.engine = types.SimpleNamespace(tuner=None)  # no speculation: no step costs

    def train_step(step):
        trainer.state.step = step + 1
        return {"reward/mean": 0.0}

    def evaluate():
        trainer.evaluated_at.append(trainer.state.step)
        return {"eval/accuracy": 0.5}

    trainer.train_step, trainer.evaluate = train_step, evaluate
    return trainer


@pytest.mark.parametrize("steps,interval,want", [(5, 2, [0, 2, 4, 5]), (4, 4, [0, 4]),
                                                 (3, 0, [])])
def test_evaluation_before_the_first_step_and_after_the_last(steps, interval, want):
    trainer = _stub_trainer(steps, interval)
    history = trainer.train()
    assert trainer.evaluated_at == want
    assert [h["step"] for h in history if "eval/accuracy" in h] == want


def _history():
    base = {"reward/mean": 0.2, "accuracy": 0.2, "response_length/mean": 50,
            "response_length/p99": 90, "response_length/max": 100,
            "timing": {"rollout": 1.0, "tail": 0.5, "update": 1.0, "step": 2.5}}
    first = {"step": 0, **eval_metrics([(1.0, 1.0)] * 5 + [(0.0, 0.0)] * 27)}
    last = {"step": 2, **base, **eval_metrics([(1.0, 1.0)] * 12 + [(0.0, 0.0)] * 20)}
    return [first, {"step": 1, **base}, last]


def test_summary_shows_held_out_accuracy_at_start_and_end(capsys, tmp_path):
    from megatron_tlt.rl.report import print_summary

    print_summary(_history(), run_dir=tmp_path, metrics=tmp_path / "m.jsonl", wandb_dir=None,
                  plots=[], seconds=60.0, exported=tmp_path / "hf")
    out = capsys.readouterr().out
    lo0, hi0 = wilson_interval(5, 32)
    lo2, hi2 = wilson_interval(12, 32)
    assert f"0.16 [{lo0:.2f}, {hi0:.2f}]" in out and f"0.38 [{lo2:.2f}, {hi2:.2f}]" in out
    assert "at step 0 ->" in out and "at step 2 (32 prompts" in out
    assert str(tmp_path / "hf") in out


def test_curves_plot_held_out_accuracy(tmp_path):
    from megatron_tlt.rl.report import write_plots

    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text("".join(json.dumps(h) + "\n" for h in _history()))
    paths = write_plots(metrics, tmp_path / "plots")
    assert [p.name for p in paths] == ["curves.png"] and paths[0].stat().st_size > 0


def test_the_step_0_evaluation_sits_in_the_held_out_column_with_drafter_columns(capsys, tmp_path):
    """With the drafter group's columns, step 0's held-out cell is still the last one."""
    from megatron_tlt.rl.report import print_summary

    history = _history()
    for h in history:
        if "reward/mean" in h:
            h.update({"drafter/steps": 3, "drafter/alpha": 0.4, "drafter/idle_used_fraction": 0.9})
    print_summary(history, run_dir=tmp_path, metrics=tmp_path / "m.jsonl", wandb_dir=None,
                  plots=[], seconds=60.0)
    row0 = next(line for line in capsys.readouterr().out.splitlines()
                if line.strip("│ ").startswith("0 "))
    cells = [c.strip() for c in row0.strip().strip("│").split("│")]
    lo, hi = wilson_interval(5, 32)
    assert cells[-1] == f"0.16 [{lo:.2f}, {hi:.2f}]"
    assert all(c == "-" for c in cells[1:-1])


def test_the_reading_says_whether_held_out_accuracy_moved_and_what_tlt_did():
    from megatron_tlt.rl.report import reading

    history = _history()  # 5/32 -> 12/32: the intervals overlap
    lines = reading(history)
    assert any("no measurable change" in ln and "2 steps on 32 prompts" in ln
               and "docs/learning.md" in ln for ln in lines)
    assert not any(ln.startswith("TLT") for ln in lines)  # no speculation recorded
    history[-1].update(eval_metrics([(1.0, 1.0)] * 28 + [(0.0, 0.0)] * 4))
    assert any("rose beyond the step-0 95% interval" in ln for ln in reading(history))
    for h in history[1:]:
        h["spec"] = {"on_fraction": 0.5, "kinds": ["self", "eagle"],
                     "self": {"steps": 3, "accept_len": 3.0}, "eagle": {"steps": 0}}
    tlt = next(ln for ln in reading(history) if ln.startswith("TLT"))
    assert "rollout 1.0 s per step (0.5 s in the tail)" in tlt
    assert "speculation on 50% of decode steps" in tlt and "self x3.00" in tlt
    assert "eagle" not in tlt  # a kind that never speculated is not reported


def test_every_evaluation_records_each_held_out_prompt(tmp_path):
    """eval_prompts.jsonl: a line per evaluation, every prompt's reward and correctness
    in the prompts' order (what tools/learn.py pairs across runs)."""
    from megatron_tlt.tracking import Tracker

    trainer = _stub_trainer(4, 2)
    trainer.eval_prompts = ["p0", "p1", "p2"]

    def evaluate():
        trainer.last_eval = {"reward": [1.0, 0.0, float(trainer.state.step)],
                             "correct": [1.0, 0.0, 0.0]}
        return {"eval/accuracy": 1 / 3}

    trainer.evaluate = evaluate
    trainer.train_step = lambda step: (setattr(trainer.state, "step", step + 1) or
                                       {"reward/mean": 0.0, "accuracy": 0.0,
                                        "timing": {"step": 1.0}})
    trainer.cfg.tracking.progress = False
    tracker = Tracker(trainer.cfg.tracking, tmp_path, rank=0, config_dict={})
    trainer.train(tracker)
    lines = [json.loads(x) for x in (tmp_path / "eval_prompts.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines] == [0, 2, 4]
    assert [x["reward"][2] for x in lines] == [0.0, 2.0, 4.0]
    assert all(x["correct"] == [1.0, 0.0, 0.0] for x in lines)
    # every metrics record carries the machine's load beside its time (a CPU run's
    # seconds are read with it)
    records = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert records and all(isinstance(r["load_1m"], float) and r["load_1m"] >= 0 for r in records)
