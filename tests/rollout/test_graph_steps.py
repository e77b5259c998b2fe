"""The fixed-shape target steps that CUDA graphs capture (``rollout/cuda_graphs.py``),
run on CPU through the same static buffers without capturing
(``GraphedDecoder(capture=False)``, warm-up writes included): they decode like the
engine's eager path, plain and speculative, greedy, standard and coupled, chains and
trees; padding rows attend over their own few tokens and write only their own free
row; nothing inside the step reads the device; ``rollout.cuda_graphs`` resolves auto /
true / false. tests_gpu/test_graphs_spec_cuda.py replays the captured graphs."""

from __future__ import annotations

import pytest
import torch

from megatron_tlt.config import ConfigError, RolloutConfig, SpeculativeConfig
from megatron_tlt.rollout import RolloutEngine, SamplingParams
from megatron_tlt.rollout.cuda_graphs import GraphedDecoder, _Step, resolve
from megatron_tlt.rollout.kv_cache import KVCache
from megatron_tlt.bench.sync_budget import HostSyncCounter, measure
from test_paged_engine import drafter_pool_gib
from tiny_models import VOCAB, sampling_modes, tiny_model_and_own_layer_drafter

MODES = sampling_modes(12)


@pytest.fixture(scope="module")
def model(tmp_path_factory, single_process_parallel):
    """A tiny two-layer model and a drafter that is its own first layer (drafts get
    accepted, so acceptance and commit run over several tokens)."""
    from megatron_tlt.runtime_env import apply_cpu_redirection

    apply_cpu_redirection()
    return tiny_model_and_own_layer_drafter(tmp_path_factory.mktemp("graph_steps"), "cpu")


def _prompts(lengths=(3, 9, 5, 1, 12, 7, 2)):
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in lengths]


def _engine(model, mode, strategy=None, static=False, min_draft_prob=0.0, max_batch=4,
            threshold=64, **kw):
    """An engine on the eager torch path (the one CUDA runs: no fused CPU kernels), or
    with ``static`` through the fixed-shape steps run eagerly."""
    m, arch, d = model
    sc = (SpeculativeConfig(policy="fixed", strategy=strategy, threshold=threshold,
                          min_draft_prob=min_draft_prob)
          if strategy else SpeculativeConfig())
    cfg = RolloutConfig(speculative=sc, cpu_kernels="false", max_batch_size=max_batch,
                        sampling_mode="coupled" if mode == "coupled" else "standard", **kw)
    eng = RolloutEngine(m, None, cfg, arch=arch, eos_token_ids=[],
                        drafter=d if strategy else None)
    assert eng._graphs is None  # auto: off on CPU
    if static:
        eng.enable_graphs(capture=False)
    return eng


def _same(a, b, tol=1e-5):
    """Tokens identical, log-probs equal up to the float32 rounding of a longer
    attention span and a padded batch."""
    for x, y in zip(a, b):
        assert x.token_ids == y.token_ids
        assert max(abs(p - q) for p, q in zip(x.logprobs, y.logprobs)) <= tol


# ----------------------------------------------------------------------------- outputs
@pytest.mark.parametrize("mode", list(MODES))
def test_static_plain_steps_decode_like_the_eager_path(model, mode):
    prompts = _prompts()
    eager = _engine(model, mode).generate(prompts, MODES[mode])
    eng = _engine(model, mode, static=True)
    static = eng.generate(prompts, MODES[mode])
    _same(static, eager)
    # 4 rows for 7 prompts: the first 4 in bucket 4, then the last 3 in bucket 4 with a
    # padding row (the cache's 4 rows; no more are made for the graphs)
    assert set(eng._graphs.graphs) == {(4, 1, 0, False)}  # (bucket, T, W, embeds)
    assert eng.memory.cache.max_batch == 4 and eng.last_stats.batch_sizes[-1] == 3


@pytest.mark.parametrize("strategy", ["4_1_4", "3_2_5", "confident_4_1_4"])
@pytest.mark.parametrize("mode", list(MODES))
def test_static_speculative_steps_decode_like_the_eager_path(model, mode, strategy):
    """Verification through the fixed-shape steps: chains (every row depth + 1 tokens),
    chains cut by the confidence stop (a key per width), trees (mask and depth
    positions); and the one-layer drafter's catch-up, chain and tree forwards through
    its own; acceptance is the eager one either way."""
    prompts = _prompts()
    stop = 0.01 if strategy.startswith("confident") else 0.0
    strategy = strategy.split("_", 1)[1] if stop else strategy
    eager = _engine(model, mode, strategy, min_draft_prob=stop)
    want = eager.generate(prompts, MODES[mode])
    eng = _engine(model, mode, strategy, static=True, min_draft_prob=stop)
    got = eng.generate(prompts, MODES[mode])
    _same(got, want)
    assert eng.last_stats.spec.steps == eager.last_stats.spec.steps > 0
    keys = set(eng._graphs.graphs)
    tree = strategy == "3_2_5"
    verify = {k for k in keys if k[1] > 1}
    assert verify and all(k[2] == (k[1] if tree else 0) for k in verify)
    if not tree and not stop:
        assert {k[1] for k in verify} == {5}  # root + 4 drafts
    # the drafter's forwards over its own cache: catch-up and chain steps (one token per
    # row, its inputs as embeddings), tree steps (top-k per row, mask over the fed nodes)
    drafted = set(eng.spec.drafting.graphs.graphs)
    assert drafted and all(k[3] for k in drafted)
    # (a catch-up wider than the draft slack runs eagerly: no key per width)
    assert all(k[1] <= eng.spec.drafting.static_tokens for k in drafted)
    assert any(k[1:3] == (1, 0) for k in drafted)
    assert any(k[2] > k[1] for k in drafted) == tree


@pytest.mark.parametrize("strategy", [None, "4_1_4", "3_2_5"])
@pytest.mark.parametrize("mode", ["greedy", "coupled"])
def test_paged_static_steps_decode_like_the_slot_cache(model, mode, strategy):
    """rollout.kv_cache=paged through the fixed-shape steps: the block table is a
    fixed-shape tensor [rows, blocks per row] updated in place before the step, so a
    graph keyed by bucket reads every row's blocks whatever their lengths; a small
    pool preempts. The tokens equal the eager slot cache's."""
    prompts = _prompts()
    want = _engine(model, mode, strategy).generate(prompts, MODES[mode])
    bs = 4
    per_block = 2 * model[1].num_layers * model[1].num_query_groups * bs * \
        model[1].kv_channels * 4
    eng = _engine(model, mode, strategy, static=True, kv_cache="paged", kv_block_size=bs,
                  kv_cache_gib=(20 if strategy else 10) * per_block / 2**30)
    if strategy:  # the drafter's paged cache beside the target's blocks
        eng.config.kv_cache_gib += drafter_pool_gib(eng, prompts, MODES[mode])
    table = eng.memory.cache
    got = eng.generate(prompts, MODES[mode])
    _same(got, want)
    assert eng.memory.cache.paged and eng.last_stats.preemptions > 0
    assert table is None or table is eng.memory.cache
    assert all(k[0] in (1, 2, 4) for k in eng._graphs.graphs)


@pytest.mark.parametrize("mode", ["greedy", "standard"])
def test_static_steps_when_speculation_switches_on_in_the_tail(model, mode):
    """Speculation on below 2 rows: the drafter catches up on every position decoded
    plainly (wider than the draft slack: eagerly, no key per width), then drafts and
    verifies through the static steps; the outputs are the eager engine's."""
    prompts = _prompts()[:4]
    sp = [SamplingParams(**{**MODES[mode].__dict__, "max_new_tokens": n})
          for n in (6, 8, 26, 30)]  # two rows run on alone for 18 tokens or more
    eager = _engine(model, mode, "4_1_4", threshold=2)
    want = eager.generate(prompts, sp)
    eng = _engine(model, mode, "4_1_4", threshold=2, static=True)
    got = eng.generate(prompts, sp)
    _same(got, want)
    st = eng.last_stats.spec
    assert st.steps == eager.last_stats.spec.steps > 0 and st.catchup_tokens > 0
    drafting = eng.spec.drafting
    assert drafting.graphs.graphs
    assert all(k[1] <= drafting.static_tokens < 20 for k in drafting.graphs.graphs)
    # the switch-on catch-up fed more positions per row than any graphed width
    assert st.catchup_tokens > 2 * drafting.static_tokens, st.catchup_tokens


def test_gathered_runner_decodes_through_the_static_steps(model, monkeypatch):
    """The gathered PP mode's runner (here at PP = 1: one stage, its own share) takes
    the fixed-shape steps like the PP = 1 runner (tests_gpu captures them on CUDA;
    the PP = 2 exchange is tests/rollout/test_rollout_tp.py's)."""
    from megatron_tlt.rollout import engine as engine_module
    from megatron_tlt.rollout.gathered import GatheredRunner

    prompts = _prompts()
    want = _engine(model, "greedy", "3_2_5").generate(prompts, MODES["greedy"])
    monkeypatch.setattr(engine_module, "make_runner",
                        lambda m, arch, mode: GatheredRunner(m, arch))
    eng = _engine(model, "greedy", "3_2_5", static=True)
    assert isinstance(eng.runner, GatheredRunner) and eng.runner.supports_graphs
    got = eng.generate(prompts, MODES["greedy"])
    _same(got, want)
    assert any(k[2] for k in eng._graphs.graphs)


# ----------------------------------------------------------------------------- padding rows
def test_padding_rows_attend_over_their_own_length_and_touch_only_their_row(model):
    """Three running rows in a bucket of four: the running rows' keys change only at
    their new positions, the padding row's only at its first T slots (start 0), and
    the running rows' hidden states are the eager forward's. The warm-up writes (the
    cache's last T slots of every bucket row) land beyond every row's length."""
    m, arch, _ = model
    eng = _engine(model, "greedy")
    runner = eng.runner
    cap, t = 24, 3
    cache = KVCache(num_layers=len(runner.layers), max_batch=4, kv_heads=runner.groups,
                    capacity=cap, head_dim=arch.kv_channels, dtype=torch.float32,
                    device=torch.device("cpu"))
    g = torch.Generator().manual_seed(1)
    cache.k.copy_(torch.randn(cache.k.shape, generator=g))
    cache.v.copy_(torch.randn(cache.v.shape, generator=g))
    before_k, before_v = cache.k.clone(), cache.v.clone()
    tokens = torch.randint(0, VOCAB, (3, t), generator=g)
    start = torch.tensor([5, 11, 2])
    graphs = GraphedDecoder(runner, capture=False)
    got = graphs.verify(cache, tokens, start)
    step = graphs.graphs[(4, t, 0, False)]
    assert step.start.tolist() == [5, 11, 2, 0]  # the padding row: its own length, 0
    assert step.tokens[3].tolist() == [0] * t
    written = torch.zeros(4, cap, dtype=torch.bool)
    for row, s in enumerate([5, 11, 2, 0]):
        written[row, s: s + t] = True
    written[:, cap - t:] = True  # the warm-up's slots
    for now, was in ((cache.k, before_k), (cache.v, before_v)):
        changed = (now != was).any(dim=-1).any(dim=2).any(dim=0)  # [rows, positions]
        assert not (changed & ~written).any()
        assert changed[3, :t].all() and changed[:3, cap - t:].all()
    # the eager forward on a copy of the cache as it was
    ref = KVCache(num_layers=len(runner.layers), max_batch=4, kv_heads=runner.groups,
                  capacity=cap, head_dim=arch.kv_channels, dtype=torch.float32,
                  device=torch.device("cpu"))
    ref.k.copy_(before_k)
    ref.v.copy_(before_v)
    with torch.no_grad():
        want = runner.extend(ref, slice(0, 3), tokens, start, span=int(start.max()) + t)
    assert (got - want).abs().max() < 1e-5
    # a padding row's attention: its T keys causally (finite hidden states, no NaN of
    # an empty softmax)
    assert torch.isfinite(step.out[3]).all()


def test_the_static_step_reads_nothing_from_the_device(model, monkeypatch):
    """Inside the region a graph captures nothing reads a device value (a read would
    fail the capture), and the engine's per-step budgets hold on the static path."""
    inside = HostSyncCounter()
    replay = _Step.replay

    def counted(self):
        with inside:
            return replay(self)

    monkeypatch.setattr(_Step, "replay", counted)
    for strategy in (None, "4_1_4", "3_2_5"):
        eng = _engine(model, "standard", strategy, static=True)
        steps = measure(eng, _prompts(), MODES["standard"])
        assert inside.count == 0, inside.where
        plain = [s.count for s in steps if not s.speculative]
        spec = [s.count for s in steps if s.speculative]
        assert (spec if strategy else plain) and not (strategy is None and spec)
        assert max(plain, default=0) <= 1 and max(spec, default=0) <= 2
    with inside:  # (the counter inside the step counts what it sees)
        torch.zeros(2).tolist()
    assert inside.count == 1


# ----------------------------------------------------------------------------- auto's measurement
class _Graph:
    """A stand-in for a captured graph on CPU: its replay runs the static step."""

    replays = 0

    def __init__(self, step: _Step):
        self.step = step

    def replay(self) -> None:
        _Graph.replays += 1
        self.step.out = self.step.fn()


class _StubCapture(GraphedDecoder):
    """``GraphedDecoder`` with its capture stubbed (CPU): everything else, the auto
    measurement included, is the real code."""

    recorded: list = []

    def __init__(self, runner, capture=True, **kw):
        super().__init__(runner, capture=False, **kw)
        self.capture = capture

    def _record(self, s: _Step):
        _StubCapture.recorded.append(tuple(s.tokens.shape))
        return _Graph(s), s.fn()


@pytest.mark.parametrize("mode", ["greedy", "standard"])
def test_auto_keeps_a_graph_only_where_it_measured_faster(model, monkeypatch, mode):
    """rollout.cuda_graphs=auto times each key's graph against the eager step once, at
    its first capture, through the injected timer (here: one token per row measures
    slower as a graph, wider steps faster); the slower keys run eagerly, the decisions
    and times are in the call's stats, nothing is measured again (a later call, a
    re-capture after a release), and the outputs are the eager engine's."""
    from megatron_tlt.rollout import cuda_graphs

    prompts = _prompts()
    want = _engine(model, mode, "3_2_5").generate(prompts, MODES[mode])
    timed = []

    def timer(fn, runs):
        assert runs == cuda_graphs.TIMED_RUNS
        graph = getattr(fn, "__self__", None)
        if isinstance(graph, _Graph):
            timed.append(tuple(graph.step.tokens.shape))
            return 1.0 if graph.step.tokens.shape[1] == 1 else 0.5
        return 0.8  # the eager step

    monkeypatch.setattr(cuda_graphs, "GraphedDecoder", _StubCapture)
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: None)
    _StubCapture.recorded = []
    eng = _engine(model, mode, "3_2_5")
    eng.enable_graphs()
    assert isinstance(eng._graphs, _StubCapture) and eng._graphs.measure  # auto
    eng._graphs.timer = timer
    got = eng.generate(prompts, MODES[mode])
    _same(got, want)
    decoders = [eng._graphs, eng.spec.drafting.graphs]
    assert all(isinstance(g, _StubCapture) for g in decoders)
    stats = eng.last_stats.graphs
    for prefix, g in zip(("target", "eagle"), decoders):
        assert g.graphs and set(g.decided) == set(g.graphs)  # every key measured
        for key, step in g.graphs.items():
            d = g.decided[key]
            assert d.graphed == (key[1] > 1)
            assert (step.graph is not None) == d.graphed
            name = f"{prefix}/{cuda_graphs.key_name(key)}"
            assert stats[name] == dict(graphed=d.graphed, graph_seconds=d.graph_seconds,
                                       eager_seconds=0.8)
    assert eng.last_stats.summary()["graphs"] == stats
    assert sorted(timed) == sorted(_StubCapture.recorded)  # once per key
    assert _Graph.replays > len(timed)  # the faster keys replayed their graphs
    # a later call and a re-capture after the release: no new measurement, and the
    # keys measured slower are not captured again
    n_timed, graphed = len(timed), sum(d.graphed for g in decoders for d in g.decided.values())
    _same(eng.generate(prompts, MODES[mode]), want)
    eng.release_memory()
    _same(eng.generate(prompts, MODES[mode]), want)
    assert len(timed) == n_timed
    assert len(_StubCapture.recorded) == n_timed + graphed


def test_true_graphs_every_key_unmeasured(model, monkeypatch):
    from megatron_tlt.rollout import cuda_graphs

    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: None)
    eng = _engine(model, "greedy")
    eng._graphs = _StubCapture(eng.runner, measure=False,
                               timer=lambda fn, runs: pytest.fail("timed under true"))
    eng.generate(_prompts(), MODES["greedy"])
    assert eng._graphs.graphs and not eng._graphs.decided and not eng.last_stats.graphs
    assert all(s.graph is not None for s in eng._graphs.graphs.values())
    assert cuda_graphs.key_name((4, 5, 5, True)) == "b4_t5_w5_embeds"


# ----------------------------------------------------------------------------- the setting
def test_cuda_graphs_setting_resolves_auto_true_false(model):
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert resolve("auto", cuda, True) and not resolve("auto", cpu, True)
    assert not resolve("auto", cuda, False)  # the pipelined PP mode: eager
    assert resolve("true", cuda, True) and not resolve("false", cuda, True)
    with pytest.raises(ValueError, match="cuda_graphs=true needs CUDA"):
        resolve("true", cpu, True)
    with pytest.raises(ValueError, match="pipeline_mode=pipelined"):
        resolve("true", cuda, False)
    assert RolloutConfig().cuda_graphs == "auto"
    assert RolloutConfig(cuda_graphs=True).cuda_graphs == "true"
    assert RolloutConfig(cuda_graphs="False").cuda_graphs == "false"
    with pytest.raises(ConfigError, match="cuda_graphs"):
        RolloutConfig(cuda_graphs="sometimes")
    m, arch, _ = model
    assert RolloutEngine(m, None, RolloutConfig(), arch=arch, eos_token_ids=[])._graphs is None
    with pytest.raises(ValueError, match="cuda_graphs=true needs CUDA"):
        RolloutEngine(m, None, RolloutConfig(cuda_graphs="true"), arch=arch,
                      eos_token_ids=[])
