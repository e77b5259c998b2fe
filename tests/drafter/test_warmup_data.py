"""The resumable response store behind tools/warmup_drafter.py --responses."""

import json

import pytest

import torch

from megatron_tlt.drafter_training.responses import (ResponseStore, ResponseStoreMismatch,
                                                     weights_signature)

META = {"model": "smollm2", "task": "basic_arithmetic", "seed": 0, "max_new_tokens": 8,
        "temperature": 0.0, "samples_per_prompt": 1}


def test_responses_survive_a_restart(tmp_path):
    path = tmp_path / "r.jsonl"
    s = ResponseStore(path, META)
    assert len(s) == 0 and s.get(0, [1, 2]) is None
    s.add(0, [1, 2], [5, 6, 7])
    s.add(3, [9], [])
    again = ResponseStore(path, dict(reversed(list(META.items()))))  # key order is irrelevant
    assert len(again) == 2
    assert again.get(0, [1, 2]) == [5, 6, 7]
    assert again.get(3, [9]) == []
    assert again.get(1, [4]) is None
    again.add(1, [4], [8])
    assert ResponseStore(path, META).get(1, [4]) == [8]


def test_other_settings_are_refused_with_the_difference_named(tmp_path):
    path = tmp_path / "r.jsonl"
    ResponseStore(path, META).add(0, [1], [2])
    with pytest.raises(ResponseStoreMismatch, match=r"max_new_tokens: file 8 vs now 16"):
        ResponseStore(path, {**META, "max_new_tokens": 16})
    with pytest.raises(ResponseStoreMismatch, match="another prompt"):
        ResponseStore(path, META).get(0, [1, 1])
    other = tmp_path / "x.jsonl"
    other.write_text(json.dumps({"hello": 1}) + "\n")
    with pytest.raises(ResponseStoreMismatch, match="not a response store"):
        ResponseStore(other, META)


def test_a_write_cut_short_is_dropped_and_the_file_stays_appendable(tmp_path):
    path = tmp_path / "r.jsonl"
    s = ResponseStore(path, META)
    s.add(0, [1], [2, 3])
    s.add(1, [4], [5])
    with open(path, "a") as f:
        f.write('{"i": 2, "prompt": [7], "tok')  # killed mid-write
    t = ResponseStore(path, META)
    assert len(t) == 2 and t.get(2, [7]) is None
    t.add(2, [7], [8])
    u = ResponseStore(path, META)
    assert len(u) == 3 and u.get(2, [7]) == [8] and u.get(1, [4]) == [5]


def test_corruption_before_the_end_is_an_error(tmp_path):
    path = tmp_path / "r.jsonl"
    s = ResponseStore(path, META)
    s.add(0, [1], [2])
    lines = path.read_text().split("\n")
    lines.insert(1, "garbage")
    path.write_text("\n".join(lines))
    with pytest.raises(ResponseStoreMismatch, match="line 2 is corrupt"):
        ResponseStore(path, META)


def test_weights_signature_follows_every_parameter():
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    sig = weights_signature(m)
    assert sig == weights_signature(m) and len(sig) == 16
    twin = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    twin.load_state_dict(m.state_dict())
    assert weights_signature(twin) == sig
    with torch.no_grad():
        m[1].bias[1] += 1e-3
    changed = weights_signature(m)
    assert changed != sig
    assert weights_signature(m.to(torch.bfloat16)) != changed  # (converts m in place)


def test_recipe_prompts_follow_the_recipe_and_another_seed_gives_unseen_ones(smollm2_dir):
    """bench_spec --config measures a drafter on the recipe's task, on prompts its
    warm-up (seed data.seed) never trained on."""
    from transformers import AutoTokenizer

    from megatron_tlt.drafter_training.warmup import WarmupConfig, recipe_prompts

    cfg = WarmupConfig.from_recipe("examples/rl/smollm2_cpu.yaml")
    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    warm = recipe_prompts(cfg, tok, 16)
    assert warm == recipe_prompts(cfg, tok, 16, seed=cfg.seed)  # deterministic
    text = tok.decode(warm[0])
    assert cfg.instruction and cfg.instruction in text  # the recipe's prompt format
    other = recipe_prompts(cfg, tok, 16, seed=cfg.seed + 7919)
    assert not set(map(tuple, other)) & set(map(tuple, warm))
