"""Acceptance by response position: the engine's per-step counts by where each row
stood in its response, the replicas' merge, and the plot that shows them."""

from __future__ import annotations

import json

import pytest
import torch

from megatron_tlt.config import RolloutConfig, SpeculativeConfig
from megatron_tlt.models import load_model
from megatron_tlt.models.drafter import DrafterConfig, EagleDrafter
from megatron_tlt.rl.spec_metrics import merge_spec
from megatron_tlt.rollout import RolloutEngine, SamplingParams
from megatron_tlt.rollout.speculative import position_accept as pa


def test_labels_and_bucket_edges():
    assert pa.labels() == ["0-127", "128-511", "512+"]
    assert [pa.label_of(p) for p in (0, 127, 128, 511, 512, 5000)] == \
        ["0-127", "0-127", "128-511", "128-511", "512+", "512+"]
    t: dict = {}
    pa.record(t, [0, 130, 600, 5], [3, 1, 2, 5])
    assert t == {"0-127": [2, 8], "128-511": [1, 1], "512+": [1, 2]}


def test_replicas_merge_by_pooled_counts_not_mean_of_means():
    a = {"rows": 10, "accept_len": 2.0, "steps": 4,
         "accept_by_position": {"128-511": [1, 4], "0-127": [9, 16]}}
    b = {"rows": 2, "accept_len": 1.0, "steps": 1, "accept_by_position": {"0-127": [2, 2]}}
    out = merge_spec([a, b], decode_steps=10)
    assert out["accept_len_by_position"] == {"0-127": 18 / 11, "128-511": 4.0}
    assert list(out["accept_len_by_position"]) == ["0-127", "128-511"]  # position order
    assert out["accept_len"] == pytest.approx(22 / 12)


def test_engine_buckets_steps_by_response_position(tiny_hf_dirs, single_process_parallel):
    """Rows decode 140 tokens after prompts of 9 and 17: the counts cover every
    speculative row-step once, and the 128-511 bucket holds what was emitted from
    response token ~128 on (cache positions would put far more there)."""
    from megatron_tlt.runtime_env import apply_cpu_redirection

    apply_cpu_redirection()
    model, arch = load_model(tiny_hf_dirs["llama_tied"], device=torch.device("cpu"),
                             dtype="float32")
    drafter = EagleDrafter(DrafterConfig.for_target(arch), arch, dtype=torch.float32,
                           device="cpu")
    drafter.reset_parameters(seed=1)
    sc = SpeculativeConfig(policy="fixed", strategy="4_1_4", threshold=1 << 20)
    eng = RolloutEngine(model, None, RolloutConfig(speculative=sc), arch=arch,
                        eos_token_ids=[], drafter=drafter)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, arch.vocab_size, (n,), generator=g).tolist() for n in (9, 17)]
    new = 140
    eng.generate(prompts, SamplingParams(temperature=0.0, max_new_tokens=new))
    st = eng.last_stats.spec
    summ = st.summary()
    counts = summ["accept_by_position"]
    assert set(counts) == {"0-127", "128-511"}
    assert sum(r for r, _ in counts.values()) == st.rows
    assert sum(e for _, e in counts.values()) == st.emitted
    # per row, the steps starting at response token >= 128 emit 140 - their first start,
    # and that start is within one step's reach (depth 4: <= 4 tokens) past 128
    tail = counts["128-511"][1]
    assert 2 * (new - 128 - 4) <= tail <= 2 * (new - 128)
    json.dumps(summ)  # JSON-able for the metrics file


def test_curves_plot_draws_the_position_buckets(tmp_path, monkeypatch):
    import matplotlib.axes

    from megatron_tlt.rl import report

    rec = {"step": 1, "reward/mean": 0.5, "accuracy": 0.5, "response_length/mean": 10,
           "response_length/p99": 20, "response_length/max": 30,
           "spec": {"accept_len_by_bucket": {"1-2": 1.5},
                    "accept_len_by_position": {"0-127": 1.6, "128-511": 1.2}}}
    path = tmp_path / "metrics.jsonl"
    path.write_text(json.dumps(rec) + "\n" + json.dumps(dict(rec, step=2)) + "\n")
    labels = []
    orig = matplotlib.axes.Axes.plot

    def plot(self, *a, **kw):
        labels.append(kw.get("label"))
        return orig(self, *a, **kw)

    monkeypatch.setattr(matplotlib.axes.Axes, "plot", plot)
    assert report.write_plots(path, tmp_path / "plots")
    assert "response tokens 0-127" in labels and "response tokens 128-511" in labels
