"""Speculative-decoding strategy tuner (BEG-MAB): parsing, policies, state round trips."""

from __future__ import annotations

import json
import math
import random

import pytest

from megatron_tlt.rollout.tuner import Strategy, StrategyTuner, parse_arms, parse_buckets

S = Strategy.parse
CHAIN6, TREE16, TREE24, CHAIN4 = S("6_1_6"), S("5_4_16"), S("7_4_24"), S("4_1_4")


def one_bucket(arms, **kw) -> StrategyTuner:
    return StrategyTuner([1], {0: list(arms)}, **kw)


def pull(tuner: StrategyTuner, reward_of, steps: int, batch_size: int = 1) -> list[Strategy]:
    """Run ``steps`` choose/update rounds; ``reward_of(arm)`` gives tokens per 1 s step."""
    chosen = []
    for _ in range(steps):
        arm = tuner.choose(batch_size)
        tuner.update(batch_size, arm, reward_of(arm), 1.0)
        chosen.append(arm)
    return chosen


# ------------------------------------------------------------------ Strategy
def test_strategy_name_parse_round_trip_and_properties():
    for text in ("6_1_6", "5_4_16", "7_4_24", "1_1_1", "2_3_12"):
        s = Strategy.parse(text)
        assert s.name == text and Strategy.parse(s.name) == s
    assert CHAIN6.is_chain and not TREE16.is_chain
    assert (TREE16.depth, TREE16.top_k, TREE16.verify_tokens) == (5, 4, 16)
    assert Strategy.parse(" 6_1_6 ") == CHAIN6
    assert sorted([TREE16, CHAIN4, CHAIN6]) == [CHAIN4, TREE16, CHAIN6]
    assert len({CHAIN6, S("6_1_6")}) == 1


@pytest.mark.parametrize("args, match", [
    ((0, 1, 0), "depth must be >= 1, got 0"),
    ((3, 0, 3), "top_k must be >= 1, got 0"),
    ((6, 1, 5), "verify exactly depth=6 tokens, got verify_tokens=5"),
    ((2, 3, 1), r"2 <= verify_tokens <= 12, got 1"),
    ((2, 3, 13), r"2 <= verify_tokens <= 12, got 13"),
    ((2.0, 1, 2), "depth must be an int, got 2.0"),
    ((True, 1, 1), "depth must be an int"),
])
def test_strategy_validation(args, match):
    with pytest.raises(ValueError, match=match):
        Strategy(*args)


def test_strategy_tree_bounds_accepted():
    assert Strategy(2, 3, 2).verify_tokens == 2
    assert Strategy(2, 3, 12).verify_tokens == 12  # 3 + 9


@pytest.mark.parametrize("text", ["", "6_1", "6_1_6_1", "a_1_1", "6-1-6", "6_1_-6", "6__6"])
def test_strategy_parse_rejects_bad_text(text):
    with pytest.raises(ValueError, match="invalid strategy"):
        Strategy.parse(text)


def test_strategy_parse_validates_values():
    with pytest.raises(ValueError, match="verify_tokens=7"):
        Strategy.parse("6_1_7")


# ------------------------------------------------------------------ parsing
def test_parse_buckets():
    assert parse_buckets("1,2,4,8,16,32") == [1, 2, 4, 8, 16, 32]
    assert parse_buckets(" 1, 3 ,9") == [1, 3, 9]
    assert parse_buckets([2, 4]) == [2, 4]
    assert parse_buckets((5,)) == [5]


@pytest.mark.parametrize("spec, match", [
    ("", "invalid buckets"),
    ("1,,4", "invalid buckets"),
    ("1,x", "invalid bucket bound 'x'"),
    ("0,2", "must be >= 1, got 0"),
    ("1,4,4", "strictly increasing, got 4 after 4"),
    ([4, 2], "strictly increasing, got 2 after 4"),
    ([], "must not be empty"),
    ([1, 2.5], "must be an int, got 2.5"),
])
def test_parse_buckets_errors(spec, match):
    with pytest.raises(ValueError, match=match):
        parse_buckets(spec)


def test_parse_arms_keys_ranges_and_default():
    buckets = [1, 2, 4, 8, 16, 32]
    arms = parse_arms("1:6_1_6,5_4_16,7_4_24;2-4:6_1_6,4_4_12;*:4_1_4", buckets)
    assert sorted(arms) == list(range(6))
    assert arms[0] == [CHAIN6, TREE16, TREE24]
    assert arms[1] == arms[2] == [CHAIN6, S("4_4_12")]
    assert all(arms[i] == [CHAIN4] for i in (3, 4, 5))
    # the range matches bounds inside it even if its ends are not bounds; trailing ';' ok
    arms = parse_arms("3-20:6_1_6;*:4_1_4;", "1,2,4,8,16,32")
    assert [arms[i] for i in range(6)] == [[CHAIN4]] * 2 + [[CHAIN6]] * 3 + [[CHAIN4]]
    # lists are independent copies
    arms[2].append(CHAIN4)
    assert arms[3] == [CHAIN6]


@pytest.mark.parametrize("spec, match", [
    ("1:6_1_6", r"no arms for bucket\(s\) 2, 3-4, 5\+"),
    ("3:6_1_6;*:4_1_4", "'3' is not a bucket bound"),
    ("5-7:6_1_6;*:4_1_4", "matches no bucket bound"),
    ("4-2:6_1_6;*:4_1_4", r"4 > 2"),
    ("1:6_1_6;1-2:4_1_4;*:4_1_4", "bucket 1 \\(1\\) is given arms twice"),
    ("*:6_1_6;*:4_1_4", "default '\\*' given twice"),
    ("1 6_1_6", "expected 'bucket:strategy"),
    ("x:6_1_6", "invalid bucket key 'x'"),
    ("1:", "empty strategy"),
    ("1:6_1_6,,4_1_4;*:4_1_4", "empty strategy"),
    ("1:6_1_6,6_1_6;*:4_1_4", "6_1_6 listed twice"),
    ("*:6_1_7", "verify_tokens=7"),
    ("  ", "non-empty"),
])
def test_parse_arms_errors(spec, match):
    with pytest.raises(ValueError, match=match):
        parse_arms(spec, [1, 2, 4, 8])


# ------------------------------------------------------------------ buckets
def test_bucket_of_boundaries_and_labels():
    t = StrategyTuner("1,2,4,8", parse_arms("*:6_1_6", "1,2,4,8"))
    expected = {1: 0, 2: 1, 3: 2, 4: 2, 5: 3, 8: 3, 9: 3, 1000: 3}
    assert {b: t.bucket_of(b) for b in expected} == expected
    assert [t.bucket_label(i) for i in range(4)] == ["1", "2", "3-4", "5+"]
    t2 = StrategyTuner([2, 4], {0: [CHAIN6], 1: [CHAIN6]})
    assert [t2.bucket_label(i) for i in range(2)] == ["1-2", "3+"]
    assert one_bucket([CHAIN6]).bucket_label(0) == "1+"
    for bad in (0, -3, 1.5):
        with pytest.raises(ValueError, match="batch_size must be an int >= 1"):
            t.bucket_of(bad)
    with pytest.raises(ValueError, match="bucket index must be in \\[0, 3\\], got 4"):
        t.bucket_label(4)


def test_constructor_validation():
    arms = {0: [CHAIN6]}
    with pytest.raises(ValueError, match="policy must be one of .* got 'greedy'"):
        StrategyTuner([1], arms, policy="greedy")
    with pytest.raises(ValueError, match="epsilon must be in \\[0, 1\\], got 1.5"):
        StrategyTuner([1], arms, epsilon=1.5)
    with pytest.raises(ValueError, match="window must be an int >= 1, got 0"):
        StrategyTuner([1], arms, window=0)
    with pytest.raises(ValueError, match="ucb_c must be .* got -1"):
        StrategyTuner([1], arms, ucb_c=-1)
    with pytest.raises(ValueError, match="every bucket index 0..1"):
        StrategyTuner([1, 2], arms)
    with pytest.raises(ValueError, match="bucket 1\\+ has no arms"):
        StrategyTuner([1], {0: []})
    with pytest.raises(ValueError, match="6_1_6 listed twice"):
        StrategyTuner([1], {0: [CHAIN6, S("6_1_6")]})
    with pytest.raises(ValueError, match="is not a Strategy"):
        StrategyTuner([1], {0: ["6_1_6"]})


def test_update_validation_and_ignored_steps():
    t = one_bucket([CHAIN6, TREE16])
    t.update(1, CHAIN6, 10, 0.0)
    t.update(1, CHAIN6, 10, -1.0)
    t.update(1, CHAIN6, 10, math.nan)
    assert t.stats()["buckets"]["1+"]["6_1_6"] == {"pulls": 0, "median_reward": None}
    with pytest.raises(ValueError, match="accepted_tokens must be a number >= 0, got -1"):
        t.update(1, CHAIN6, -1, 1.0)
    with pytest.raises(ValueError, match="strategy must be a Strategy, got '6_1_6'"):
        t.update(1, "6_1_6", 1, 1.0)


# ------------------------------------------------------------------ egreedy
def test_egreedy_tries_every_arm_first_in_order():
    arms = [TREE24, CHAIN6, TREE16, CHAIN4]
    t = StrategyTuner([1, 4], {0: arms, 1: [CHAIN4]}, epsilon=1.0)
    # even with epsilon=1 the untried arms come first, in listed order
    assert pull(t, lambda a: 1.0, 4) == arms
    # the other bucket is independent
    assert t.choose(3) == CHAIN4
    assert t.best(3) == CHAIN4


def test_egreedy_median_beats_outlier_inflated_mean():
    sim = random.Random(1)
    spiky = CHAIN6   # median ~100, but 8% huge outliers -> mean ~900
    steady = TREE16  # median ~150, mean ~150

    def reward(arm):
        if arm == spiky:
            return 10_000.0 if sim.random() < 0.08 else sim.gauss(100, 10)
        return sim.gauss(150, 10)

    t = one_bucket([spiky, steady], epsilon=0.1, window=50, seed=3)
    chosen = pull(t, reward, 600)
    assert t.best(1) == steady
    tail = chosen[-300:]
    assert tail.count(steady) / len(tail) > 0.85  # expected ~0.95
    spiky_rewards = list(t._windows[0][spiky.name])
    assert sum(spiky_rewards) / len(spiky_rewards) > 150  # the mean would pick the wrong arm
    st = t.stats()["buckets"]["1+"]
    assert st[steady.name]["median_reward"] > st[spiky.name]["median_reward"]


@pytest.mark.parametrize("epsilon", [0.0, 0.2])
def test_egreedy_exploration_frequency(epsilon):
    arms = [CHAIN4, CHAIN6, TREE16, TREE24]
    value = {a: float(i + 1) for i, a in enumerate(arms)}  # TREE24 is best
    t = one_bucket(arms, epsilon=epsilon, seed=11)
    pull(t, value.get, len(arms))
    n = 2000
    chosen = pull(t, value.get, n)
    off_best = sum(a != TREE24 for a in chosen)
    # exploration picks uniformly among all arms, so it misses the best arm 3/4 of the time
    p = epsilon * (len(arms) - 1) / len(arms)
    sd = math.sqrt(n * p * (1 - p))
    assert abs(off_best - n * p) <= 4 * sd
    if epsilon:
        assert all(chosen.count(a) > 0 for a in arms[:3])


def test_egreedy_window_tracks_a_drop():
    window = 21
    good, other = CHAIN6, TREE16
    level = {good: 100.0, other: 80.0}
    t = one_bucket([good, other], epsilon=0.1, window=window, seed=5)
    pull(t, level.get, 200)
    assert t.best(1) == good
    level[good] = 50.0
    good_pulls = steps = 0
    few_low_checked = False
    while t.best(1) == good:
        arm = t.choose(1)
        t.update(1, arm, level[arm], 1.0)
        good_pulls += arm == good
        steps += 1
        if good_pulls == 5 and not few_low_checked:
            few_low_checked = True
            assert t.best(1) == good  # a few bad steps do not move the median
        assert steps <= 2 * window, "did not switch after the reward drop"
    # the median flips as soon as more than half the (odd) window holds the new level
    assert good_pulls == window // 2 + 1
    assert pull(t, level.get, 50).count(other) > 40


# ------------------------------------------------------------------ ucb1
def test_ucb1_tries_untried_first_and_converges():
    arms = [CHAIN4, CHAIN6, TREE16]
    means = {CHAIN4: 30.0, CHAIN6: 100.0, TREE16: 60.0}
    sim = random.Random(2)
    t = one_bucket(arms, policy="ucb1", ucb_c=0.5)
    chosen = pull(t, lambda a: sim.gauss(means[a], 5), 800)
    assert chosen[:3] == arms
    assert t.best(1) == CHAIN6
    tail = chosen[-400:]
    assert tail.count(CHAIN6) / len(tail) > 0.8
    pulls = {n: s["pulls"] for n, s in t.stats()["buckets"]["1+"].items()}
    assert sum(pulls.values()) == 800
    assert pulls[CHAIN4.name] < pulls[TREE16.name] < pulls[CHAIN6.name]


def test_ucb1_counts_pulls_beyond_window():
    t = one_bucket([CHAIN4, CHAIN6], policy="ucb1", window=5)
    pull(t, lambda a: 10.0, 40)
    assert sum(s["pulls"] for s in t.stats()["buckets"]["1+"].values()) == 40
    assert all(len(w) <= 5 for w in t._windows[0].values())


# ------------------------------------------------------------------ fixed
def test_fixed_policy():
    with pytest.raises(ValueError, match="policy 'fixed' needs a fixed strategy"):
        one_bucket([CHAIN6], policy="fixed")
    with pytest.raises(ValueError, match="fixed must be a Strategy"):
        one_bucket([CHAIN6], policy="fixed", fixed="6_1_6")
    t = StrategyTuner([1, 8], {0: [CHAIN6, TREE16], 1: [CHAIN4]}, policy="fixed", fixed=TREE24)
    assert {t.choose(b) for b in (1, 2, 7, 50) for _ in range(5)} == {TREE24}
    assert t.best(1) == TREE24
    t.update(1, TREE24, 30, 0.5)
    t.update(3, TREE24, 10, 1.0)
    st = t.stats()
    assert st["policy"] == "fixed"
    assert st["buckets"]["1"]["7_4_24"] == {"pulls": 1, "median_reward": 60.0}
    assert st["buckets"]["1"]["6_1_6"]["pulls"] == 0
    assert st["buckets"]["2+"]["7_4_24"] == {"pulls": 1, "median_reward": 10.0}


# ------------------------------------------------------------------ stats / state
def test_stats_json_and_pull_counts():
    buckets = [1, 2, 4]
    t = StrategyTuner(buckets, parse_arms("1:6_1_6,5_4_16;*:4_1_4", buckets))
    for _ in range(3):
        t.update(1, CHAIN6, 12, 2.0)
    t.update(1, TREE16, 9, 1.0)
    t.update(3, CHAIN4, 8, 1.0)
    t.update(100, CHAIN4, 4, 1.0)
    t.update(100, CHAIN6, 5, 1.0)  # not an arm of that bucket: still recorded
    st = json.loads(json.dumps(t.stats()))
    assert st == {
        "policy": "egreedy",
        "buckets": {
            "1": {"6_1_6": {"pulls": 3, "median_reward": 6.0},
                  "5_4_16": {"pulls": 1, "median_reward": 9.0}},
            "2": {"4_1_4": {"pulls": 0, "median_reward": None}},
            "3+": {"4_1_4": {"pulls": 2, "median_reward": 6.0},
                   "6_1_6": {"pulls": 1, "median_reward": 5.0}},
        },
    }


def _noisy_run(tuner: StrategyTuner, sim: random.Random, steps: int) -> list[str]:
    out = []
    for _ in range(steps):
        bs = sim.choice([1, 2, 3, 6, 40])
        arm = tuner.choose(bs)
        tuner.update(bs, arm, sim.randint(0, 60), sim.uniform(0.05, 0.2))
        out.append(arm.name)
    return out


@pytest.mark.parametrize("policy", ["egreedy", "ucb1"])
def test_save_load_reproduces_future_choices(tmp_path, policy):
    buckets = [1, 2, 4, 8]
    arms = parse_arms("1:6_1_6,5_4_16,7_4_24;2-4:6_1_6,4_4_12;*:4_1_4,6_1_6", buckets)
    t = StrategyTuner(buckets, arms, policy=policy, epsilon=0.3, window=7, seed=42)
    _noisy_run(t, random.Random(0), 150)
    path = tmp_path / "tuner.json"
    t.save(path)
    assert [p.name for p in tmp_path.iterdir()] == ["tuner.json"]  # no temp file left
    loaded = StrategyTuner.load(path)
    assert loaded.state_dict() == t.state_dict()
    assert json.loads(path.read_text()) == json.loads(json.dumps(t.state_dict()))
    a = _noisy_run(t, random.Random(1), 300)
    b = _noisy_run(loaded, random.Random(1), 300)
    assert a == b
    assert len(set(a)) > 2  # the run really explored
    assert loaded.stats() == t.stats()


def test_load_state_dict_into_fresh_tuner_and_rng_is_private():
    arms = {0: [CHAIN4, CHAIN6, TREE16]}
    t = one_bucket(arms[0], epsilon=0.5, seed=9)
    pull(t, lambda a: a.depth, 20)
    state = json.loads(json.dumps(t.state_dict()))
    other = one_bucket(arms[0], epsilon=0.5, seed=123)
    other.load_state_dict(state)
    random.seed(0)  # the global RNG must not matter
    first = [t.choose(1) for _ in range(50)]
    random.seed(99)
    second = [other.choose(1) for _ in range(50)]
    assert first == second


def test_load_state_dict_rejects_mismatch():
    t = StrategyTuner([1, 4], {0: [CHAIN6, TREE16], 1: [CHAIN4]})
    state = t.state_dict()
    with pytest.raises(ValueError, match=r"buckets \[1, 4\], this tuner has \[1, 8\]"):
        StrategyTuner([1, 8], {0: [CHAIN6, TREE16], 1: [CHAIN4]}).load_state_dict(state)
    with pytest.raises(ValueError, match="tuner state has arms .* this tuner has"):
        StrategyTuner([1, 4], {0: [TREE16, CHAIN6], 1: [CHAIN4]}).load_state_dict(state)
    with pytest.raises(ValueError, match="unsupported tuner state version 99"):
        t.load_state_dict({**state, "version": 99})
    with pytest.raises(ValueError, match="missing key 'rng'"):
        t.load_state_dict({k: v for k, v in state.items() if k != "rng"})
    with pytest.raises(ValueError, match="invalid RNG state"):
        t.load_state_dict({**state, "rng": [3, [1, 2], None]})


def test_load_keeps_own_policy_and_trims_window():
    t = one_bucket([CHAIN4, CHAIN6], window=10)
    for r in range(10):
        t.update(1, CHAIN6, r, 1.0)
    narrow = one_bucket([CHAIN4, CHAIN6], window=3, policy="ucb1")
    narrow.load_state_dict(t.state_dict())
    assert narrow.policy == "ucb1"
    assert list(narrow._windows[0][CHAIN6.name]) == [7.0, 8.0, 9.0]
    assert narrow.stats()["buckets"]["1+"]["6_1_6"]["pulls"] == 10
