"""RolloutEngine on tiny random models (single process): exactness against transformers
and against full-sequence forwards of the same megatron-core model, batch mechanics,
stopping, seeds and errors."""

from __future__ import annotations

import pytest
import torch

from megatron_tlt.models import load_model
from megatron_tlt.models.inference import forward_local_logits, token_logprobs
from megatron_tlt.rollout import PromptError, RolloutEngine, SamplingParams
from megatron_tlt.config import RolloutConfig
from tiny_models import TINY_CONFIGS, VOCAB, build_tiny_hf

PROMPT_LENGTHS = (3, 9, 1, 17, 5, 12, 7, 2)


def _prompts(lengths=PROMPT_LENGTHS, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in lengths]


@pytest.fixture(scope="module")
def tiny(tiny_hf_dirs, single_process_parallel):
    """name -> (megatron model, arch) for each tiny model, loaded once."""
    from megatron_tlt.runtime_env import apply_cpu_redirection

    apply_cpu_redirection()
    return {name: load_model(tiny_hf_dirs[name], device=torch.device("cpu"), dtype="float32")
            for name in TINY_CONFIGS}


def _engine(tiny, name="llama_tied", **cfg) -> RolloutEngine:
    model, arch = tiny[name]
    return RolloutEngine(model, None, RolloutConfig(**cfg), arch=arch, eos_token_ids=[])


def _hf_greedy(hf, prompt: list[int], n: int) -> list[int]:
    hf.generation_config.eos_token_id = None
    hf.generation_config.pad_token_id = 0
    out = hf.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False)
    return out[0, len(prompt):].tolist()


def _full_forward(model, arch, prompt: list[int], response: list[int]):
    """(log-probs of response tokens, final hidden states at the positions producing
    them) from one full-sequence forward of the megatron-core model."""
    ids = torch.tensor([prompt + response])
    seen = {}
    hook = model.decoder.final_layernorm.register_forward_hook(
        lambda mod, inp, out: seen.__setitem__("h", out))
    try:
        with torch.no_grad():
            local = forward_local_logits(model, ids)
            lp = token_logprobs(local, torch.roll(ids, -1, 1), arch)[0]
    finally:
        hook.remove()
    s = len(prompt)
    hidden = seen["h"][:, 0]  # [seq, batch=1, h] -> [seq, h]
    return lp[s - 1: -1], hidden[s - 1: -1]


# ----------------------------------------------------------------------------- exactness
@pytest.mark.parametrize("fused", [True, False], ids=["fused_cpu_kernels", "eager"])
@pytest.mark.parametrize("name", sorted(TINY_CONFIGS))
def test_greedy_batch_matches_transformers_and_full_forward(name, fused, tiny):
    """8 prompts of different lengths in one batch: tokens equal transformers generate
    (one prompt at a time), log-probs and hidden states equal a full forward's; with
    the fused CPU decode kernels and with eager ops."""
    model, arch = tiny[name]
    hf = build_tiny_hf(name)
    prompts = _prompts()
    # different max_new_tokens make rows finish at different steps and move
    params = [SamplingParams(temperature=0.0, max_new_tokens=6 + 2 * i,
                             return_hidden_states=True) for i in range(len(prompts))]
    engine = _engine(tiny, name, cpu_kernels=fused)
    assert (engine.runner.kernels is not None) == fused
    outs = engine.generate(prompts, params)
    for p, sp, o in zip(prompts, params, outs):
        assert o.token_ids == _hf_greedy(hf, p, sp.max_new_tokens)
        assert o.finish_reason == "length"
        lp, hidden = _full_forward(model, arch, p, o.token_ids)
        assert (torch.tensor(o.logprobs) - lp).abs().max().item() <= 1e-4
        assert o.hidden_states.shape == (len(o.token_ids), arch.hidden_size)
        assert o.hidden_states.device.type == "cpu"
        assert (o.hidden_states - hidden).abs().max().item() <= 1e-4


def test_sampled_logprobs_and_hidden_states_match_full_forward(tiny):
    """Sampling paths use the same cache: raw log-probs of sampled tokens equal a
    recompute, 'processed' log-probs equal the processed distribution's and 'tempered'
    ones log softmax(logits / T)'s."""
    from megatron_tlt.rollout.sampling import processed_logprobs

    model, arch = tiny["qwen2"]
    prompts = _prompts((4, 11, 6))
    raw = _engine(tiny, "qwen2").generate(prompts, SamplingParams(
        temperature=0.8, top_k=40, top_p=0.9, max_new_tokens=10, seed=3,
        return_hidden_states=True))
    proc = _engine(tiny, "qwen2").generate(prompts, SamplingParams(
        temperature=0.8, top_k=40, top_p=0.9, max_new_tokens=10, seed=3,
        logprobs="processed"))
    tempered = _engine(tiny, "qwen2").generate(prompts, SamplingParams(
        temperature=0.8, top_k=40, top_p=0.9, max_new_tokens=10, seed=3,
        logprobs="tempered"))
    for p, o, q, t in zip(prompts, raw, proc, tempered):
        assert o.token_ids == q.token_ids == t.token_ids  # same seed, same tokens
        lp, hidden = _full_forward(model, arch, p, o.token_ids)
        assert (torch.tensor(o.logprobs) - lp).abs().max().item() <= 1e-4
        assert (o.hidden_states - hidden).abs().max().item() <= 1e-4
        ids = torch.tensor([p + o.token_ids])
        with torch.no_grad():
            logits = forward_local_logits(model, ids)[0, len(p) - 1: -1, :arch.vocab_size]
        ref = processed_logprobs(logits, 0.8, 40, 0.9).gather(
            -1, torch.tensor(o.token_ids)[:, None])[:, 0]
        assert (torch.tensor(q.logprobs) - ref).abs().max().item() <= 1e-4
        ref = processed_logprobs(logits, 0.8).gather(  # logits / T, not truncated
            -1, torch.tensor(o.token_ids)[:, None])[:, 0]
        assert (torch.tensor(t.logprobs) - ref).abs().max().item() <= 1e-4
        assert all(x <= y + 1e-6 for x, y in zip(o.logprobs, q.logprobs))  # truncation


def test_engine_uses_the_model_parameters_in_place(tiny):
    """No weight copies: an in-place update of the model changes the next rollout."""
    model, arch = tiny["llama_untied"]
    eng = _engine(tiny, "llama_untied")
    ptrs = {p.data_ptr() for p in model.parameters()}
    layer = eng.runner.layers[0]
    assert {layer.qkv_w.data_ptr(), layer.fc1_w.data_ptr(), eng.runner.output_w.data_ptr(),
            eng.runner.embed_w.data_ptr()} <= ptrs
    prompts = _prompts((5, 8))
    sp = SamplingParams(temperature=0.0, max_new_tokens=6)
    before = [o.token_ids for o in eng.generate(prompts, sp)]
    w = model.output_layer.weight
    saved = w.detach().clone()
    with torch.no_grad():
        w.mul_(-1.0)  # flips every logit's sign: greedy now picks the least likely token
    try:
        after = [o.token_ids for o in eng.generate(prompts, sp)]
    finally:
        with torch.no_grad():
            w.copy_(saved)
    assert after != before


def test_panel_copies_are_remade_only_for_changed_weights(tiny):
    """pack_weights (run by every generate) re-copies a matrix into the kernels' panel
    layout only when its content changed, including through ``.data`` writes, which do
    not bump a tensor's version counter."""
    from megatron_tlt.rollout import cpu_kernels

    if cpu_kernels.get() is None:
        pytest.fail("the CPU kernels did not build")
    model, arch = tiny["llama_untied"]
    eng = _engine(tiny, "llama_untied")
    r = eng.runner
    prompts, sp = _prompts((5, 8)), SamplingParams(temperature=0.0, max_new_tokens=4)
    before = [o.token_ids for o in eng.generate(prompts, sp)]
    for _, buf, _ in r._panels.values():
        buf.fill_(float("nan"))  # poison: a skipped copy stays NaN
    r.pack_weights()
    assert all(torch.isnan(buf).all() for _, buf, _ in r._panels.values())
    w = r.layers[0].fc1_w
    saved = w.detach().clone()
    w.data[3, 2] += 1.0
    r.pack_weights()
    fresh = [i for i, (_, buf, _) in r._panels.items() if not torch.isnan(buf).any()]
    assert fresh == [id(w)]
    assert torch.equal(r._panels[id(w)][1], cpu_kernels.get().pack_weight(w.detach()))
    w.data.copy_(saved)
    for m in r.kernel_weights():  # unpoison: everything changed (NaN vs weights)
        r._panels[id(m)] = (m, r._panels[id(m)][1], None)
    assert [o.token_ids for o in eng.generate(prompts, sp)] == before


# ----------------------------------------------------------------------------- batching
def test_finished_sequences_leave_the_batch(tiny):
    eng = _engine(tiny)
    lengths = [2, 7, 4, 7, 1]
    prompts = _prompts((3, 6, 2, 9, 4))
    outs = eng.generate(prompts, [SamplingParams(temperature=0.0, max_new_tokens=n)
                                  for n in lengths])
    assert [len(o.token_ids) for o in outs] == lengths
    # the first token comes from prefill; decode step s runs the rows with > s+1 tokens
    expected = [sum(n > s + 1 for n in lengths) for s in range(max(lengths) - 1)]
    assert eng.last_stats.batch_sizes == expected
    assert eng.last_stats.generated_tokens == sum(lengths)


def test_queued_prompts_fill_freed_rows_and_results_do_not_change(tiny):
    """max_batch_size=2 with 6 prompts: rows are reused; outputs equal a full batch's."""
    prompts = _prompts((3, 6, 2, 9, 4, 5))
    params = [SamplingParams(temperature=0.0, max_new_tokens=n) for n in (3, 8, 2, 5, 6, 4)]
    full = _engine(tiny).generate(prompts, params)
    small = _engine(tiny, max_batch_size=2)
    queued = small.generate(prompts, params)
    assert [o.token_ids for o in queued] == [o.token_ids for o in full]
    assert [o.index for o in queued] == list(range(6))
    assert max(small.last_stats.batch_sizes) == 2
    assert small.memory.cache.max_batch == 2  # memory bounded by max_batch_size


def test_prefill_chunks_give_the_same_result(tiny):
    prompts = _prompts()
    sp = SamplingParams(temperature=0.0, max_new_tokens=5)
    whole = _engine(tiny).generate(prompts, sp)
    chunked = _engine(tiny, prefill_tokens=20).generate(prompts, sp)
    assert [o.token_ids for o in chunked] == [o.token_ids for o in whole]
    for a, b in zip(whole, chunked):
        assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) <= 1e-5


# ----------------------------------------------------------------------------- stopping
def test_stop_tokens_eos_and_ignore_eos(tiny):
    model, arch = tiny["llama_tied"]
    prompt = _prompts((6,))
    free = _engine(tiny).generate(prompt, SamplingParams(temperature=0.0, max_new_tokens=12))[0]
    stop = free.token_ids[4]
    cut = free.token_ids.index(stop) + 1
    out = _engine(tiny).generate(prompt, SamplingParams(
        temperature=0.0, max_new_tokens=12, stop_token_ids=[stop]))[0]
    assert out.token_ids == free.token_ids[:cut] and out.finish_reason == "stop"
    eos_engine = RolloutEngine(model, None, arch=arch, eos_token_ids=[stop])
    out = eos_engine.generate(prompt, SamplingParams(temperature=0.0, max_new_tokens=12))[0]
    assert out.token_ids == free.token_ids[:cut] and out.finish_reason == "stop"
    out = eos_engine.generate(prompt, SamplingParams(temperature=0.0, max_new_tokens=12,
                                                     ignore_eos=True))[0]
    assert out.token_ids == free.token_ids and out.finish_reason == "length"


def test_context_limit_ends_generation(tiny):
    eng = _engine(tiny, max_seq_len=10)
    outs = eng.generate(_prompts((4, 7)), SamplingParams(temperature=0.0, max_new_tokens=50))
    assert [len(o.token_ids) for o in outs] == [6, 3]  # prompt + response == 10
    assert all(o.finish_reason == "length" for o in outs)


def test_bad_prompts_are_rejected_clearly(tiny):
    eng = _engine(tiny, max_seq_len=16)
    with pytest.raises(PromptError, match=r"prompt 1 has 16 tokens but the context is 16"):
        eng.generate([[1, 2], list(range(16))], SamplingParams(max_new_tokens=2))
    with pytest.raises(PromptError, match="prompt 0 is empty"):
        eng.generate([[]], SamplingParams())
    with pytest.raises(PromptError, match=f"token id {VOCAB} outside"):
        eng.generate([[1, VOCAB]], SamplingParams())
    with pytest.raises(ValueError, match="2 SamplingParams for 1 prompts"):
        eng.generate([[1]], [SamplingParams(), SamplingParams()])


# ----------------------------------------------------------------------------- seeds
def test_sampling_is_reproducible_with_a_seed(tiny):
    prompts = _prompts((5, 9, 3))
    sp = SamplingParams(temperature=1.0, top_p=0.95, max_new_tokens=16, seed=11)
    a = _engine(tiny).generate(prompts, sp)
    b = _engine(tiny).generate(prompts, sp)
    assert [o.token_ids for o in a] == [o.token_ids for o in b]
    c = _engine(tiny).generate(prompts, SamplingParams(temperature=1.0, top_p=0.95,
                                                       max_new_tokens=16, seed=12))
    assert [o.token_ids for o in c] != [o.token_ids for o in a]
    # a request's stream depends on (seed, its index), not on the rest of the batch
    alone = _engine(tiny).generate(prompts[:1], sp)
    assert alone[0].token_ids == a[0].token_ids
    unseeded = [_engine(tiny).generate(prompts, SamplingParams(temperature=1.0,
                                                                max_new_tokens=16))
                for _ in range(2)]
    assert [o.token_ids for o in unseeded[0]] != [o.token_ids for o in unseeded[1]]


# ----------------------------------------------------------------------------- options
def test_gpu_only_options_fail_clearly_on_cpu(tiny):
    with pytest.raises(ValueError, match="cuda_graphs=true needs CUDA"):
        _engine(tiny, cuda_graphs=True)
    with pytest.raises(ValueError, match="attention=flash needs CUDA"):
        _engine(tiny, attention="flash")
    assert _engine(tiny, attention="auto").attention == "sdpa"


def test_graph_buckets_and_cache_size():
    from megatron_tlt.rollout.cuda_graphs import bucket_for
    from megatron_tlt.rollout.kv_cache import KVCache

    assert [bucket_for(b, 64) for b in (1, 2, 3, 5, 8, 9, 33, 64)] == [1, 2, 4, 8, 8, 16, 64, 64]
    assert bucket_for(40, 48) == 48
    args = dict(num_layers=3, max_batch=4, kv_heads=2, capacity=10, head_dim=8)
    cache = KVCache(**args, dtype=torch.float32, device=torch.device("cpu"))
    assert cache.nbytes == KVCache.bytes_needed(**args, dtype=torch.float32) == 2 * 3 * 4 * 2 * 10 * 8 * 4


def test_kv_cache_layouts_store_the_same_values():
    from megatron_tlt.rollout.kv_cache import KVCache

    caches = [KVCache(num_layers=2, max_batch=3, kv_heads=2, capacity=6, head_dim=4,
                      dtype=torch.float32, device=torch.device("cpu"), layout=lay)
              for lay in ("bgsd", "bsgd")]
    k, v = torch.randn(2, 3, 2, 4), torch.randn(2, 3, 2, 4)
    pos = torch.tensor([[0, 1, 2], [3, 4, 5]])
    views = [c.write(1, slice(1, 3), pos, k, v, span=6) for c in caches]
    assert torch.equal(views[0][0], views[1][0]) and torch.equal(views[0][1], views[1][1])
    assert torch.equal(views[0][0][1, :, 3:6], k[1].transpose(0, 1))
    for c in caches:
        c.move_row(2, 0, 6)
    assert torch.equal(caches[0].k[1, 0], caches[0].k[1, 2])
    assert torch.equal(caches[1].k[1, 0], caches[1].k[1, 2])


def test_synthetic_long_tail_drives_a_shrinking_batch(tiny):
    """The benchmarks' synthetic workload: exact lengths, and a batch that spends
    most of its steps in the tail at small sizes."""
    from megatron_tlt.bench.workload import length_stats, synthetic_workload

    reqs = synthetic_workload(24, vocab_size=VOCAB, median_len=6, sigma=1.0, max_len=48,
                              seed=2)
    eng = _engine(tiny)
    outs = eng.generate([r.token_ids for r in reqs],
                        [SamplingParams(temperature=1.0, max_new_tokens=r.target_len,
                                        ignore_eos=True, seed=0) for r in reqs])
    assert [len(o.token_ids) for o in outs] == [r.target_len for r in reqs]
    sizes = eng.last_stats.batch_sizes
    assert sizes == sorted(sizes, reverse=True) and sizes[0] <= 24
    stats = length_stats([r.target_len for r in reqs])
    assert stats["max_over_median"] > 2
    # the long tail: over half the decode steps run at most a quarter of the batch
    assert sum(s <= 6 for s in sizes) > len(sizes) / 2


def test_fused_and_eager_decode_steps_agree(tiny):
    """The fused kernels (the one-call decoder stack, and the per-layer path used with
    layer capture and tensor parallelism) and the eager path write the same KV cache
    and return the same hidden states for one decode step at mixed positions."""
    from megatron_tlt.rollout.kv_cache import KVCache

    model, arch = tiny["qwen2"]
    fused = _engine(tiny, "qwen2").runner
    eager = _engine(tiny, "qwen2", cpu_kernels=False).runner
    assert fused.kernels is not None and eager.kernels is None
    caches = [KVCache(num_layers=arch.num_layers, max_batch=3, kv_heads=fused.groups,
                      capacity=20, head_dim=arch.kv_channels, dtype=torch.float32,
                      device=torch.device("cpu")) for _ in range(3)]
    prompt = torch.tensor(_prompts((12, 12, 12))).long()
    captured = {"per_layer": {}, "eager": {}}
    with torch.no_grad():
        for runner, cache in zip((fused, fused, eager), caches):
            runner.extend(cache, slice(0, 3), prompt, torch.zeros(3, dtype=torch.long))
        start = torch.tensor([4, 11, 7])  # rows continue from different lengths
        tok = torch.tensor([[5], [17], [250]])
        h_f = fused.extend(caches[0], slice(0, 3), tok, start)
        h_l = fused.extend(caches[1], slice(0, 3), tok, start,
                           capture=lambda i, x: captured["per_layer"].__setitem__(i, x.clone()))
        h_e = eager.extend(caches[2], slice(0, 3), tok, start,
                           capture=lambda i, x: captured["eager"].__setitem__(i, x.clone()))
    # The paths sum in different orders: float32 rounding of ~1e-5 on residual-stream
    # values of magnitude ~5 (each path is that close to a float64 computation).
    tol = 3e-5
    assert (h_f - h_e).abs().max().item() <= tol
    assert (h_l - h_e).abs().max().item() <= tol
    assert sorted(captured["per_layer"]) == list(range(arch.num_layers))
    for i, x in captured["eager"].items():
        assert (captured["per_layer"][i] - x).abs().max().item() <= tol
    for cache in caches[:2]:
        for b, p in enumerate(start.tolist()):
            assert torch.allclose(cache.k[:, b, :, : p + 1], caches[2].k[:, b, :, : p + 1],
                                  atol=1e-5)
            assert torch.allclose(cache.v[:, b, :, : p + 1], caches[2].v[:, b, :, : p + 1],
                                  atol=1e-5)


def test_cpu_kernels_fall_back_to_eager_when_they_cannot_build(tiny, monkeypatch, caplog):
    import torch.utils.cpp_extension as ext

    from megatron_tlt.rollout import cpu_kernels

    built = cpu_kernels.get()
    assert built is not None  # the test machine has a compiler: the real path is tested
    monkeypatch.setattr(cpu_kernels, "_builds", {})  # nothing built yet in this process

    def no_compiler(*args, **kwargs):
        raise RuntimeError("no C++ compiler")

    monkeypatch.setattr(ext, "load_inline", no_compiler)
    with caplog.at_level("WARNING"):
        engine = _engine(tiny)
    assert engine.runner.kernels is None
    assert "fused CPU decode kernels unavailable" in caplog.text
    out = engine.generate(_prompts((5,)), SamplingParams(temperature=0.0, max_new_tokens=4))
    assert len(out[0].token_ids) == 4
    monkeypatch.setattr(cpu_kernels, "_builds", {})
    monkeypatch.setenv("MEGATRON_TLT_NO_CPU_KERNELS", "1")
    assert cpu_kernels.get() is None
