"""RolloutEngine: batched KV-cache generation on the megatron-core model being trained.

    engine = RolloutEngine.from_pretrained("smollm2")            # or any HF folder
    outs = engine.generate([[1, 2, 3], [4, 5]],
                           SamplingParams(temperature=0.7, top_p=0.9, max_new_tokens=64,
                                          seed=0))
    outs[0].token_ids, outs[0].logprobs, outs[0].finish_reason

Or, inside a trainer, ``RolloutEngine(model, tokenizer, RolloutConfig(...),
max_prompt_tokens=P, max_new_tokens=N)`` on the model instance the trainer updates
(parameters are read in place; the fused CPU kernels re-copy them into their panel
layout at the start of every ``generate``). With P and N the KV cache is sized once for
them (``rollout.memory``); ``release_memory()`` frees it between rollouts.

How a call runs: prompts queue; up to ``max_batch_size`` enter the running batch,
are prefilled (in chunks of ``prefill_tokens``; a prompt several requests share once,
``rollout.share_prefill``, ``prefill.py``) and then decode one token per step.
A sequence leaves the running batch the step it finishes (EOS, a stop token,
``max_new_tokens``, or the context limit) and the next queued prompt takes its row, so
per-step compute follows the running batch down into the long tail.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Callable, Optional, Sequence, Union

import torch

from ..config import RolloutConfig
from ..models.gpt import DTYPES, ModelArch
from .kv_cache import KVCache
from .memory import PromptError, RolloutMemory
from .outputs import GenerateStats, RolloutOutput
from . import flash, scheduler
from .prefill import SharedPrompts, prefill, recompute
from .scheduler import Row
from .runners import make_runner
from .experts import routes_to_host
from .sampling import SamplingParams, choose_tokens, own_seed, requested_logprobs
from .speculative import drafters
from .speculative.controller import SpeculationController


class GenerationInterrupted(Exception):
    """``generate`` stopped early because ``RolloutEngine.interrupt`` said so; the
    partial outputs are dropped."""


ParamsArg = Union[SamplingParams, Sequence[SamplingParams]]


class RolloutEngine:
    def __init__(self, model, tokenizer=None, config: Optional[RolloutConfig] = None, *,
                 arch: Optional[ModelArch] = None, eos_token_ids: Optional[Sequence[int]] = None,
                 drafter=None, max_prompt_tokens: Optional[int] = None,
                 max_new_tokens: Optional[int] = None, max_rows: Optional[int] = None):
        """``max_prompt_tokens``, ``max_new_tokens``, ``max_rows``: the size the
        caches are allocated at once (``rollout.memory``; without the first two they
        follow the calls)."""
        self.config = config or RolloutConfig()
        if arch is None:
            raise ValueError("RolloutEngine needs the model's ModelArch (arch=...)")
        self.arch = arch
        self.tokenizer = tokenizer
        # at PP > 1: this stage's share, or a gathered copy (rollout.pipeline_mode);
        # the loop below drives any of them through the ModelRunner interface
        self.runner = make_runner(model, arch, self.config.pipeline_mode)
        self.device = self.runner.device
        if eos_token_ids is None:
            eos_token_ids = _eos_ids(tokenizer)
        self.eos_token_ids = tuple(int(t) for t in eos_token_ids)
        self.context = self.config.max_seq_len or arch.max_position_embeddings
        self.context = min(self.context, arch.max_position_embeddings)
        self.attention = flash.resolve_attention(self.config, self.device, self.runner.dtype)
        self.runner.attention = self.attention
        if (self.config.cpu_kernels != "false" and self.device.type == "cpu"
                and self.runner.dtype == torch.float32 and self.attention == "sdpa"):
            from . import cpu_kernels, kernel_policy

            # auto: only where this machine's calibration measured them faster
            self.runner.kernels = kernel_policy.resolve(self.config.cpu_kernels,
                                                        cpu_kernels.get())
        self.coupled = self.config.sampling_mode == "coupled"
        hd = self.config.hidden_states_dtype
        self.hidden_dtype = self.runner.dtype if hd == "auto" else DTYPES[hd]
        self.last_stats = GenerateStats()
        self._graphs = None
        from .cuda_graphs import resolve

        # rollout.cuda_graphs: auto = with CUDA wherever the runner can be captured (not
        # the pipelined PP mode, which true refuses with a clear error)
        if resolve(self.config.cuda_graphs, self.device, self.runner.supports_graphs):
            self.enable_graphs()
        self.memory = RolloutMemory(self, max_prompt_tokens=max_prompt_tokens,
                                    max_new_tokens=max_new_tokens, max_rows=max_rows)
        self.spec = None  # SpeculativeDecoder when a drafter is attached
        self.tuner = None
        # polled before every decode step: when it returns True, ``generate`` raises
        # ``GenerationInterrupted`` (the RL trainer's stop request; rank-local, no
        # collective: the caller sets it only where the replica decodes alone, TP=PP=1)
        self.interrupt: Optional[Callable[[], bool]] = None
        self.drafters: dict = {}  # kind name -> the attached ``Drafter``s
        # rollout.speculative.drafter and the kinds that join it, or ``drafter`` (a
        # ``Drafter`` or a one-layer drafter module) in its place
        wanted = drafters.configured(self.config.speculative, arch=self.arch,
                                     dtype=self.runner.dtype, device=self.device,
                                     given=drafter)
        if wanted:
            self.attach_drafters(wanted)

    # ------------------------------------------------------------------ speculation
    def attach_drafter(self, drafter, tuner=None) -> None:
        """Speculate with ``drafter`` (a ``Drafter``, or a one-layer drafter module)
        while the running batch is at most ``config.speculative.threshold``; ``tuner``
        (a ``StrategyTuner``) defaults to one built from the kind's tuner settings."""
        from .speculative.tuner import StrategyTuner

        drafter = drafters.as_drafter(drafter)
        drafter.check_target(self.arch)
        if drafter.feature_layers and self._graphs is not None:
            if self.config.cuda_graphs != "auto":
                raise ValueError("EAGLE-3 feature layers need per-layer capture, which "
                                 "CUDA graphs do not support; use rollout.cuda_graphs="
                                 "auto or false")
            self._graphs = None  # auto: eager decoding for this drafter
        self.spec = drafter.make_decoder(self.runner)
        self.spec.min_draft_prob = self.config.speculative.min_draft_prob
        self.tuner = (tuner if tuner is not None else StrategyTuner.from_config(
            drafter.tuner_config(self.config.speculative)))
        self.drafters = {drafter.name: drafter}

    def attach_drafters(self, kinds: dict, tuners: Optional[dict] = None, *,
                        epsilon: float = 0.1) -> None:
        """Speculate with every drafter of ``kinds`` (kind name -> ``Drafter`` or
        one-layer drafter module): one attaches as ``attach_drafter``; with several the
        kind is chosen per batch-size bucket (``speculative.multi``), ``tuners`` a
        ``StrategyTuner`` per kind."""
        kinds = {name: drafters.as_drafter(d) for name, d in kinds.items()}
        if len(kinds) == 1:
            (d,) = kinds.values()
            self.attach_drafter(d, None if tuners is None else next(iter(tuners.values())))
            return
        from .speculative.multi import several_kinds

        for d in kinds.values():
            if d.feature_layers:
                raise ValueError(f"drafter kind {d.name!r} reads EAGLE-3 feature layers, "
                                 "which several drafter kinds do not support")
        self.spec, self.tuner = several_kinds(self, kinds, tuners, epsilon=epsilon)
        self.drafters = dict(kinds)

    @property
    def graphs(self):
        """The target's fixed-shape decoder (``cuda_graphs.GraphedDecoder``: its
        captured keys, ``captured``, ``release``), or None when it decodes eagerly."""
        return self._graphs

    def enable_graphs(self, capture: bool = True) -> None:
        """Run the target's decode and verification forwards through fixed-shape
        static buffers (``cuda_graphs.GraphedDecoder``), captured in CUDA graphs, or
        with ``capture=False`` the same code eagerly (any device: the CPU tests)."""
        from .cuda_graphs import GraphedDecoder

        if self._graphs is not None:
            self._graphs.release()
        # auto: each key keeps its graph only where it measured faster than eager
        self._graphs = GraphedDecoder(self.runner, capture=capture,
                                      measure=self.config.cuda_graphs == "auto")

    def detach_drafter(self) -> None:
        self.spec = None
        self.tuner = None
        self.drafters = {}

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_pretrained(cls, source: str | Path, config: Optional[RolloutConfig] = None, *,
                        dtype: str = "auto", device: str = "auto",
                        transformer_impl: str = "auto") -> "RolloutEngine":
        """Load a Hugging Face folder, a converted checkpoint or 'smollm2' for inference.

        Initialises a single-process group (or uses the existing torch.distributed /
        megatron-core model-parallel state when the caller set them up, e.g. under
        torchrun with TP>1).
        """
        from megatron.core import parallel_state as ps

        from ..models import load_tokenizer
        from ..models import arch_from_source, load_model, resolve_source
        from ..parallel import initialize_model_parallel
        from ..runtime_env import apply_cpu_redirection, init_distributed

        src = resolve_source(str(source))
        arch_from_source(src)  # config errors before any process group
        if not ps.model_parallel_is_initialized():
            plat = init_distributed(device, "auto")
            initialize_model_parallel(1, 1, seed=1234)
            dev = plat.device
        else:
            dev = torch.device("cuda", torch.cuda.current_device()) \
                if torch.cuda.is_available() and device != "cpu" else torch.device("cpu")
        if dev.type == "cpu":
            apply_cpu_redirection()
        model, arch = load_model(src, device=dev, dtype=dtype, impl=transformer_impl)
        return cls(model, load_tokenizer(src), config, arch=arch)

    # ------------------------------------------------------------------ public API
    @torch.no_grad()
    def generate(self, prompt_token_ids: Sequence[Sequence[int]],
                 params: ParamsArg = SamplingParams(), *,
                 request_seeds: Optional[Sequence[int]] = None) -> list[RolloutOutput]:
        """Generate a completion for every prompt; outputs are in prompt order.

        ``params`` is one SamplingParams for all prompts or one per prompt.
        ``request_seeds``: each request's own seed (its random stream, or its noise key
        under coupled sampling) instead of one derived from ``params.seed`` and its index
        in this call, so a request samples the same way whichever call, batch or replica
        it runs in.

        At expert parallelism > 1 every rank of the expert-parallel group must call it
        (with its own requests, or none): the group decodes them together
        (``expert_call``).
        """
        if self.runner.ep_group is not None:
            from .expert_call import generate_together

            return generate_together(self.generate_union, self.runner.ep_group,
                                     prompt_token_ids, params, request_seeds)
        return self.generate_union(prompt_token_ids, params, request_seeds=request_seeds)

    @torch.no_grad()
    def generate_union(self, prompt_token_ids: Sequence[Sequence[int]],
                       params: ParamsArg = SamplingParams(), *,
                       request_seeds: Optional[Sequence[int]] = None) -> list[RolloutOutput]:
        """``generate`` of these requests as given, by this rank's model-parallel group
        alone: at expert parallelism > 1 every rank of the expert-parallel group passes
        the same union of the group's requests (``expert_call.generate_together``
        gathers it); elsewhere ``generate`` itself."""
        prompts = [list(map(int, p)) for p in prompt_token_ids]
        n = len(prompts)
        if n == 0:
            return []
        plist = [params] * n if isinstance(params, SamplingParams) else list(params)
        if len(plist) != n:
            raise ValueError(f"got {len(plist)} SamplingParams for {n} prompts")
        self._check_prompts(prompts)
        self.memory.check(prompts, plist)
        stats = GenerateStats(prompts=n)
        self.last_stats = stats
        if request_seeds is not None and len(request_seeds) != n:
            raise ValueError(f"got {len(request_seeds)} request seeds for {n} prompts")
        streams, keys = self._keys(plist, request_seeds)
        t0 = time.perf_counter()
        self.runner.pack_weights()  # the kernels' weight copies, from the current parameters
        stats.pack_seconds = time.perf_counter() - t0
        max_batch = self.runner.call_rows(self.config.max_batch_size)

        def decode(idx: list[int], hidden_on_device: bool) -> list[RolloutOutput]:
            return self._run([prompts[i] for i in idx], [plist[i] for i in idx],
                             [streams[i] for i in idx], [keys[i] for i in idx], stats,
                             max_batch, hidden_on_device)

        # the runner says which requests this rank decodes (PP > 1 gathered: a share,
        # then the stages' outputs exchanged) and hands back the call's outputs
        outputs, self.last_stats = self.runner.run_call(
            prompts, decode, stats, self.hidden_dtype, grouped=self.config.share_prefill)
        return outputs

    def _run(self, prompts: list[list[int]], plist: Sequence[SamplingParams], streams: list,
             keys: list, stats: GenerateStats, max_batch: int,
             hidden_on_device: bool = False) -> list[RolloutOutput]:
        """The decode loop over these requests (their stream and noise keys made)
        with at most ``max_batch`` rows running; returned hidden states stay on the
        device with ``hidden_on_device`` (the gathered mode exchanges them there)."""
        n = len(prompts)
        if n == 0:
            return []
        capacity = max(min(len(p) + sp.max_new_tokens, self.context)
                       for p, sp in zip(prompts, plist))
        max_batch = self.memory.batch_rows(min(max_batch, n))
        sc = self.config.speculative
        ctl = (SpeculationController(self.spec, self.tuner, threshold=sc.threshold,
                                     tuner_state=sc.tuner_state, tp_times=self.tp_times)
               if self.spec is not None else None)
        slack = ctl.slack if ctl is not None else 0
        cache = self.memory.kv_cache(max_batch, capacity, slack, ctl)
        if ctl is not None:
            # verification through the engine's graphs (or eager); a kind whose drafting
            # is graphed gets graphs of its own forwards (``SpeculativeDecoder.wire_graphs``)
            self.spec.wire_graphs(self._graphs)
            # (the drafters' caches zero what this call can reach, as the target's,
            # and page when it does)
            stats.spec = ctl.begin(*self.memory.spec_shape(max_batch, capacity),
                                   reach=capacity if self.memory.zeroes_reach else None,
                                   paged=cache if cache.paged else None)
        stats.kv_cache_bytes = cache.nbytes
        if cache.paged:
            stats.kv_blocks = cache.pool.usable
            cache.pool.peak_used = cache.pool.used
        # None where the drafter's feature store holds the hidden states (one copy)
        hidden_buf = self.memory.hidden_buffer(plist, max_batch)
        move_drafter = ctl.remove_row if ctl is not None else None
        retire = lambda: scheduler.retire(  # noqa: E731
            cache, rows, outputs, self._finish_reason,
            lambda i, r: self.memory.response_hidden(hidden_buf, i, r, hidden_on_device),
            hidden_buf, move_drafter, ctl.finished if ctl is not None else None)

        def preempt(i: int) -> Row:
            scheduler.save_hidden(rows[i], hidden_buf, i)
            return scheduler.remove_row(cache, rows, i, hidden_buf, move_drafter)

        # rollout.share_prefill: the prompts running rows hold (one prefill per prompt)
        shared = SharedPrompts() if self.config.share_prefill else None
        outputs: list[Optional[RolloutOutput]] = [None] * n
        rows: list[Row] = []
        sched = scheduler.Scheduler(cache, rows, max_batch, stats, slack=slack, shared=shared,
                                    remove=preempt)
        sched.queue.extend(range(n))
        make_row = lambda i: Row(i, plist[i], streams[i], len(prompts[i]),  # noqa: E731
                                 prompts[i], keys[i])
        chunk = self.config.prefill_tokens
        while sched.queue or rows:
            if self.interrupt is not None and self.interrupt():
                raise GenerationInterrupted(f"generation interrupted with "
                                            f"{len(sched.queue)} queued and {len(rows)} "
                                            f"running requests")
            if sched.queue and len(rows) < max_batch:
                admitted, resumed = sched.admit(make_row)
                if admitted or resumed:
                    t0 = time.perf_counter()
                    if resumed:  # preempted rows: their positions recomputed
                        recompute(self.runner, cache, len(rows), resumed, stats, ctl, chunk)
                        scheduler.restore_hidden(resumed, len(rows), hidden_buf)
                        rows.extend(resumed)
                    admitted = prefill(self.runner, cache, rows, admitted, hidden_buf, stats,
                                       ctl, shared, emit=self._emit, prefill_tokens=chunk)
                    stats.prefill_seconds += time.perf_counter() - t0
                    rows.extend(admitted)
                    retire()
                    continue
            self._decode_step(cache, rows, hidden_buf, stats, ctl, retire, sched)
        stats.generated_tokens = sum(len(o.token_ids) for o in outputs)
        if cache.paged:
            stats.note_blocks(cache.pool.peak_used, 0, cache.block_nbytes)
        stats.graphs = self._graph_decisions()
        routes_to_host(outputs)  # (MoE) the experts of every position, one host copy
        if ctl is not None:
            ctl.finish()
        return outputs  # type: ignore[return-value]

    def _decode_step(self, cache: KVCache, rows: list[Row], hidden_buf,
                     stats: GenerateStats, ctl: Optional[SpeculationController],
                     retire: Callable[[], None],
                     sched: Optional[scheduler.Scheduler] = None) -> None:
        """One decode step of the running batch, plain or speculative, then the
        finished-rows check; with the paged cache the step's blocks first (rows
        preempted if they run out) and a speculative step's unused ones returned after.
        Its host reads are budgeted (``bench.sync_budget``,
        tests/rollout/test_host_syncs.py)."""
        if sched is not None:
            sched.prepare_step()
        t0 = time.perf_counter()
        stats.batch_sizes.append(len(rows))
        if ctl is None:
            self._plain_step(cache, rows, hidden_buf, None)
            stats.record_step(time.perf_counter() - t0, speculative=False)
        else:
            ctl.decode_step(
                cache, rows, t0, lambda hook: self._plain_step(cache, rows, hidden_buf, hook),
                lambda *step: self._commit(rows, hidden_buf, *step),
                stats.record_step)
        if sched is not None:
            sched.after_step()
        retire()

    def _commit(self, rows: list[Row], hidden_buf, emissions, verified) -> list[int]:
        """Emit a speculative step's tokens (``SpeculationController``'s commit): per
        row its accepted drafts and next token, with log-probs and hidden states as
        plain decoding emits them, cut at a stop token or length limit. Returns how
        many tokens each row kept.

        The cut needs only the tokens (host ints), so the host appends them first; the
        device work is then one batch over all rows, its size independent of the row
        count: one gather of the emitted nodes' logits for the rows whose log-probs the
        acceptance did not read, with one host read of them, and one scatter of the
        kept tokens' hidden states into ``hidden_buf``."""
        firsts = [len(r.tokens) for r in rows]  # each row's first response slot now
        emitted = []
        for r, e in zip(rows, emissions):
            L, m = r.length, 0
            for t in e.tokens:
                r.tokens.append(t)
                m += 1
                r.length = L + m
                if self._finish_reason(r) is not None:
                    break
            emitted.append(m)
        lps = self._emitted_logprobs(rows, emissions, verified)
        for r, lp, m in zip(rows, lps, emitted):
            r.logprobs.extend(lp[:m])
        if hidden_buf is not None and rows:
            off = verified.offsets
            where = [(i, firsts[i] + j, off[i] + n) for i, (e, m) in
                     enumerate(zip(emissions, emitted)) for j, n in enumerate(e.nodes[:m])]
            row, pos, src = torch.tensor(where, device=self.device).unbind(1)
            hidden_buf[row, pos] = verified.hidden.index_select(0, src).to(hidden_buf.dtype)
        return emitted

    def _emitted_logprobs(self, rows: list[Row], emissions, verified) -> list[list[float]]:
        """Per row, its emitted tokens' log-probs as its request asks: the acceptance's
        where it read them (greedy verification), else computed here from the verify
        forward's logits in one gather over every such row's nodes and one host read."""
        need = [i for i, e in enumerate(emissions) if e.logprobs is None]
        out = [e.logprobs for e in emissions]
        if not need:
            return out
        off = verified.offsets
        picked = [(off[i] + n, t) for i in need
                  for n, t in zip(emissions[i].nodes, emissions[i].tokens)]
        params = [rows[i].params for i in need for _ in emissions[i].tokens]
        idx, tok = torch.tensor(picked, device=self.device).unbind(1)
        x = verified.logits.index_select(0, idx).float()
        raw = torch.log_softmax(x, dim=-1).gather(-1, tok[:, None])[:, 0]
        # greedy rows: the raw log-prob (their "processed" rows are the logits)
        greedy = torch.tensor([p.greedy for p in params], device=self.device)
        processed = torch.where(greedy, raw,
                                verified.plp.index_select(0, idx).gather(-1, tok[:, None])[:, 0])
        chosen = requested_logprobs(x, tok, params, raw, processed).tolist()  # one read
        k = 0
        for i in need:
            n = len(emissions[i].tokens)
            out[i] = chosen[k: k + n]
            k += n
        return out

    def _plain_step(self, cache: KVCache, rows: list[Row], hidden_buf, capture):
        """One plain decode step: the target over every row's last token, one token
        emitted per row. Returns the hidden states [B, 1, H] and their positions [B]."""
        b = len(rows)
        last = torch.tensor([r.tokens[-1] for r in rows], dtype=torch.long,
                            device=self.device)[:, None]
        start = torch.tensor([r.length for r in rows], dtype=torch.long, device=self.device)
        if self._graphs is not None:  # (EAGLE-3 capture is refused with graphs)
            hidden = self._graphs.run(cache, last, start)
        else:
            # the host knows the longest row: attention's span without reading `start`
            hidden = self.runner.extend(cache, slice(0, b), last, start, capture=capture,
                                        span=max(r.length for r in rows) + 1)
        for r in rows:
            r.length += 1
        self._emit(rows, 0, hidden[:, 0], hidden_buf)
        return hidden, start

    # ------------------------------------------------------------------ steps
    def _emit(self, rows: Sequence[Row], first_row: int, hidden: torch.Tensor,
              hidden_buf: Optional[torch.Tensor]) -> None:
        """Sample one token for each of ``rows`` (cache rows first_row..) from ``hidden``."""
        logits = self.runner.logits(hidden)
        coupled = ([None if r.key is None else (r.key, len(r.tokens)) for r in rows]
                   if self.coupled else None)
        streams = [None if r.stream is None else (r.stream, len(r.tokens)) for r in rows]
        tokens, raw, processed = choose_tokens(
            logits, [r.params for r in rows], streams, self.runner.kernels, coupled=coupled)
        tokens = self._from_tp_rank0(tokens)  # ranks agree already; this makes it certain
        if hidden_buf is not None:
            pos = torch.tensor([len(r.tokens) for r in rows], device=self.device)
            idx = torch.arange(first_row, first_row + len(rows), device=self.device)
            hidden_buf[idx, pos] = hidden.to(hidden_buf.dtype)
        chosen = requested_logprobs(logits, tokens, [r.params for r in rows], raw, processed)
        # the step's one host read: tokens (exact in float64) and log-probs together
        toks, lps = torch.stack([tokens.double(), chosen.double()]).tolist()
        for r, tok, lp in zip(rows, toks, lps):
            r.tokens.append(int(tok))
            r.logprobs.append(lp)

    def _finish_reason(self, r: Row) -> Optional[str]:
        tok = r.tokens[-1]
        if (not r.params.ignore_eos and tok in self.eos_token_ids) or \
                tok in r.params.stop_token_ids:
            return "stop"
        if len(r.tokens) >= r.params.max_new_tokens or r.length + 1 >= self.context:
            return "length"
        return None

    # ------------------------------------------------------------------ helpers
    def _graph_decisions(self) -> dict[str, dict]:
        """``rollout.cuda_graphs=auto``'s measured choice per key: the target's
        ("target/<key>") and each graphed drafter kind's ("<kind>/<key>")."""
        out = {}
        if self._graphs is not None:
            out.update({f"target/{k}": v for k, v in self._graphs.decisions().items()})
        if self.spec is not None:
            out.update(self.spec.graph_decisions())
        return out

    def _from_tp_rank0(self, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor`` as TP rank 0 (of the last stage) holds it, on every rank (in place)."""
        return self.runner.agree(tensor)

    def tp_times(self, *values: float) -> list[float]:
        """``values`` as TP rank 0 measured them, on every TP rank: the tuner's
        decisions follow measured times, and TP ranks must take the same ones."""
        if self.runner.decides_alone:
            return list(values)
        t = torch.tensor(values, dtype=torch.float64, device=self.device)
        return self._from_tp_rank0(t).tolist()

    def _keys(self, plist: Sequence[SamplingParams],
              request_seeds: Optional[Sequence[int]] = None):
        """Per request: its random stream's key (standard sampling) and its
        coupled-noise key (coupled sampling), both its own seed (``own_seed``); None
        for greedy requests and for the unused one."""
        streams: list[Optional[int]] = []
        keys: list[Optional[int]] = []
        drawn = None
        for i, sp in enumerate(plist):
            if sp.greedy:
                streams.append(None)
                keys.append(None)
                continue
            seed = sp.seed
            if seed is None and request_seeds is None:
                if drawn is None:
                    drawn = self._shared_seed()
                seed = drawn
            rs = own_seed(seed, i, request_seeds)
            if self.coupled:
                streams.append(None)
                keys.append(rs)
            else:
                streams.append(rs)
                keys.append(None)
        return streams, keys

    def _shared_seed(self) -> int:
        """A fresh seed, the same on every rank of the model-parallel group."""
        s = torch.randint(0, 2**62, (1,), dtype=torch.long).to(self.device)
        return int(self.runner.agree_all(s).item())

    def _check_prompts(self, prompts: list[list[int]]) -> None:
        vocab = self.arch.vocab_size
        for i, p in enumerate(prompts):
            if not p:
                raise PromptError(f"prompt {i} is empty; every prompt needs at least one token")
            lo, hi = min(p), max(p)
            if lo < 0 or hi >= vocab:
                raise PromptError(f"prompt {i} has token id {lo if lo < 0 else hi} outside "
                                  f"the vocabulary [0, {vocab})")
            if len(p) >= self.context:
                raise PromptError(
                    f"prompt {i} has {len(p)} tokens but the context is {self.context} "
                    f"tokens (model max_position_embeddings="
                    f"{self.arch.max_position_embeddings}, rollout.max_seq_len="
                    f"{self.config.max_seq_len}); shorten the prompt or raise the limit")

    def release_memory(self) -> None:
        """Free the rollout's caches, feature store and CUDA graphs before the policy
        update (``rollout.memory``); the next ``generate`` makes them again."""
        self.memory.release()


def _eos_ids(tokenizer) -> tuple[int, ...]:
    if tokenizer is None:
        return ()
    ids = set()
    if getattr(tokenizer, "eos_token_id", None) is not None:
        ids.add(int(tokenizer.eos_token_id))
    return tuple(sorted(ids))
