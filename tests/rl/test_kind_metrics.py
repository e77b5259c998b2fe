"""Per drafter kind metrics outside the engine: SpecStats' kind timeline and merge
(rollout/speculative/stats.py), the summary table's per-kind and per-bucket columns and
the plots' per-kind lines and timeline bands (rl/report.py), on synthetic records."""

from __future__ import annotations

import json

import pytest

from megatron_tlt.rollout.speculative.stats import SpecStats
from megatron_tlt.spec_strategy import OFF, Strategy

S313 = Strategy.parse("3_1_3")


def _stats() -> SpecStats:
    st = SpecStats()
    st.record_kind("self", "1", S313, probe=False, rows=1, emitted=4, seconds=2.0)
    st.record_kind("self", "1", S313, probe=True, rows=1, emitted=2, seconds=2.0)
    st.record_kind("eagle", "1", OFF, probe=False, rows=1, emitted=1, seconds=1.0)
    st.record_kind("eagle", "2", S313, probe=False, rows=2, emitted=3, seconds=2.0)
    return st


def test_kind_steps_and_bucket_choice():
    s = _stats().summary()
    assert s["kinds"]["self"]["accept_len"] == 3.0
    assert s["kinds"]["self"]["spec_tok_s"] == pytest.approx(6 / 4)
    assert s["kinds"]["eagle"]["chosen"] == 2 and s["kinds"]["eagle"]["declined"] == 1
    assert s["kinds"]["eagle"]["buckets"]["1"]["arms"] == {"0_0_0": 1}
    b1 = s["bucket_choice"]["1"]
    assert b1["kinds"] == {"self": 2, "eagle": 0} and b1["plain"] == 1
    assert b1["choice"] == "self 3_1_3" and b1["share"] == pytest.approx(2 / 3)
    assert s["bucket_choice"]["2"]["choice"] == "eagle 3_1_3"


def test_merged_stats_sum_the_kinds():
    """Two pipeline ranks' shares of one call (pipeline_mode=gathered) merge kind by
    kind, bucket by bucket; the timeline stays the first rank's."""
    a, b = _stats(), _stats()
    a.mark(0.0, 1.0, "self")
    m = a.merged(b)
    assert m.kinds["self"].steps == 4 and m.kinds["self"].emitted == 12
    assert m.kinds["eagle"].bucket_arms == {"1": {"0_0_0": 2}, "2": {"3_1_3": 2}}
    assert m.kinds["eagle"].by_bucket["2"].rows == 4
    assert m.segments == [[0.0, 1.0, "self"]]
    assert a.kinds["self"].steps == 2  # the parts are unchanged


def test_timeline_segments_merge_runs_and_bin_long_ones():
    st = SpecStats()
    st.mark(0.0, 1.0, "self")
    st.mark(1.0, 2.0, "self")
    st.mark(2.0, 3.0, None)  # above the threshold: the run ends
    st.mark(3.0, 4.0, "self")
    st.mark(4.0, 4.5, "plain")
    assert st.segments == [[0.0, 2.0, "self"], [3.0, 4.0, "self"], [4.0, 4.5, "plain"]]
    # 400 alternating steps: binned to at most 8 pieces, each what took most of its time
    st = SpecStats()
    for i in range(400):
        what = "eagle" if i < 200 else ("self" if i % 4 else "plain")
        st.mark(i * 0.1, i * 0.1 + 0.1, what)
    segs = st.segments_summary(limit=8)
    assert len(segs) <= 8
    assert [w for *_, w in segs] == ["eagle", "self"]
    assert segs[0][0] == 0.0 and segs[-1][1] == pytest.approx(40.0)
    assert segs[0][1] == pytest.approx(20.0)


def test_tokens_by_proposing_kind_follow_the_steps_and_keep_their_totals():
    """``record_rows`` then the step's ``mark``: each speculative step's tokens by the
    kind that proposed each row, placed on the call's timeline (plain steps add none);
    binned past the limit, the kinds' totals are kept; a merge keeps the first rank's."""
    st = SpecStats()
    st.record_rows(["self", "group_history", "group_history"], [3, 2, 4])
    st.mark(0.0, 1.0, "self")
    st.mark(1.0, 2.0, "plain")
    st.record_rows(["self"], [1])
    st.mark(2.0, 2.5, "self")
    assert st.token_steps == [[0.0, 1.0, {"self": 3, "group_history": 6}],
                              [2.0, 2.5, {"self": 1}]]
    assert st.summary()["kind_tokens"] == st.token_steps
    assert st.merged(SpecStats()).token_steps == st.token_steps
    st = SpecStats()
    for i in range(300):
        st.record_rows(["self", "group_history"][: 1 + i % 2], [2, 5][: 1 + i % 2])
        st.mark(i * 0.1, i * 0.1 + 0.1, "self")
    bins = st.tokens_summary(limit=8)
    assert len(bins) <= 8 and all(a < b for a, b, _ in bins)
    assert sum(t.get("self", 0) for *_, t in bins) == 600
    assert sum(t.get("group_history", 0) for *_, t in bins) == 150 * 5


def test_step_metrics_pool_tokens_by_kind():
    from megatron_tlt.rl.spec_metrics import merge_kinds
    from megatron_tlt.rl.step_metrics import replica_kinds

    part = {"kinds": {"self": {"rows": 4, "emitted": 10, "proposed_rows": 3,
                               "proposed_emitted": 6},
                      "group_history": {"proposed_rows": 1, "proposed_emitted": 4}}}
    m = merge_kinds([part, part], 10)
    assert m["self"]["proposed_emitted"] == 12 and m["group_history"]["proposed_emitted"] == 8
    assert m["self"]["proposed_share"] == pytest.approx(0.6)
    assert m["group_history"]["proposed_share"] == pytest.approx(0.4)
    spec = {"kind_tokens": [[0.5, 1.0, {"self": 3}]]}
    assert replica_kinds([(spec, 2.0), (None, 0.0)], "kind_tokens") == \
        [[[2.5, 3.0, {"self": 3}]], []]


def _history(kinds=("eagle", "self")):
    spec = {"accept_len": 3.2, "on_fraction": 0.3, "steps": 30, "kinds": list(kinds),
            "chosen": {"1": {"self": 20, "plain": 2}, "5-8": {"eagle": 10, "plain": 5}},
            "bucket_choice": {"5-8": "plain", "1": "self 4_1_4", "33+": "eagle 3_1_3"},
            "accept_len_by_bucket": {"1": 4.0, "5-8": 1.5}}
    spec.update({k: {"steps": 20 if k == "self" else 0, "on_fraction": 0.2 if k == "self"
                     else 0.0, "accept_len": 4.25 if k == "self" else 0.0} for k in kinds})
    rec = {"step": 1, "reward/mean": 0.5, "accuracy": 0.5, "response_length/mean": 10,
           "response_length/p99": 20, "response_length/max": 30, "spec": spec,
           "timing": {"rollout": 5.0, "tail": 1.0, "update": 2.0, "step": 8.0},
           "timeline": {"replica_finish": [4.0, 5.0], "update_end": 8.0,
                        "replica_kinds": [[[3.0, 3.5, "self"], [3.5, 4.0, "plain"]],
                                          [[2.0, 5.0, "eagle"]]],
                        "replica_kind_tokens": [[[3.0, 3.5, {"self": 6, "group_history": 2}]],
                                                []]}}
    return [rec, dict(rec, step=2)]


def test_summary_table_shows_the_kinds_and_each_buckets_drafter():
    from rich.console import Console

    from megatron_tlt.rl import report

    h = _history()
    spec = h[0]["spec"]
    assert report.kind_cell(spec, ["eagle", "self"]) == "eagle 0% -\nself 20% x4.25"
    # a free kind's rows: their tokens, share and acceptance (the step's kind was another)
    mixed = dict(spec, self=dict(spec["self"], rows=40, proposed_rows=30,
                                 proposed_emitted=120, proposed_share=0.75,
                                 proposed_accept_len=4.0))
    assert report.kind_cell(mixed, ["self"]) == "self 20% x4.25 | 120 tok 75% x4.00"
    # buckets smallest first, "33+" last
    assert report.bucket_cell(spec) == ("1: self 4_1_4 | self 91% plain 9%\n"
                                        "5-8: plain | eagle 67% plain 33%\n33+: eagle 3_1_3")
    console = Console(width=250, record=True)
    console.print(report.summary_table(h))
    text = console.export_text()
    assert "drafter by bucket" in text and "1: self 4_1_4 | self 91%" in text
    assert "self 20% x4.25" in text
    # one kind: the table keeps its usual columns
    console = Console(width=250, record=True)
    console.print(report.summary_table(_history(kinds=("eagle",))))
    assert "drafter by bucket" not in console.export_text()


def test_plots_draw_the_kinds(tmp_path, monkeypatch):
    import matplotlib.axes

    from megatron_tlt.rl import report

    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in _history()))
    labels, colors = [], []
    plot, barh = matplotlib.axes.Axes.plot, matplotlib.axes.Axes.barh

    def spy_plot(self, *a, **kw):
        labels.append(kw.get("label"))
        return plot(self, *a, **kw)

    def spy_barh(self, *a, **kw):
        colors.append(kw.get("color"))
        return barh(self, *a, **kw)

    monkeypatch.setattr(matplotlib.axes.Axes, "plot", spy_plot)
    monkeypatch.setattr(matplotlib.axes.Axes, "barh", spy_barh)
    paths = report.write_plots(path, tmp_path / "plots")
    assert [p.name for p in paths] == ["curves.png", "timeline.png"]
    assert "drafter self" in labels and "drafter eagle" in labels
    k = report.kind_color
    assert len({k("self"), k("plain"), k("eagle")}) == 3  # each kind its own color
    # two steps x (self, plain on replica 0; eagle on replica 1), and under them the
    # tokens by proposing kind (self and group_history on replica 0)
    assert (colors.count(k("self")), colors.count(k("plain")), colors.count(k("eagle")),
            colors.count(k("group_history"))) == (4, 2, 2, 2)


def test_drafter_canary_judges_the_one_layer_drafter_by_its_own_steps():
    """With both kinds, the self-drafter's acceptance does not hide a broken one-layer
    drafter, nor does a kind without steps raise a false alarm."""
    from megatron_tlt.rl.online_drafter import canary_warnings

    broken = {"steps": 100, "accept_len": 3.9, "kinds": ["eagle", "self"],
              "eagle": {"steps": 40, "accept_len": 1.01},
              "self": {"steps": 60, "accept_len": 5.9}}
    assert canary_warnings(0.5, 0.1, broken, "eagle") == [
        "measured acceptance 1.01 tokens per step"]
    fine = dict(broken, eagle={"steps": 3, "accept_len": 1.0})
    assert canary_warnings(0.5, 0.1, fine, "eagle") == []
    one_kind = {"steps": 50, "accept_len": 1.02}  # records without per-kind keys
    assert canary_warnings(0.05, 0.1, one_kind, "eagle") == [
        "canary alpha 0.050 < drafter_group.canary_min_alpha=0.1",
        "measured acceptance 1.02 tokens per step"]
    assert canary_warnings(None, 0.1, {}, "eagle") == []
