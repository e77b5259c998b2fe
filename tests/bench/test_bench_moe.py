"""tools/bench_moe.py's replay-mismatch measurement on a tiny bf16 Qwen3-MoE: the rows
it reports, no route flipped under replay, the tool's JSON; its speculation part: both
drafter kinds' rows and the MoE layer's times on a tiny Qwen3-MoE."""

from __future__ import annotations

import json


from cli import run_main


def test_replay_part_flips_no_route_with_replay(tmp_path, monkeypatch):
    from megatron_tlt.bench import replay_mismatch as rm

    tiny = dict(hidden_size=64, intermediate_size=96, moe_intermediate_size=48,
                num_hidden_layers=2, head_dim=16, vocab_size=512, num_experts=8)
    monkeypatch.setattr(rm, "MOE", dict(rm.MOE, **tiny))
    monkeypatch.setattr(rm, "DENSE", dict(rm.DENSE, **tiny))
    out = tmp_path / "r.json"
    r = run_main("tools/bench_moe.py", "--part", "replay", "--prompts", "6", "--new-tokens",
                 "10", "--micro-batch", "4", "--models", tmp_path / "m", "--json", out)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = {(row["model"], row["replay"]): row for row in json.loads(out.read_text())["rows"]}
    assert set(rows) == {("qwen3_moe", False), ("qwen3_moe", True), ("qwen3", None)}
    replayed, free = rows[("qwen3_moe", True)], rows[("qwen3_moe", False)]
    assert replayed["flipped_route_share"] == 0.0 == replayed["tokens_with_a_flip_share"]
    assert 0.0 <= free["flipped_route_share"] <= free["tokens_with_a_flip_share"] <= 1.0
    assert rows[("qwen3", None)]["flipped_route_share"] is None
    for row in rows.values():
        assert row["tokens"] == 60 and 0 <= row["mean_abs_dlogp"] <= row["max_abs_dlogp"]


def test_spec_part_reports_both_drafter_kinds_on_an_moe_target(tmp_path, monkeypatch):
    from megatron_tlt.bench import spec_moe

    tiny = dict(hidden_size=64, intermediate_size=96, moe_intermediate_size=48,
                num_hidden_layers=2, head_dim=16, vocab_size=512, num_experts=8,
                mlp_only_layers=[1])
    monkeypatch.setattr(spec_moe, "SPEC_MOE", dict(spec_moe.SPEC_MOE, **tiny))
    out = tmp_path / "s.json"
    r = run_main("tools/bench_moe.py", "--part", "spec", "--new-tokens", "8", "--reps", "1",
                 "--threads", "1", "--models", tmp_path / "m", "--json", out)
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(out.read_text())
    rows = {(row["kind"], row["batch"]): row for row in res["rows"]}
    assert set(rows) == {(k, b) for k in ("self", "one-layer") for b in spec_moe.BATCHES}
    for row in rows.values():
        assert row["steps"] > 0 and 0.0 <= row["alpha"] <= 1.0
        assert 1.0 <= row["tokens_per_step"] <= res["depth"] + 1
        assert row["draft_ms_per_token"] > 0 and row["target_plain_step_ms"] > 0
    assert [x["rows"] for x in res["moe_layer"]] == list(spec_moe.BATCHES)
    assert all(x["target_ms"] > 0 and x["copy_ms"] > 0 for x in res["moe_layer"])
