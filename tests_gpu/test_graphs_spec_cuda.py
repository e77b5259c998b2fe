"""Graph-ready speculative steps on CUDA (``rollout/cuda_graphs.py``): the target's
verification forward captured per (batch bucket, tokens per row, tree mask width) and
replayed like the plain decode step, and the one-layer drafter's forwards likewise over
its cache.

Covered: graphed speculation equals eager speculation (greedy, standard and coupled
sampling; chains, chains cut by the confidence stop, trees; the one-layer drafter's
own forwards graphed too; the self-drafter's verification), graphs
in the gathered PP mode's runner (here one stage: NCCL at world size 1, its
exchange collectives executed), the pipelined mode refused under ``true`` and eager
under ``auto``, ``auto`` on with CUDA, and padding rows of a real capture attending
over their own few slots without touching a running row's keys. The same static-buffer
code runs eagerly on CPU in tests/rollout/test_graph_steps.py.
"""

from __future__ import annotations

import pytest
import torch

from megatron_tlt.config import RolloutConfig, SpeculativeConfig
from megatron_tlt.rollout import RolloutEngine
from megatron_tlt.rollout.cuda_graphs import GraphedDecoder
from megatron_tlt.rollout.kv_cache import KVCache
from tiny_models import VOCAB, sampling_modes, tiny_model_and_own_layer_drafter

CUDA = torch.device("cuda", 0)
MODES = sampling_modes(12)


@pytest.fixture(scope="module")
def model(parallel, tmp_path_factory):
    """A tiny two-layer fp32 model on CUDA and a drafter that is its own first layer
    (drafts get accepted: acceptance and commit run over several tokens)."""
    return tiny_model_and_own_layer_drafter(tmp_path_factory.mktemp("graphs_spec"), CUDA)


def _prompts(lengths=(3, 9, 5, 1, 12, 7, 2)):
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in lengths]


def _engine(model, mode, strategy=None, graphs="true", min_draft_prob=0.0, drafter=None):
    m, arch, d = model
    sc = (SpeculativeConfig(policy="fixed", strategy=strategy, threshold=64,
                            min_draft_prob=min_draft_prob)
          if strategy else SpeculativeConfig())
    cfg = RolloutConfig(speculative=sc, max_batch_size=4, attention="sdpa",
                        cuda_graphs=graphs,
                        sampling_mode="coupled" if mode == "coupled" else "standard")
    if strategy is None:
        drafter = None
    elif drafter is None:
        drafter = d
    return RolloutEngine(m, None, cfg, arch=arch, eos_token_ids=[], drafter=drafter)


def _same(a, b, tol=1e-4):
    for x, y in zip(a, b):
        assert x.token_ids == y.token_ids
        assert max(abs(p - q) for p, q in zip(x.logprobs, y.logprobs)) < tol


@pytest.mark.parametrize("strategy", ["4_1_4", "3_2_5", "confident_4_1_4"])
@pytest.mark.parametrize("mode", list(MODES))
def test_graphed_speculation_equals_eager_speculation_on_cuda(model, mode, strategy):
    prompts = _prompts()
    stop = 0.01 if strategy.startswith("confident") else 0.0
    strategy = strategy.split("_", 1)[1] if stop else strategy
    eager = _engine(model, mode, strategy, graphs="false", min_draft_prob=stop)
    assert eager._graphs is None
    want = eager.generate(prompts, MODES[mode])
    eng = _engine(model, mode, strategy, min_draft_prob=stop)
    got = eng.generate(prompts, MODES[mode])
    again = eng.generate(prompts, MODES[mode])  # replays the captured graphs
    _same(got, want)
    for g, a in zip(got, again):
        assert g.token_ids == a.token_ids and g.logprobs == a.logprobs
    tree = strategy == "3_2_5"
    verify = [k for k in eng._graphs.graphs if k[1] > 1]
    assert verify and all(k[2] == (k[1] if tree else 0) for k in verify)
    assert eng.last_stats.spec.steps > 0
    # the one-layer drafter's catch-up, chain and tree steps replay graphs of their own
    drafted = eng.spec.drafting.graphs
    assert drafted.capture and drafted.captured and all(k[3] for k in drafted.graphs)
    assert any(k[2] > k[1] for k in drafted.graphs) == tree


@pytest.mark.parametrize("strategy", ["4_1_4", "3_2_5"])
def test_graphed_self_drafter_verification_equals_eager_on_cuda(model, strategy):
    from megatron_tlt.rollout.speculative.self_drafter import SelfDrafter

    prompts = _prompts()
    want = _engine(model, "greedy", strategy, graphs="false",
                   drafter=SelfDrafter()).generate(prompts, MODES["greedy"])
    eng = _engine(model, "greedy", strategy, drafter=SelfDrafter())
    _same(eng.generate(prompts, MODES["greedy"]), want)
    assert any(k[1] > 1 for k in eng._graphs.graphs)
    assert eng.spec.drafting.graphs is None  # the copy drafts eagerly


def test_graphs_in_the_gathered_pp_mode_on_cuda(model, monkeypatch):
    """The gathered mode's runner (one stage here: its weight broadcasts and output
    exchange run at size 1 over NCCL) decodes through graphs, plain and speculative,
    like the PP = 1 eager engine; the pipelined runner is refused under true and
    decodes eagerly under auto."""
    from megatron_tlt.rollout import engine as engine_module
    from megatron_tlt.rollout.gathered import GatheredRunner
    from megatron_tlt.rollout.pipeline import PipelinedRunner

    prompts = _prompts()
    want_plain = _engine(model, "greedy", graphs="false").generate(prompts, MODES["greedy"])
    want_spec = _engine(model, "greedy", "3_2_5", graphs="false").generate(prompts,
                                                                         MODES["greedy"])
    monkeypatch.setattr(engine_module, "make_runner",
                        lambda m, arch, mode: GatheredRunner(m, arch))
    plain = _engine(model, "greedy")
    spec = _engine(model, "greedy", "3_2_5")
    assert isinstance(plain.runner, GatheredRunner) and plain._graphs is not None
    _same(plain.generate(prompts, MODES["greedy"]), want_plain)
    _same(spec.generate(prompts, MODES["greedy"]), want_spec)
    assert plain._graphs.captured > 0 and any(k[2] for k in spec._graphs.graphs)

    monkeypatch.setattr(engine_module, "make_runner",
                        lambda m, arch, mode: PipelinedRunner(m, arch))
    with pytest.raises(ValueError, match="pipeline_mode=pipelined"):
        _engine(model, "greedy")
    assert _engine(model, "greedy", graphs="auto")._graphs is None


def test_cuda_graphs_auto_is_on_with_cuda(model):
    m, arch, _ = model
    eng = RolloutEngine(m, None, RolloutConfig(), arch=arch, eos_token_ids=[])
    assert eng.config.cuda_graphs == "auto"
    assert eng._graphs is not None and eng._graphs.capture


def test_padding_rows_attend_over_their_own_length_on_cuda(model):
    """A real capture and two replays, three running rows in a bucket of four: the
    running rows' keys change only at their new positions (and the warm-up's last T
    slots, beyond every length), the padding row's only at its first T slots; the
    running rows' hidden states are the eager forward's."""
    m, arch, _ = model
    runner = _engine(model, "greedy", graphs="false").runner
    cap, t = 24, 3
    shape = dict(num_layers=len(runner.layers), max_batch=4, kv_heads=runner.groups,
                 capacity=cap, head_dim=arch.kv_channels, dtype=torch.float32, device=CUDA)
    cache = KVCache(**shape)
    g = torch.Generator(device=CUDA).manual_seed(1)
    cache.k.copy_(torch.randn(cache.k.shape, generator=g, device=CUDA))
    cache.v.copy_(torch.randn(cache.v.shape, generator=g, device=CUDA))
    graphs = GraphedDecoder(runner)
    for start in ([5, 11, 2], [7, 3, 9]):
        for c in (cache.k, cache.v):  # the free row's slots anew (the padding writes them)
            c[:, 3].copy_(torch.randn(c[:, 3].shape, generator=g, device=CUDA))
        before_k, before_v = cache.k.clone(), cache.v.clone()
        tokens = torch.randint(0, VOCAB, (3, t), generator=g, device=CUDA)
        st = torch.tensor(start, device=CUDA)
        got = graphs.verify(cache, tokens, st).clone()
        torch.cuda.synchronize()
        step = graphs.graphs[(4, t, 0, False)]
        assert step.graph is not None and step.start.tolist() == start + [0]
        written = torch.zeros(4, cap, dtype=torch.bool, device=CUDA)
        for row, s in enumerate(start + [0]):
            written[row, s: s + t] = True
        written[:, cap - t:] = True  # the warm-up's slots (first use only)
        for now, was in ((cache.k, before_k), (cache.v, before_v)):
            changed = (now != was).any(dim=-1).any(dim=2).any(dim=0)
            assert not (changed & ~written).any()
            assert changed[3, :t].all()
        ref = KVCache(**shape)
        ref.k.copy_(before_k)
        ref.v.copy_(before_v)
        with torch.no_grad():
            want = runner.extend(ref, slice(0, 3), tokens, st, span=max(start) + t)
        assert (got - want).abs().max() < 1e-4
        assert torch.isfinite(step.out[3]).all()
    assert graphs.captured == 1  # the second call replayed the first's graph


def test_cuda_graphs_auto_measures_each_key_once_and_equals_eager(model):
    """rollout.cuda_graphs=auto on CUDA: every key captured is timed against its eager
    step once (real CUDA events), the decision and both times are in the call's stats,
    a key measured slower holds no graph, and the outputs are the eager engine's."""
    from megatron_tlt.rollout.cuda_graphs import key_name

    prompts = _prompts()
    want = _engine(model, "greedy", "3_2_5", graphs="false").generate(prompts,
                                                                       MODES["greedy"])
    eng = _engine(model, "greedy", "3_2_5", graphs="auto")
    assert eng._graphs is not None and eng._graphs.measure
    _same(eng.generate(prompts, MODES["greedy"]), want)
    stats = eng.last_stats.graphs
    for prefix, g in (("target", eng._graphs), ("eagle", eng.spec.drafting.graphs)):
        assert g.graphs and set(g.decided) == set(g.graphs)
        for key, step in g.graphs.items():
            d = g.decided[key]
            assert d.graph_seconds > 0 and d.eager_seconds > 0
            assert d.graphed == (d.graph_seconds < d.eager_seconds)
            assert (step.graph is not None) == d.graphed
            assert stats[f"{prefix}/{key_name(key)}"]["graphed"] == d.graphed
    before = {k: v for k, v in eng._graphs.decided.items()}
    _same(eng.generate(prompts, MODES["greedy"]), want)  # replays, nothing re-measured
    assert eng._graphs.decided == before


def test_graph_pool_memory_matches_the_dry_run_model(parallel, tmp_path):
    """The dry run's model of a decoder's graphs (``rl.memory_model.graph_key_bytes``,
    ``graph_pool_bytes``) against CUDA's allocator around real captures of a plain, a
    chain and a tree key on one pool: the bytes held after capture (static inputs and
    outputs) within 10 % plus 512 B per tensor (the allocator's rounding); each
    capture's peak working set within 0.5-2.5x of the modelled one; the reserved growth
    over the three captures at most twice the modelled pool and inputs plus 4 MiB per
    key (2 MiB segments of small blocks, the pool's and the eager warm-ups')."""
    from megatron_tlt.models import load_model
    from megatron_tlt.rl import memory_model as mm
    from tiny_models import save_tiny_hf

    folder = save_tiny_hf("llama_tied", tmp_path / "m", seed=2, hidden_size=256,
                          intermediate_size=512, num_hidden_layers=2)
    m, arch = load_model(folder, device=CUDA, dtype="float32", impl="local")
    eng = RolloutEngine(m, None, RolloutConfig(max_batch_size=8, attention="sdpa",
                                               cuda_graphs="false"),
                        arch=arch, eos_token_ids=[])
    runner, cap = eng.runner, 256
    cache = KVCache(num_layers=len(runner.layers), max_batch=8, kv_heads=runner.groups,
                    capacity=cap, head_dim=arch.kv_channels, dtype=torch.float32,
                    device=CUDA)
    graphs = GraphedDecoder(runner)  # (true: no measurement)
    graphs._reset(cache)  # the rotary tables grown before anything is measured
    g = torch.Generator(device=CUDA).manual_seed(0)
    start = torch.randint(0, 100, (8,), generator=g, device=CUDA)
    tree_mask = torch.ones(6, 6, dtype=torch.bool, device=CUDA).tril()[None]
    calls = [  # (key, forward): plain 3 rows (bucket 4), chain 8 x 5, tree 8 x 6 x 6
        ((4, 1, 0), lambda: graphs.run(cache, torch.ones(3, 1, dtype=torch.long,
                                                         device=CUDA), start[:3])),
        ((8, 5, 0), lambda: graphs.verify(cache, torch.ones(8, 5, dtype=torch.long,
                                                            device=CUDA), start)),
        ((8, 6, 6), lambda: graphs.verify(
            cache, torch.ones(8, 6, dtype=torch.long, device=CUDA), start,
            rope_positions=start[:, None] + torch.arange(6, device=CUDA),
            new_token_mask=tree_mask)),
    ]
    # a first capture of another key: the one-time allocations (cuBLAS workspaces of
    # the warm-up and capture streams) before anything is measured
    graphs.run(cache, torch.ones(1, 1, dtype=torch.long, device=CUDA), start[:1])
    torch.cuda.synchronize()
    reserved0 = torch.cuda.memory_reserved()
    modelled = []
    for (bucket, t, w), forward in calls:
        key = mm.graph_key_bytes(arch, tp=1, dtype_bytes=4, bucket=bucket, tokens=t,
                                 width=w, capacity=cap)
        modelled.append(key)
        torch.cuda.synchronize()
        a0 = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        forward()
        torch.cuda.synchronize()
        held = torch.cuda.memory_allocated() - a0
        working = torch.cuda.max_memory_allocated() - a0 - held
        tensors = 5 if w else 3  # tokens, start, output (+ rope, mask); own_mask below
        static = key.inputs + key.output + (t * w if w else 0)
        assert abs(held - static) <= 0.1 * static + 512 * (tensors + 1), (bucket, t, w, held,
                                                                          static)
        assert 0.5 * key.working <= working <= 2.5 * key.working, (bucket, t, w, working,
                                                                   key.working)
    assert graphs.captured == 4
    pool, inputs = mm.graph_pool_bytes(modelled)
    grown = torch.cuda.memory_reserved() - reserved0
    assert grown <= 2 * (pool + inputs) + 4 * 2 ** 20 * len(calls), (grown, pool, inputs)
    graphs.release()
