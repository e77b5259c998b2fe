"""Speculative-decoding strategy tuner (BEG-MAB): parsing, policies, the break-even
gate, the decide/record protocol, state round trips."""

from __future__ import annotations

import json
import math
import random
import weakref

import pytest

from megatron_tlt.rollout.speculative.decision import Decision, Outcome
from megatron_tlt.rollout.speculative.tuner import StrategyTuner
from megatron_tlt.spec_strategy import Strategy, parse_arms, parse_buckets

S = Strategy.parse
CHAIN6, TREE16, TREE24, CHAIN4 = S("6_1_6"), S("5_4_16"), S("7_4_24"), S("4_1_4")


def one_bucket(arms, **kw) -> StrategyTuner:
    return StrategyTuner([1], {0: list(arms)}, **kw)


_DECIDED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def choose(t: StrategyTuner, batch_size: int, pending: int = 0) -> Strategy:
    """``t.decide``; the decision goes with the next ``update`` of ``t`` (as the engine
    hands each step's decision to ``record``)."""
    d = t.decide(batch_size, pending)
    _DECIDED[t] = d
    return d.strategy


def last(t: StrategyTuner) -> Decision:
    return _DECIDED[t]


def update(t: StrategyTuner, batch_size: int, arm: Strategy, tokens, seconds, **kw) -> None:
    """``t.record`` of a step of ``arm``: under the decision ``choose`` made when it
    decided ``arm`` (a probe stays a probe), else as a step the tuner did not decide."""
    d = _DECIDED.pop(t, None)
    if d is None or d.strategy != arm or d.bucket != t.bucket_of(batch_size):
        d = Decision(t.bucket_of(batch_size), arm, arm.is_off)
    t.record(d, Outcome(batch_size, tokens, seconds, **kw))


def pull(tuner: StrategyTuner, reward_of, steps: int, batch_size: int = 1) -> list[Strategy]:
    """Run ``steps`` choose/update rounds; ``reward_of(arm)`` gives tokens per 1 s step."""
    chosen = []
    for _ in range(steps):
        arm = choose(tuner, batch_size)
        update(tuner, batch_size, arm, reward_of(arm), 1.0)
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
    update(t, 1, CHAIN6, 10, 0.0)
    update(t, 1, CHAIN6, 10, -1.0)
    update(t, 1, CHAIN6, 10, math.nan)
    assert t.stats()["buckets"]["1+"]["6_1_6"] == {"pulls": 0, "median_reward": None}
    with pytest.raises(ValueError, match="Outcome.tokens must be a number >= 0, got -1"):
        update(t, 1, CHAIN6, -1, 1.0)


# ------------------------------------------------------------------ egreedy
def test_egreedy_tries_every_arm_first_in_order():
    arms = [TREE24, CHAIN6, TREE16, CHAIN4]
    t = StrategyTuner([1, 4], {0: arms, 1: [CHAIN4]}, epsilon=1.0)
    # even with epsilon=1 the untried arms come first, in listed order
    assert pull(t, lambda a: 1.0, 4) == arms
    # the other bucket is independent
    assert choose(t, 3) == CHAIN4
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
    spiky_rewards = list(t.bandit.windows[0][spiky.name])
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
        arm = choose(t, 1)
        update(t, 1, arm, level[arm], 1.0)
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
    assert all(len(w) <= 5 for w in t.bandit.windows[0].values())


# ------------------------------------------------------------------ fixed
def test_fixed_policy():
    with pytest.raises(ValueError, match="policy 'fixed' needs a fixed strategy"):
        one_bucket([CHAIN6], policy="fixed")
    with pytest.raises(ValueError, match="needs a fixed strategy .* got '6_1_6'"):
        one_bucket([CHAIN6], policy="fixed", fixed="6_1_6")
    t = StrategyTuner([1, 8], {0: [CHAIN6, TREE16], 1: [CHAIN4]}, policy="fixed", fixed=TREE24)
    assert {choose(t, b) for b in (1, 2, 7, 50) for _ in range(5)} == {TREE24}
    assert t.best(1) == TREE24
    update(t, 1, TREE24, 30, 0.5)
    update(t, 3, TREE24, 10, 1.0)
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
        update(t, 1, CHAIN6, 12, 2.0)
    update(t, 1, TREE16, 9, 1.0)
    update(t, 3, CHAIN4, 8, 1.0)
    update(t, 100, CHAIN4, 4, 1.0)
    update(t, 100, CHAIN6, 5, 1.0)  # not an arm of that bucket: still recorded
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
        arm = choose(tuner, bs)
        update(tuner, bs, arm, sim.randint(0, 60), sim.uniform(0.05, 0.2))
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
    first = [choose(t, 1) for _ in range(50)]
    random.seed(99)
    second = [choose(other, 1) for _ in range(50)]
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
        update(t, 1, CHAIN6, r, 1.0)
    narrow = one_bucket([CHAIN4, CHAIN6], window=3, policy="ucb1")
    narrow.load_state_dict(t.state_dict())
    assert narrow.policy == "ucb1"
    assert list(narrow.bandit.windows[0][CHAIN6.name]) == [7.0, 8.0, 9.0]
    assert narrow.stats()["buckets"]["1+"]["6_1_6"]["pulls"] == 10


# ------------------------------------------------------------------ break-even gate
OFF = Strategy.parse("0_0_0")


def simulate(tuner: StrategyTuner, steps: int, spec_of, batch_size: int = 1,
             plain_seconds: float = 1.0):
    """Drive choose/update with controlled step times: a plain step emits one token per
    sequence in ``plain_seconds``; ``spec_of(arm, batch_size)`` gives a speculative
    step's per-sequence accepted draft counts and its seconds. Returns the chosen arms
    and the realised tokens per second per sequence relative to plain decoding's."""
    chosen, tokens, seconds = [], 0.0, 0.0
    for _ in range(steps):
        arm = choose(tuner, batch_size)
        if arm.is_off:
            acc, sec, tpr = None, plain_seconds, 1.0
        else:
            acc, sec = spec_of(arm, batch_size)
            tpr = sum(a + 1 for a in acc) / batch_size
        update(tuner, batch_size, arm, tpr * batch_size, sec, accepted_drafts=acc)
        chosen.append(arm)
        tokens += tpr
        seconds += sec
    return chosen, (tokens / seconds) * plain_seconds


def accepted_counts(rng: random.Random, depth: int, p_accept: float,
                    batch_size: int) -> list[int]:
    """Per sequence, how many of ``depth`` draft tokens are accepted when each is with
    ``p_accept`` (given the ones before it)."""
    acc = []
    for _ in range(batch_size):
        a = 0
        while a < depth and rng.random() < p_accept:
            a += 1
        acc.append(a)
    return acc


def drafter(p_accept: float, seed: int = 0, step_cost=lambda arm: 1.0 + 0.1 * arm.depth):
    """A simulated drafter whose every draft token is accepted with ``p_accept`` (given
    the ones before it), on hardware where a depth-d chain step costs ``step_cost``
    plain steps."""
    rng = random.Random(seed)

    def spec_of(arm, batch_size):
        return accepted_counts(rng, arm.depth, p_accept, batch_size), step_cost(arm)
    return spec_of


def gated(arms=(CHAIN4, CHAIN6), **kw) -> StrategyTuner:
    return StrategyTuner([1, 2, 4, 8], {i: list(arms) for i in range(4)},
                         **{"break_even": True, **kw})


def test_gate_is_off_by_default_and_under_fixed():
    assert not one_bucket([CHAIN6]).break_even
    t = StrategyTuner([1], {0: [CHAIN6]}, policy="fixed", fixed=CHAIN4, break_even=True)
    chosen, _ = simulate(t, 20, drafter(0.1))
    assert set(chosen) == {CHAIN4}  # benchmarks of fixed strategies are not gated
    assert "gate" not in t.stats()


def test_gate_converges_to_plain_with_a_random_drafter():
    """A drafter that loses (a random one: 1.1 tokens for 1.4-1.6 plain steps): plain
    decoding first (three steps: the reference), then a probe, then plain steps with
    re-probes at a bounded cost; the realised rate stays within the probe budget of
    plain's."""
    t = gated(probe_budget=0.02)
    chosen, rel = simulate(t, 2000, drafter(0.1))
    assert chosen[:3] == [OFF] * 3 and chosen[3] == CHAIN4  # measure plain, then probe
    late = chosen[1000:]
    spec = sum(not a.is_off for a in late)
    # re-tried at a bounded rate: each probe loses ~0.3-0.5 of a plain step; the budget
    # (2 %) allows one every ~20 steps, and backs off to an eighth of it once probes
    # keep confirming the loss
    assert 0.003 * len(late) < spec < 0.03 * len(late)
    assert 0.99 < rel < 1.0, rel
    assert t.best(1) == OFF
    g = t.stats()["gate"]["1"]
    assert g["speculating"] is False and g["arm_speedup"] < 1.0
    assert g["declined"] == sum(a.is_off for a in chosen) and g["probes"] >= spec
    assert g["plain_tok_s"] == 1.0 and 0.0 < g["probe_loss"] < 0.01
    # the deeper chain costs at least what the shallower one does and cannot accept
    # more than the acceptance profile allows: bounded below break-even, never probed
    assert set(g["arms"]) == {CHAIN4.name} and CHAIN6 not in chosen
    assert t.acceptance_profile()[0] == pytest.approx(0.1, abs=0.1)


def test_gate_converges_to_speculation_with_a_good_drafter():
    t = gated()
    chosen, rel = simulate(t, 1000, drafter(0.85))
    assert chosen[:3] == [OFF] * 3
    # far above break-even: plain decoding is only re-measured every 128 steps
    assert [i for i, a in enumerate(chosen) if a.is_off][3:] == [131, 260, 389, 518, 647,
                                                                 776, 905]
    assert rel > 2.4  # CHAIN4: 3.7 tokens per 1.4 steps = 2.64x, CHAIN6: 4.5 / 1.6 = 2.8x
    assert t.best(1) in (CHAIN4, CHAIN6)
    g = t.stats()["gate"]["1"]
    assert g["speculating"] and g["arm_speedup"] > 2.0
    assert g["arm_tok_s"] == pytest.approx(g["arm_speedup"] * g["plain_tok_s"])
    # the acceptance profile (decayed over ~16 sequence-steps: noisy, but it follows)
    assert t.expected_tokens(CHAIN4) == pytest.approx(1 + .85 + .85**2 + .85**3 + .85**4,
                                                      abs=1.0)
    assert t.expected_tokens(TREE16) is None  # trees use their own measured mean


def stretchy_drafter(seed: int = 0, period: int = 40, easy: float = 0.95, hard: float = 0.5):
    """Acceptance that follows the text: stretches of ``period`` steps alternate between
    easy (``easy`` per draft token) and hard text; a depth-4 chain step costs 1.4 plain
    steps and a depth-6 one 2.0, so CHAIN4 is the better arm on either kind of text."""
    rng, step = random.Random(seed), [0]

    def spec_of(arm, batch_size):
        p = easy if (step[0] // period) % 2 == 0 else hard
        step[0] += 1
        return accepted_counts(rng, arm.depth, p, batch_size), {4: 1.4, 6: 2.0}[arm.depth]
    return spec_of


@pytest.mark.parametrize("seed", range(4))
def test_gate_compares_arms_on_the_same_text(seed):
    """An arm's own tokens/s mixes its merit with the text it happened to decode (an
    arm last pulled on easy text keeps the lead through a hard stretch); the gate's
    estimates share one acceptance profile, so where speculation pays egreedy exploits
    the arm that is better on the same text, and realises more than the bandit alone."""
    gated_t = gated(arms=(CHAIN4, CHAIN6), epsilon=0.0, seed=seed)
    chosen, rel = simulate(gated_t, 2000, stretchy_drafter(seed))
    late = [a for a in chosen[200:] if not a.is_off]
    assert sum(a == CHAIN6 for a in late) <= 0.01 * len(late)
    bandit = StrategyTuner([1, 2, 4, 8], {i: [CHAIN4, CHAIN6] for i in range(4)},
                           epsilon=0.0, seed=seed)
    _, rel_bandit = simulate(bandit, 2000, stretchy_drafter(seed))
    assert rel > rel_bandit


def test_gate_rechecks_plain_near_break_even():
    """Speculating at a small margin, plain decoding is re-measured now and then (its
    reference may be stale), within the budget."""
    t = gated(arms=(CHAIN4,))
    chosen, rel = simulate(t, 2000, drafter(0.6, step_cost=lambda a: 1.75))  # 1.3x
    late = chosen[500:]
    plain = sum(a.is_off for a in late)
    assert 0 < plain < 0.1 * len(late)
    assert rel > 1.2


def test_gate_picks_up_a_retrained_drafter_and_drops_a_stale_one():
    t = gated(probe_budget=0.02)
    simulate(t, 600, drafter(0.1))
    assert t.best(1) == OFF
    chosen, _ = simulate(t, 400, drafter(0.85, seed=1))  # the drafter was retrained
    first = next(i for i, a in enumerate(chosen) if not a.is_off)
    assert first < 150  # the next probe comes within the (backed-off) budget's spacing
    # and speculation stays on (plain decoding re-measured every 128 steps)
    assert sum(a.is_off for a in chosen[first + 15:]) <= 3
    # the policy drifted: the drafter is stale. What speculating loses is charged
    # against the budget, which stops it within ~25 steps; then probes resume at the
    # budget's rate
    chosen, rel = simulate(t, 600, drafter(0.1, seed=2))
    spec_steps = [i for i, a in enumerate(chosen) if not a.is_off]
    assert spec_steps[:10] == list(range(10)) and len(spec_steps) < 80
    assert rel > 0.95


def test_gate_compares_at_the_same_batch_size():
    """Plain step times are kept per batch size, so a bucket spanning 5-8 compares a
    speculative step at 5 with plain decoding at 5, not with an 8-row step."""
    t = StrategyTuner([8], {0: [CHAIN4]}, break_even=True)
    for _ in range(3):
        update(t, 8, OFF, 8, 1.6)
        update(t, 5, OFF, 5, 1.0)
    assert t.plain_seconds(8) == 1.6 and t.plain_seconds(5) == 1.0
    assert t.plain_seconds(6) == 1.0 and t.plain_seconds(7) == 1.6  # nearest in the bucket
    update(t, 5, CHAIN4, 5 * 1.2, 1.1)  # 1.2 tokens per sequence in 1.1 plain-5 steps
    assert t.gate_stats()["1+"]["arm_speedup"] == pytest.approx(1.2 / 1.1)
    assert t.best(5) == CHAIN4
    t2 = StrategyTuner([2, 8], {0: [CHAIN4], 1: [CHAIN4]}, break_even=True)
    t2.observe_plain(2, 1.0)  # another bucket's plain data is not used
    assert t2.plain_seconds(3) is None and choose(t2, 3) == OFF
    assert last(t2).declined and not last(t2).probe


def test_gate_reference_survives_an_outlier_and_switch_costs_charge_losing_probes():
    """The plain reference is a median over three or more steps (a first step that paid
    for a one-off, e.g. a kernel build, must not make every drafter look fast); the
    drafter's catch-up before a step (switch_seconds) is charged only to a probe that
    finds speculation losing."""
    t = gated(arms=(CHAIN4,))
    for sec in (30.0, 1.0, 1.0):
        assert choose(t, 1) == OFF
        update(t, 1, OFF, 1, sec)
    assert t.plain_seconds(1) == 1.0
    t2 = gated(arms=(CHAIN4,))
    for sec in (1.0, 1.0, 1.0):
        choose(t2, 1)
        update(t2, 1, OFF, 1, sec)
    assert choose(t2, 1) == CHAIN4 and last(t2).probe
    update(t2, 1, CHAIN4, 3, 1.4, accepted_drafts=[2], switch_seconds=5.0)  # pays: 2.1x
    g = t2.gate.gates[0]
    assert g.lost == 0.0 and g.elapsed == pytest.approx(9.4, abs=0.05)  # (decayed)
    assert choose(t2, 1) == CHAIN4 and not last(t2).probe
    t3 = gated(arms=(CHAIN4,))
    for sec in (1.0, 1.0, 1.0):
        choose(t3, 1)
        update(t3, 1, OFF, 1, sec)
    choose(t3, 1)
    update(t3, 1, CHAIN4, 1, 1.4, accepted_drafts=[0], switch_seconds=5.0)  # loses
    assert t3.gate.gates[0].lost == pytest.approx(0.4 + 5.0)
    assert choose(t3, 1) == OFF and last(t3).declined


def test_probe_whose_catch_up_exceeds_the_budget_is_declined():
    """A probe late in long responses would feed the drafter every position it missed;
    ``decide(batch, pending)`` runs the step plainly when the estimated catch-up (the
    measured seconds per position) does not fit in the bucket's remaining allowance.
    Speculation that pays is never held back."""
    t = gated(arms=(CHAIN4,))
    for _ in range(3):
        choose(t, 1)
        update(t, 1, OFF, 1, 1.0)
    # the first catch-up is measured, whatever it costs
    assert choose(t, 1, pending=10_000) == CHAIN4 and last(t).probe
    # 0.4 s over 400 positions = 1 ms each; the losing probe is charged 0.4 + 0.4 s
    update(t, 1, CHAIN4, 1, 1.4, accepted_drafts=[0], switch_seconds=0.4, switch_positions=400)
    assert t.gate.catchup == pytest.approx(0.001)
    for _ in range(400):  # plain steps until the allowance (1 % of the decode time) is back
        if choose(t, 1) != OFF:
            break
        update(t, 1, OFF, 1, 1.0)
    for _ in range(100):  # more decode time: a larger allowance left
        update(t, 1, OFF, 1, 1.0)
    g = t.gate.gates[0]
    left = 0.01 * max(g.elapsed, 100 * t.plain_seconds(1)) / 2 ** g.backoff - g.lost
    assert left > 0.01
    state = json.loads(json.dumps(t.state_dict()))
    assert choose(t, 1, pending=int(0.5 * left / 0.001)) == CHAIN4 and last(t).probe
    # ... or what the bucket saved since its last probe (see the next test); the same
    # decision with more positions pending runs plain
    t.load_state_dict(state)
    assert choose(t, 1, pending=int(2 * max(left, g.saved) / 0.001) + 10) == OFF
    assert last(t).declined and not last(t).probe
    g = t.gate.gates[0]
    probes = g.probes
    update(t, 1, OFF, 1, 1.0)
    assert t.gate.gates[0].probes == probes  # counted as a declined (plain) step
    state = t.state_dict()
    t2 = gated(arms=(CHAIN4,))
    t2.load_state_dict(json.loads(json.dumps(state)))
    assert t2.gate.catchup == pytest.approx(0.001)
    # not a probe (a paying arm, or a plain step): always affordable
    good = gated(arms=(CHAIN4,))
    for _ in range(3):
        choose(good, 1)
        update(good, 1, OFF, 1, 1.0)
    choose(good, 1)
    update(good, 1, CHAIN4, 5, 1.2, accepted_drafts=[4])  # 4.2x
    assert choose(good, 1, pending=10_000) == CHAIN4 and not last(good).probe


def test_probe_with_a_large_catch_up_waits_until_it_is_saved_up():
    """A drafter that lost its first probes is re-tried even when every later probe's
    catch-up (a long prompt, a long plainly decoded stretch) costs more than a window's
    allowance: the bucket saves its allowance at the budget's (backed-off) rate, so the
    large probe runs after a bounded wait, spends what was saved, and a drafter that
    pays now is picked up (the lock-out this replaces: a good drafter misjudged by its
    first steps never speculated again)."""
    t = gated(arms=(CHAIN4,))
    for _ in range(3):
        choose(t, 1)
        update(t, 1, OFF, 1, 1.0)
    assert choose(t, 1, pending=200) == CHAIN4 and last(t).probe  # the first is measured
    # a bad start: 1 token per 1.4 s, catch-up 0.2 s over 200 positions (1 ms each)
    update(t, 1, CHAIN4, 1, 1.4, accepted_drafts=[0], switch_seconds=0.2, switch_positions=200)
    g = t.gate.gates[0]
    big = 3000  # positions: 3 s of catch-up, more than any window's allowance (~1-2 s)
    waited, ran = 0, False
    for _ in range(20_000):
        if choose(t, 1, pending=big) != OFF:
            ran = True
            break
        assert 0.01 * max(g.elapsed, 100.0) / 2 ** g.backoff < big * 0.001
        update(t, 1, OFF, 1, 1.0)
        waited += 1
    assert ran
    # saved at 1 % of the decode time, backed off: 3 s take 300-2,400 plain steps
    assert 300 <= waited <= 2400
    assert g.saved >= big * 0.001
    # the probe pays now (4.2x): its catch-up is spent from the savings, speculation on
    update(t, 1, CHAIN4, 5, 1.2, accepted_drafts=[4], switch_seconds=3.0, switch_positions=big)
    assert g.saved < 0.1
    assert choose(t, 1) == CHAIN4 and not last(t).probe
    state = json.loads(json.dumps(t.state_dict()))
    assert state["gate"]["buckets"][0]["saved"] == pytest.approx(g.saved)
    t2 = gated(arms=(CHAIN4,))
    t2.load_state_dict(state)
    assert t2.gate.gates[0].saved == pytest.approx(g.saved)


def test_gate_state_round_trip(tmp_path):
    t = gated(probe_budget=0.05, seed=4)
    simulate(t, 300, drafter(0.5, step_cost=lambda a: 1.0 + 0.15 * a.depth))
    path = tmp_path / "tuner.json"
    t.save(path)
    loaded = StrategyTuner.load(path)
    assert loaded.break_even and loaded.probe_budget == 0.05
    assert loaded.state_dict() == t.state_dict()
    a, _ = simulate(t, 300, drafter(0.6, seed=5))
    b, _ = simulate(loaded, 300, drafter(0.6, seed=5))
    assert a == b
    assert loaded.stats() == t.stats()
    # a version-1 state (before the gate) loads with an empty gate
    v1 = {k: v for k, v in t.state_dict().items() if k != "gate"}
    v1["version"] = 1
    fresh = gated(probe_budget=0.05, seed=4)
    fresh.load_state_dict(v1)
    assert fresh.gate_stats() == {} and choose(fresh, 1) == OFF


def test_gate_bounds_probing_over_a_long_tail():
    """A long tail walks down the buckets (8 -> 1); each first probe of a weak drafter
    costs a catch-up and a slow step. The overall account keeps the buckets after the
    first from each probing on their own allowance: the tail stays within a few percent
    of plain decoding, and with a good drafter every bucket still speculates."""
    def run(p_accept):
        t = StrategyTuner([1, 2, 4, 8], parse_arms("1:6_1_6;2:4_1_4;3-4:3_1_3;5-8:2_1_2",
                                                   [1, 2, 4, 8]), break_even=True)
        spec_of = drafter(p_accept, step_cost=lambda a: 1.5 + 0.1 * a.depth)
        plain_time = spec_time = 0.0
        chosen = {}
        for b in [8] * 40 + [7] * 30 + [6] * 20 + [5] * 20 + [4] * 20 + [3] * 15 + \
                [2] * 30 + [1] * 60:
            t_plain = 0.5 + 0.06 * b
            arm = choose(t, b)
            if arm.is_off:
                update(t, b, arm, b, t_plain)
                spec_time += t_plain
            else:  # the first probe in a bucket also catches up the prompts
                acc, rel = spec_of(arm, b)
                switch = 2.0 * t_plain if not any(not a.is_off for a in chosen.get(
                    t.bucket_of(b), [])) else 0.0
                update(t, b, arm, sum(a + 1 for a in acc), rel * t_plain,
                         accepted_drafts=acc, switch_seconds=switch)
                spec_time += rel * t_plain * b / sum(a + 1 for a in acc) + switch
            plain_time += t_plain
            chosen.setdefault(t.bucket_of(b), []).append(arm)
        return plain_time / spec_time, chosen

    rel, chosen = run(0.05)
    assert rel > 0.97, rel
    probed = [b for b, arms in chosen.items() if any(not a.is_off for a in arms)]
    assert 0 < len(probed) < 4  # not every bucket paid for a first probe
    rel, chosen = run(0.9)
    assert rel > 1.3
    assert all(sum(not a.is_off for a in arms) > len(arms) / 2 for arms in chosen.values())


def test_gate_refreshes_a_plain_reference_measured_on_a_busy_machine():
    """Plain decoding measured while the machine was busy (3x slower) makes any drafter
    look fast; speculating, the gate re-measures plain decoding now and then, and a
    re-measurement far off the reference is repeated until the median is new, after
    which a random drafter is declined."""
    t = gated(arms=(CHAIN4,))
    for _ in range(3):
        choose(t, 1)
        update(t, 1, OFF, 1, 3.0)  # busy
    spec_of = drafter(0.05)
    chosen = []
    for _ in range(400):
        arm = choose(t, 1)
        if arm.is_off:
            update(t, 1, arm, 1, 1.0)  # quiet again
        else:
            acc, sec = spec_of(arm, 1)
            update(t, 1, arm, acc[0] + 1, sec, accepted_drafts=acc)
        chosen.append(arm)
    first_plain = chosen.index(OFF)
    assert first_plain <= 4 * 32 + 1
    assert chosen[first_plain: first_plain + 3] == [OFF] * 3  # re-measured three times
    assert t.plain_seconds(1) == 1.0 and t.best(1) == OFF
    assert sum(not a.is_off for a in chosen[first_plain + 50:]) < 10


def test_gate_remeasures_plain_when_a_speculative_step_beats_it():
    """A speculative step cannot be faster than a plain one (it verifies a superset);
    one that is means the plain reference is stale: it is re-measured at once."""
    t = gated(arms=(CHAIN4,))
    for _ in range(3):
        choose(t, 1)
        update(t, 1, OFF, 1, 3.0)  # measured while the machine was busy
    assert choose(t, 1) == CHAIN4
    update(t, 1, CHAIN4, 2, 1.4, accepted_drafts=[1])  # 0.47 of a plain step
    plain = 0
    while choose(t, 1) == OFF and plain < 10:  # re-measured until the median is new
        update(t, 1, OFF, 1, 1.0)
        plain += 1
    assert 3 <= plain < 10 and t.plain_seconds(1) == 1.0


def test_acceptance_profile_never_rises_with_the_draft_position():
    """A position is measured on the steps of the chains reaching it: here a 2-deep chain
    on hard text, then a 6-deep one on easy text, so positions 3..6 saw only easy text.
    No sequence accepts draft j+1 without draft j: the profile (and the chains' expected
    tokens built on it) is capped by the shallower positions' rates."""
    t = gated()
    update(t, 1, S("2_1_2"), 10, 1.0, accepted_drafts=[1] + [0] * 9)
    update(t, 1, CHAIN6, 70, 1.0, accepted_drafts=[6] * 10)
    profile = t.acceptance_profile()
    assert len(profile) == 6 and profile[0] < 0.9
    assert all(b <= a for a, b in zip(profile, profile[1:])), profile
    assert t.expected_tokens(CHAIN6) == pytest.approx(1 + sum(profile))
    assert t.expected_tokens(S("8_1_8")) == pytest.approx(1 + sum(profile) + 2 * profile[-1])
