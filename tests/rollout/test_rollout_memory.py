"""The rollout's memory lifecycle (``rollout.memory``) on a tiny model, one process:

- sized once: with a configured size the KV cache is allocated at the first call and
  the same tensors serve later calls of other prompt lengths (no re-growth); requests
  beyond the size are refused;
- released: after ``release_memory`` the engine holds no KV cache, drafter cache or
  feature store, measured by walking every tensor the engine reaches (the weights
  aside): what is left is exactly what the next rollout keeps (the rotary tables);
  the next rollout's outputs equal an engine's that never released;
- one copy of the hidden states: with a drafter the returned hidden states come from
  its feature store (no per-call buffer) and equal plain decoding's;
- no per-step host copy: hidden states reach the host once per finished response,
  never inside a decode step (counted with a TorchFunctionMode);
- the gathered mode's exchange sends tensors, not pickles, and round-trips exactly.
"""

from __future__ import annotations

import types
from collections import deque

import pytest
import torch
from torch.overrides import TorchFunctionMode

from megatron_tlt.config import RolloutConfig, SpeculativeConfig
from megatron_tlt.models import load_model
from megatron_tlt.models.drafter import DrafterConfig, EagleDrafter
from megatron_tlt.rollout import PromptError, RolloutEngine, SamplingParams
from tiny_models import VOCAB

LENGTHS = (3, 9, 1, 12, 5, 7)


def _prompts(lengths=LENGTHS, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in lengths]


@pytest.fixture(scope="module")
def tiny(tiny_hf_dirs, single_process_parallel):
    from megatron_tlt.runtime_env import apply_cpu_redirection

    apply_cpu_redirection()
    return load_model(tiny_hf_dirs["llama_tied"], device=torch.device("cpu"),
                      dtype="float32")


def _drafter(arch):
    d = EagleDrafter(DrafterConfig.for_target(arch), arch, dtype=torch.float32, device="cpu")
    d.reset_parameters(seed=1)
    return d


def _engine(tiny, *, spec: bool = False, sized: bool = True, **cfg) -> RolloutEngine:
    model, arch = tiny
    if spec:  # speculative below 3 running rows, plain above: both kinds of step
        cfg["speculative"] = SpeculativeConfig(policy="fixed", strategy="3_1_3", threshold=2)
    size = dict(max_prompt_tokens=16, max_new_tokens=10, max_rows=4) if sized else {}
    return RolloutEngine(model, None, RolloutConfig(**cfg), arch=arch, eos_token_ids=[],
                         drafter=_drafter(arch) if spec else None, **size)


SP = SamplingParams(temperature=0.0, max_new_tokens=10, return_hidden_states=True)
SAMPLED = SamplingParams(temperature=1.0, top_p=0.9, max_new_tokens=10, seed=3,
                         return_hidden_states=True)


def held_tensors(engine: RolloutEngine) -> dict[str, int]:
    """Every tensor storage the engine reaches through its attributes, containers and
    helpers, the weights aside (modules, and tensors sharing a parameter's storage):
    first path -> bytes."""
    weights = {p.untyped_storage().data_ptr() for m in (engine.runner.model,
               engine.spec.drafter.model if engine.spec else None) if m is not None
               for p in m.parameters()}
    seen_obj, seen_storage, out = set(), set(), {}

    def visit(obj, path: str, depth: int) -> None:
        if id(obj) in seen_obj or depth > 10:
            return
        seen_obj.add(id(obj))
        if isinstance(obj, torch.Tensor):
            st = obj.untyped_storage()
            ptr = st.data_ptr()
            if st.nbytes() and ptr not in weights and ptr not in seen_storage:
                seen_storage.add(ptr)
                out[path] = st.nbytes()
            return
        if isinstance(obj, (torch.nn.Module, type, types.FunctionType, types.MethodType,
                            types.BuiltinFunctionType, types.ModuleType)):
            return
        if isinstance(obj, dict):
            for k, v in obj.items():
                visit(v, f"{path}[{k!r}]", depth + 1)
        elif isinstance(obj, (list, tuple, set, deque)):
            for i, v in enumerate(obj):
                visit(v, f"{path}[{i}]", depth + 1)
        elif hasattr(obj, "__dict__"):
            for k, v in vars(obj).items():
                visit(v, f"{path}.{k}", depth + 1)

    visit(engine, "engine", 0)
    return out


def _same_outputs(a, b) -> None:
    for x, y in zip(a, b, strict=True):
        assert x.token_ids == y.token_ids and x.logprobs == y.logprobs
        assert x.finish_reason == y.finish_reason
        assert torch.equal(x.hidden_states, y.hidden_states)


# ----------------------------------------------------------------------------- sizing
def test_the_cache_is_allocated_once_at_the_configured_size(tiny):
    eng = _engine(tiny)
    eng.generate(_prompts((2, 3)), SamplingParams(temperature=0.0, max_new_tokens=3))
    cache = eng.memory.cache
    ptr = cache.k.data_ptr()
    assert (cache.max_batch, cache.capacity) == (4, 16 + 10)  # max_rows, P + N
    # longer prompts and responses, more prompts than rows: the same tensors
    eng.generate(_prompts((16, 9, 1, 12, 5, 7)), SP)
    eng.generate(_prompts((5,)), SamplingParams(temperature=0.0, max_new_tokens=10))
    assert eng.memory.cache is cache and cache.k.data_ptr() == ptr
    assert eng.memory.allocations == 1 and cache.generation == 1
    assert max(eng.last_stats.batch_sizes or [1]) <= 4
    with pytest.raises(PromptError, match="at most 16 tokens .*data.max_prompt_tokens"):
        eng.generate(_prompts((17,)), SP)
    with pytest.raises(PromptError, match="sized for 10 .*grpo.max_new_tokens"):
        eng.generate(_prompts((3,)), SamplingParams(temperature=0.0, max_new_tokens=11))
    # without a configured size the cache follows the calls (tools, tests)
    free = _engine(tiny, sized=False)
    free.generate(_prompts((2,)), SamplingParams(temperature=0.0, max_new_tokens=3))
    assert free.memory.cache.capacity == 5


def test_a_speculative_engine_keeps_its_drafter_memory_across_calls(tiny):
    eng = _engine(tiny, spec=True)
    eng.generate(_prompts((2, 3)), SP)
    spec = eng.spec
    ptrs = (eng.memory.cache.k.data_ptr(), spec.cache.k.data_ptr(), spec.features.data_ptr())
    eng.generate(_prompts((16, 4, 9)), SP)
    assert (eng.memory.cache.k.data_ptr(), spec.cache.k.data_ptr(),
            spec.features.data_ptr()) == ptrs
    assert spec.features.shape[:2] == (4, eng.memory.cache.capacity)  # P + N + slack


# ----------------------------------------------------------------------------- release
@pytest.mark.parametrize("spec", [False, True], ids=["plain", "speculative"])
def test_after_release_the_engine_holds_only_what_the_next_rollout_keeps(tiny, spec):
    prompts = _prompts()
    eng, never = _engine(tiny, spec=spec), _engine(tiny, spec=spec)
    for params in (SP, SAMPLED):
        first = eng.generate(prompts, params)
        _same_outputs(first, never.generate(prompts, params))
        during = held_tensors(eng)
        parts = eng.memory.resident_bytes()
        assert parts["kv_cache"] > 0 and (parts["features"] > 0) == spec
        eng.release_memory()
        after = held_tensors(eng)
        assert eng.memory.resident_bytes() == dict.fromkeys(parts, 0)
        # what stays: the rotary tables and RoPE's sign vector of the target's runner
        # (and the drafter's), sized by the positions alone, and the fused CPU
        # kernels' panel copies of the weights (CPU float32 only; re-packed in place)
        kept = {p for p in after if p.rsplit(".", 1)[-1] in ("_cos", "_sin", "_sin_sign")
                or "._panels[" in p}
        assert set(after) == kept, sorted(set(after) - kept)
        rollout = sum(during.values()) - sum(after.values())
        # released: exactly the caches and the feature store, nothing else was held
        assert rollout == parts["kv_cache"] + parts["draft_kv_cache"] + parts["features"]
        print(f"\nrollout memory ({'spec' if spec else 'plain'}): {parts}; held beyond the "
              f"weights {sum(during.values())} B during the rollout, "
              f"{sum(after.values())} B after release")
        # the next rollout makes it again and decodes exactly as if never released
        _same_outputs(eng.generate(prompts, params), never.generate(prompts, params))
    assert eng.memory.allocations == 3 and never.memory.allocations == 1


# ----------------------------------------------------------------------------- one copy
def test_with_a_drafter_the_hidden_states_come_from_its_feature_store(tiny, monkeypatch):
    model, arch = tiny
    buffers = []
    eng = _engine(tiny, spec=True)
    real = eng.memory.hidden_buffer
    monkeypatch.setattr(eng.memory, "hidden_buffer",
                        lambda *a: buffers.append(real(*a)) or buffers[-1])
    outs = eng.generate(_prompts(), SP)
    assert buffers and all(b is None for b in buffers)  # no second copy
    plain = _engine(tiny).generate(_prompts(), SP)
    for o, p in zip(outs, plain):
        assert o.token_ids == p.token_ids
        assert o.hidden_states.shape == (len(o.token_ids), arch.hidden_size)
        assert (o.hidden_states - p.hidden_states).abs().max() < 1e-4
    assert eng.last_stats.spec.steps > 0 and eng.last_stats.decode_steps > \
        eng.last_stats.spec.steps  # both kinds of step wrote the store


# ----------------------------------------------------------------------------- host copies
class _HostCopies(TorchFunctionMode):
    """Counts copies of [.., hidden] tensors to the host (``.cpu()``, ``.to(cpu)``,
    ``.tolist()``, ``.numpy()``) by phase."""

    def __init__(self, hidden: int):
        super().__init__()
        self.hidden, self.phase, self.counts = hidden, "other", {}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        t = args[0] if args else None
        if isinstance(t, torch.Tensor) and t.dim() and t.shape[-1] == self.hidden:
            to_host = func in (torch.Tensor.cpu, torch.Tensor.tolist, torch.Tensor.numpy)
            if func is torch.Tensor.to:
                dev = kwargs.get("device", args[1] if len(args) > 1 else None)
                to_host = str(dev).startswith("cpu")
            if to_host:
                self.counts[self.phase] = self.counts.get(self.phase, 0) + 1
        return func(*args, **kwargs)


@pytest.mark.parametrize("spec", [False, True], ids=["plain", "speculative"])
def test_hidden_states_reach_the_host_once_per_finished_response(tiny, spec, monkeypatch):
    model, arch = tiny
    eng = _engine(tiny, spec=spec)
    mode = _HostCopies(arch.hidden_size)

    def phase(name, fn):
        def wrapped(*a, **k):
            prev, mode.phase = mode.phase, name
            try:
                return fn(*a, **k)
            finally:
                mode.phase = prev
        return wrapped

    from megatron_tlt.rollout import scheduler

    monkeypatch.setattr(scheduler, "retire", phase("retire", scheduler.retire))
    monkeypatch.setattr(eng, "_plain_step", phase("step", eng._plain_step))
    monkeypatch.setattr(eng, "_commit", phase("step", eng._commit))
    if spec:
        monkeypatch.setattr(eng.spec, "step", phase("step", eng.spec.step))
    lengths = [2, 10, 4, 7, 1, 9]
    with mode:
        outs = eng.generate(_prompts(), [SamplingParams(temperature=0.0, max_new_tokens=n,
                                                        return_hidden_states=True)
                                         for n in lengths])
    assert [len(o.token_ids) for o in outs] == lengths
    assert eng.last_stats.decode_steps >= 8
    assert mode.counts.get("step", 0) == 0  # none inside a decode step
    assert mode.counts.get("retire", 0) == len(lengths)  # one per finished response
    assert mode.counts.get("other", 0) == 0


# ----------------------------------------------------------------------------- gathered
def test_the_gathered_exchange_sends_tensors_and_round_trips(tiny, monkeypatch):
    """``exchange_outputs`` over a one-rank group: metadata objects hold no tensor (the
    collectives module refuses them), the tensors go by broadcast, and the outputs
    come back exactly, in prompt order, with host hidden states of their own."""
    from megatron_tlt import collectives
    from megatron_tlt.rollout.gathered import exchange_outputs

    model, arch = tiny
    eng = _engine(tiny)
    prompts = _prompts((3, 5, 2))
    outs = eng.generate(prompts, [SP, SamplingParams(temperature=0.0, max_new_tokens=4), SP])
    local = [o for o in outs]
    for o in local:  # as the local _run leaves them: hidden states on the device
        if o.hidden_states is not None:
            o.hidden_states = o.hidden_states.to(eng.device)
    sent = []
    real = collectives.broadcast
    monkeypatch.setattr(collectives, "broadcast",
                        lambda t, *a, **k: sent.append((t.dtype, tuple(t.shape))) or
                        real(t, *a, **k))
    got, stats = exchange_outputs(None, 0, prompts, [0, 1, 2], local, eng.last_stats,
                                  (arch.hidden_size, eng.hidden_dtype))
    total = sum(len(o.token_ids) for o in outs)
    rows = total - len(outs[1].token_ids)
    assert sent == [(torch.float64, (2, total)), (eng.hidden_dtype, (rows, arch.hidden_size))]
    assert stats == [eng.last_stats]
    for g, o in zip(got, outs):
        assert (g.token_ids, g.logprobs, g.finish_reason) == (o.token_ids, o.logprobs,
                                                              o.finish_reason)
        assert (g.hidden_states is None) == (o.hidden_states is None)
        if g.hidden_states is not None:
            assert torch.equal(g.hidden_states, o.hidden_states)
            assert g.hidden_states.untyped_storage().nbytes() == \
                g.hidden_states.numel() * g.hidden_states.element_size()
    with pytest.raises(TypeError, match="holds a tensor"):
        collectives.all_gather_object({"h": outs[0].hidden_states})


# ----------------------------------------------------------------------------- graphs
def test_cuda_graphs_follow_the_cache_lifecycle(tiny, monkeypatch):
    """The graphs hold the cache's addresses: the same allocation replays them, a
    re-made one (after a release) re-captures, and the engine's release drops them.
    (The capture itself is stubbed on CPU; tests_gpu replays real graphs.)"""
    from megatron_tlt.rollout.cuda_graphs import GraphedDecoder, _Step
    from megatron_tlt.rollout.kv_cache import KVCache

    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: object())
    runner = types.SimpleNamespace(device=torch.device("cuda"), rope_tables=lambda n: None)
    graphs = GraphedDecoder(runner)
    captured = []

    def capture(key, embeds_like=None):
        bucket, t = key[:2]
        captured.append(bucket)
        return _Step(torch.zeros(bucket, t, dtype=torch.long),
                     torch.zeros(bucket, dtype=torch.long), None, None, fn=lambda: None,
                     graph=types.SimpleNamespace(replay=lambda: None),
                     out=torch.zeros(bucket, t, 4))

    monkeypatch.setattr(graphs, "_capture", capture)
    cache = KVCache(num_layers=1, max_batch=4, kv_heads=1, capacity=8, head_dim=4,
                    dtype=torch.float32, device=torch.device("cpu"))
    step = (torch.zeros(3, 1, dtype=torch.long), torch.zeros(3, dtype=torch.long))
    graphs.run(cache, *step)
    graphs.run(cache, *step)
    assert captured == [4] and graphs.captured == 1  # replayed
    cache.release()
    cache.allocate()  # new addresses
    graphs.run(cache, *step)
    assert captured == [4, 4]
    eng = _engine(tiny)
    eng._graphs = graphs
    eng.release_memory()
    assert graphs.captured == 0 and graphs.cache is None and graphs.pool is None


def test_copy_positions_between_cache_layouts():
    """``KVCache.copy_positions`` copies a row's span between caches of either layout
    (the self-drafter's cache takes the target's keys and values this way)."""
    from megatron_tlt.rollout.kv_cache import KVCache

    shape = dict(num_layers=2, max_batch=3, kv_heads=2, capacity=8, head_dim=4,
                 dtype=torch.float32, device=torch.device("cpu"))
    for src_layout in ("bgsd", "bsgd"):
        for dst_layout in ("bgsd", "bsgd"):
            src, dst = KVCache(layout=src_layout, **shape), KVCache(layout=dst_layout, **shape)
            src.k.normal_(), src.v.normal_()
            dst.copy_positions(src, 1, 2, 5)
            for which in ("k", "v"):
                assert torch.equal(dst.span(which, 1, 2, 5), src.span(which, 1, 2, 5))
                assert dst.span(which, 1, 0, 2).abs().sum() == 0  # outside the span
                assert dst.span(which, 0, 0, 8).abs().sum() == 0  # other rows


# ------------------------------------------------------------------ zeroed as reached
def test_a_cache_zeroes_only_the_positions_a_call_reaches():
    """``allocate(upto)`` zeroes positions 0..upto-1 of every row and leaves the rest
    unwritten (on the CPU its pages are never mapped); a later call reaching further
    zeroes the difference first, whatever the positions held; ``release`` starts over."""
    from megatron_tlt.rollout.kv_cache import KVCache, reuse_or_make

    for layout in ("bgsd", "bsgd"):
        c = KVCache(num_layers=2, max_batch=3, kv_heads=2, capacity=20, head_dim=4,
                    dtype=torch.float32, device=torch.device("cpu"), layout=layout, upto=6)
        pos = (lambda t, lo, hi: t[:, :, :, lo:hi]) if layout == "bgsd" else \
            (lambda t, lo, hi: t[:, :, lo:hi])
        assert c.zeroed == 6 and (pos(c.k, 0, 6) == 0).all() and (pos(c.v, 0, 6) == 0).all()
        for t in (c.k, c.v):
            pos(t, 6, 20).fill_(float("nan"))  # what unwritten memory may hold
        assert reuse_or_make(c, max_batch=3, capacity=20, upto=11) is c
        assert c.zeroed == 11 and (pos(c.k, 0, 11) == 0).all() and (pos(c.v, 0, 11) == 0).all()
        assert pos(c.k, 11, 20).isnan().all()  # beyond the reach: untouched
        c.allocate(4)  # a shorter call: nothing to do
        assert c.zeroed == 11
        c.release()
        assert c.zeroed == 0 and not c.allocated
        c.allocate()  # no reach given: all of it, as before
        assert c.zeroed == 20 and (c.k == 0).all() and (c.v == 0).all()


@pytest.mark.parametrize("spec", [False, True], ids=["plain", "speculative"])
def test_nothing_reads_past_the_zeroed_positions(tiny, spec):
    """A sized engine on the CPU zeroes only what its calls reach. Poison everything
    beyond (NaN) in the target's cache and the drafter's: the next calls, which reach no
    further, decode exactly as before, so no step reads a position it did not reach."""
    prompts = _prompts()
    eng = _engine(tiny, spec=spec)
    for params in (SP, SAMPLED):
        first = eng.generate(prompts, params)
        caches = [eng.memory.cache] + ([eng.spec.cache] if spec else [])
        for c in caches:
            assert 0 < c.zeroed < c.capacity  # the call reaches 12 + 10 (+ slack) of 26
            for t in (c.k, c.v):
                t[:, :, :, c.zeroed:].fill_(float("nan"))
        again = eng.generate(prompts, params)
        _same_outputs(first, again)
        assert all(torch.isfinite(torch.tensor(o.logprobs)).all() for o in again)
