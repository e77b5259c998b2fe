"""tools/bench_moe.py's replay-mismatch measurement on a tiny bf16 Qwen3-MoE: the rows
it reports, no route flipped under replay, the tool's JSON."""

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
