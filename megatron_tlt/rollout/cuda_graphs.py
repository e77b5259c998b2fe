"""Fixed-shape forwards, captured in CUDA graphs (``rollout.cuda_graphs``).

A decode step at small batch is dominated by kernel-launch overhead on a GPU. This
captures ``ModelRunner.extend`` once per shape and replays it. A shape is a key
(batch-size bucket, new tokens per row T, tree mask width W or 0 for causal, inputs
given as embeddings or not). On the target (the engine's ``GraphedDecoder``):

- the plain decode step: one new token per row (``run``);
- a speculative step's verification (``verify``): a chain's root and drafts, causally
  (the chain's width, at most depth + 1), or a tree's root and nodes with their
  ancestor mask and depth-based rotary positions (W = T = verify_tokens + 1).

On the one-layer drafter (a ``GraphedDecoder`` over its runner and cache, held by its
``Drafting``): the catch-up (the roots, one per row; before them the positions a
steady step accepted, the longest row's count, up to the draft slack; a longer
catch-up, of positions decoded plainly, runs eagerly rather than capture a key per
width), each chain step (one token per row) and each tree step (top-k nodes per row,
W = the nodes fed so far), all with the drafter's fused inputs as embeddings.

Buckets are batch sizes 1, 2, 4, 8, ... below the cache's rows, then the cache's rows
(``bucket_for``: 24 rows give 1, 2, 4, 8, 16, 24; the cache gets no extra rows). The
step is fixed-shape device code:

- inputs are copied into static buffers; rows past the running batch are padding:
  token 0 at position 0 of a free row, attending over their own new tokens only
  (length 0, a causal mask among their new tokens), so their attention is a few
  keys; they write only their own row's first slots, which a free row's prefill
  overwrites before anything reads them;
- the warm-up runs before capture (and the capture itself) run every row of the
  bucket, the running ones included, at the cache's last ``T`` positions: no running
  row has keys there (in the target's cache a running row's length is below the
  capacity less the draft slack, and a verification's ``T`` is at most the slack; a
  plain step's ``T`` is 1; the drafter's cache has a whole capacity beyond that
  without the fused CPU kernels, the only case it is graphed), and whatever lands there is overwritten by the step that reaches it
  before anything reads it;
- attention reads a fixed span (the cache's whole capacity) with a length mask, so no
  step depends on a host-side value; nothing inside the captured region reads the
  device (the host's reads, sampling and acceptance stay outside, in the budget of
  ``bench.sync_budget``);
- the graphs are tied to one allocation of the cache (its addresses): they are
  released with it (``release``, by ``rollout.memory.RolloutMemory.release`` before the
  policy update, which frees their memory pool too), and a re-made or new cache
  re-captures each key at its first use.

Outputs (final hidden states) are views of the graph's static output: valid until the
decoder's next replay of any key (the next step, or the drafter's next chain depth;
each caller reads them, or copies what it keeps, before): the keys share a pool, so a
key's output may lie in blocks an earlier-captured key's forward uses for its
intermediates.

Under ``rollout.cuda_graphs=auto`` a key's first capture is followed by a measurement:
``TIMED_RUNS`` replays of its graph against as many eager runs of the same step (the
static buffers at the warm-up inputs, each side after one untimed run, timed on the
device with CUDA events, ``device_seconds``; at TP > 1 TP rank 0's times decide for
all ranks). Where the graph is not faster the key runs that step eagerly from then on
(its graph dropped); ``decisions()`` reports each key's choice and times (the
engine's ``GenerateStats.graphs``). A decision holds for the decoder's life: a key
re-captured after a release is not measured again. Under ``true`` every key is
graphed, unmeasured.

Memory: each decoder's keys share one memory pool (``graph_pool_handle``): a key's
output [bucket, T, hidden] stays in it, and the blocks its forward's intermediates
freed at the end of its capture serve the next key's capture, so the pool holds about
the keys' outputs plus the largest key's working set (the dry run's model:
``rl.memory_terms.graph_keys``, ``graph_pool_bytes``). Keys are captured at first use;
a rollout's running batch starts at its largest bucket and shrinks into the tail, so
the largest plain keys usually come first and the smaller ones fit in their freed
blocks. The static input buffers are ordinary allocations. The target and the
one-layer drafter have a pool each.

Not graphed: prefill, the LM heads (logits), sampling and acceptance (eager batched
device ops), the self-drafter's copy and a Transformer Engine FP8 drafter (eager
drafting), EAGLE-3 feature-layer capture (auto: eager steps; true: refused).

``GraphedDecoder(runner, capture=False)`` runs the same static-buffer code eagerly,
warm-up included, without capturing: the CPU tests check that it decodes exactly like
the engine's eager path (tests/rollout/test_graph_steps.py); tests_gpu replays the
captured graphs against eager decoding.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch

from .forward import ModelRunner
from .kv_cache import KVCache


# replays and eager runs timed per key at its first capture under auto
TIMED_RUNS = 3


def device_seconds(fn: Callable[[], object], runs: int) -> float:
    """Seconds per call of ``fn`` on the current CUDA stream, by CUDA events: one
    untimed call (a graph's first replay uploads it), the stream drained, then ``runs``
    calls between two events (a launch-bound eager step leaves the device idle between
    its kernels: the gaps are timed too)."""
    stream = torch.cuda.current_stream()
    fn()
    stream.synchronize()
    begin = torch.cuda.Event(enable_timing=True)
    end = torch.cuda.Event(enable_timing=True)
    begin.record(stream)
    for _ in range(runs):
        fn()
    end.record(stream)
    end.synchronize()
    return begin.elapsed_time(end) / 1e3 / runs


@dataclass
class Decision:
    """Graph or eager for one key (``rollout.cuda_graphs=auto``) and the times it was
    decided on (seconds per step)."""

    graphed: bool
    graph_seconds: float
    eager_seconds: float


def key_name(key: tuple) -> str:
    """A key as metrics name it: b<bucket>_t<tokens per row>_w<tree width>[_embeds]."""
    bucket, t, w, embeds = key
    return f"b{bucket}_t{t}_w{w}" + ("_embeds" if embeds else "")


_SIDE: dict = {}


def _side_stream() -> "torch.cuda.Stream":
    """The stream every capture's warm-up runs on (one per device: cuBLAS keeps a
    workspace per stream it ran on, so a new stream per capture would hold one each)."""
    dev = torch.cuda.current_device()
    if dev not in _SIDE:
        _SIDE[dev] = torch.cuda.Stream()
    return _SIDE[dev]


def bucket_for(b: int, max_rows: int) -> int:
    size = 1
    while size < b:
        size *= 2
    return min(size, max_rows)


def resolve(choice, device: torch.device, supports_graphs: bool) -> bool:
    """Whether an engine on ``device`` whose runner ``supports_graphs`` uses CUDA graphs
    for ``rollout.cuda_graphs`` = ``choice`` ("auto": with CUDA wherever the runner
    supports them; "true": required, a clear error elsewhere; "false": never)."""
    choice = str(choice).strip().lower()
    if choice == "false":
        return False
    ok = device.type == "cuda" and supports_graphs
    if choice == "auto" or ok:
        return ok
    if device.type != "cuda":
        raise ValueError(f"rollout.cuda_graphs=true needs CUDA; this engine runs on "
                         f"{device.type}; set rollout.cuda_graphs=auto or false")
    raise ValueError("rollout.cuda_graphs=true is not supported with "
                     "rollout.pipeline_mode=pipelined (a forward passes activations "
                     "stage to stage); use rollout.pipeline_mode=gathered (each stage "
                     "decodes as a PP=1 engine, graphed) or rollout.cuda_graphs=auto "
                     "or false")


@dataclass
class _Step:
    """One key's static buffers and its captured graph (None: run eagerly)."""

    tokens: torch.Tensor  # [bucket, T] long
    start: torch.Tensor  # [bucket] long
    rope: Optional[torch.Tensor]  # [bucket, T] long (trees)
    mask: Optional[torch.Tensor]  # [bucket, T, W] bool (trees)
    fn: Callable[[], torch.Tensor]
    graph: Optional[object] = None
    out: Optional[torch.Tensor] = None  # [bucket, T, hidden]
    embeds: Optional[torch.Tensor] = None  # [bucket, T, hidden] (drafter inputs)
    own_mask: Optional[torch.Tensor] = None  # [T, W] a padding row's mask (trees)

    def replay(self) -> torch.Tensor:
        if self.graph is None:
            self.out = self.fn()
        else:
            self.graph.replay()
        return self.out


class GraphedDecoder:
    """The target's fixed-shape forwards over one cache: captured (``capture``, CUDA)
    or run eagerly through the same static buffers (``capture=False``, any device)."""

    def __init__(self, runner: ModelRunner, capture: bool = True, *, measure: bool = False,
                 timer: Callable[[Callable[[], object], int], float] = device_seconds):
        """``measure``: keep a key's graph only where it measured faster than the same
        step run eagerly (``rollout.cuda_graphs=auto``; ``timer(fn, runs)`` gives
        seconds per call, on the device)."""
        if capture and runner.device.type != "cuda":
            raise ValueError("CUDA graphs need the model on CUDA")
        self.runner = runner
        self.capture = capture
        self.measure = measure
        self.timer = timer
        self.cache: Optional[KVCache] = None
        self.generation = 0  # the cache allocation the graphs were captured on
        self.graphs: dict[tuple, object] = {}
        self.pool = None
        self.decided: dict[tuple, Decision] = {}  # kept through releases

    @property
    def captured(self) -> int:
        """Keys held (one per key used since the last release; a key measured slower
        holds its static buffers without a graph)."""
        return len(self.graphs)

    def decisions(self) -> dict[str, dict]:
        """Per measured key (``key_name``): whether it replays a graph, and the graph's
        and the eager step's measured seconds."""
        return {key_name(k): dict(graphed=d.graphed, graph_seconds=d.graph_seconds,
                                  eager_seconds=d.eager_seconds)
                for k, d in self.decided.items()}

    def release(self) -> None:
        """Drop the graphs, their static buffers and memory pool (re-captured on use)."""
        self.graphs.clear()
        self.cache, self.pool, self.generation = None, None, 0

    def _reset(self, cache: KVCache) -> None:
        self.release()
        self.cache, self.generation = cache, cache.generation
        if self.capture:
            self.pool = torch.cuda.graph_pool_handle()
        self.runner.rope_tables(cache.capacity)  # grown now: never during capture

    # ---------------------------------------------------------------- building a key
    def _buffers(self, bucket: int, t: int, w: int, embeds_like) -> _Step:
        cache, runner, dev = self.cache, self.runner, self.runner.device
        tokens = torch.zeros(bucket, t, dtype=torch.long, device=dev)
        start = torch.zeros(bucket, dtype=torch.long, device=dev)
        rope = torch.zeros(bucket, t, dtype=torch.long, device=dev) if w else None
        mask = torch.zeros(bucket, t, w, dtype=torch.bool, device=dev) if w else None
        embeds = (None if embeds_like is None else
                  torch.zeros(bucket, t, embeds_like.shape[-1], dtype=embeds_like.dtype,
                              device=dev))

        def fn() -> torch.Tensor:
            return runner.extend(cache, slice(0, bucket), tokens, start,
                                 rope_positions=rope, new_token_mask=mask,
                                 span=cache.capacity, embeds=embeds)
        return _Step(tokens, start, rope, mask, fn, embeds=embeds,
                     own_mask=self._own_tokens_mask(t, w, dev) if w else None)

    @staticmethod
    def _own_tokens_mask(t: int, w: int, device) -> torch.Tensor:
        """[T, W]: each new token sees the new tokens up to itself (the last T slots),
        nothing earlier among the W (a padding or warm-up row's mask)."""
        m = torch.zeros(t, w, dtype=torch.bool, device=device)
        m[:, w - t:] = torch.ones(t, t, dtype=torch.bool, device=device).tril()
        return m

    def _warm_inputs(self, s: _Step) -> None:
        """Every row of the bucket at the cache's last T positions (see the module
        docstring: no running row has keys there)."""
        t = s.tokens.shape[1]
        last = self.cache.capacity - t
        s.tokens.zero_()
        s.start.fill_(last)
        if s.embeds is not None:
            s.embeds.zero_()
        if s.rope is not None:
            s.rope.copy_(last + torch.arange(t, device=s.rope.device))
            s.mask.copy_(s.own_mask.expand_as(s.mask))

    def _capture(self, key: tuple, embeds_like=None) -> _Step:
        bucket, t, w, _ = key
        s = self._buffers(bucket, t, w, embeds_like)
        self._warm_inputs(s)
        decided = self.decided.get(key)
        if not self.capture or (decided is not None and not decided.graphed):
            s.fn()  # the same writes as the warm-up, eagerly
            return s
        s.graph, s.out = self._record(s)
        if self.measure and decided is None:
            self._decide(key, s)
        return s

    def _decide(self, key: tuple, s: _Step) -> None:
        """Time the key's graph against the same step run eagerly (at the warm-up
        inputs: the cache's last T slots); keep the graph only if it is faster."""
        graph_s = self.timer(s.graph.replay, TIMED_RUNS)
        eager_s = self.timer(s.fn, TIMED_RUNS)
        if not self.runner.decides_alone:  # TP ranks take one decision: rank 0's times
            times = torch.tensor([graph_s, eager_s], dtype=torch.float64,
                                 device=self.runner.device)
            graph_s, eager_s = self.runner.agree(times).tolist()
        d = self.decided[key] = Decision(graph_s < eager_s, graph_s, eager_s)
        if not d.graphed:  # its pool blocks serve later captures
            s.graph, s.out = None, None

    def _record(self, s: _Step) -> tuple:
        """Capture ``s``'s step in a CUDA graph on this decoder's pool: (graph, its
        static output)."""
        side = _side_stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):  # warm-up outside the graph (allocator, kernels, NCCL)
                s.fn()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            out = s.fn()
        return graph, out

    # ---------------------------------------------------------------- a step
    @torch.no_grad()  # (capture and replay record no autograd graph)
    def forward(self, cache: KVCache, tokens: torch.Tensor, start: torch.Tensor, *,
                rope_positions: Optional[torch.Tensor] = None,
                new_token_mask: Optional[torch.Tensor] = None,
                embeds: Optional[torch.Tensor] = None) -> torch.Tensor:
        """``runner.extend(cache, rows 0..b-1, tokens [b, T], start [b], ...)`` through
        the key's static buffers and graph: final hidden states [b, T, hidden].
        ``new_token_mask`` [b or 1, T, W] and ``rope_positions`` [b, T] come together
        (a tree); ``embeds`` [b, T, hidden] replaces the embedding (the drafter's
        inputs; ``tokens`` then only gives the shape). The key: (bucket, T, W or 0,
        embeds or not)."""
        if cache is not self.cache or cache.generation != self.generation:
            self._reset(cache)
        b, t = tokens.shape
        masked = new_token_mask is not None
        if masked != (rope_positions is not None):
            raise ValueError("a masked (tree) forward takes rope_positions and "
                             "new_token_mask together")
        w = new_token_mask.shape[-1] if masked else 0
        key = (bucket_for(b, cache.max_batch), t, w, embeds is not None)
        s = self.graphs.get(key)
        if s is None:
            s = self.graphs[key] = self._capture(key, embeds)
        # padding rows: token 0 (zero inputs) at position 0 of their own (free) row,
        # attending over their own new tokens only (module docstring)
        s.tokens[b:].zero_()
        s.start[b:].zero_()
        s.tokens[:b].copy_(tokens)
        s.start[:b].copy_(start)
        if s.embeds is not None:
            s.embeds[b:].zero_()
            s.embeds[:b].copy_(embeds)
        if masked:
            s.rope[b:].zero_()
            s.mask[b:] = s.own_mask
            s.rope[:b].copy_(rope_positions)
            s.mask[:b].copy_(new_token_mask.expand(b, t, w))
        return s.replay()[:b]

    def run(self, cache: KVCache, tokens: torch.Tensor, start: torch.Tensor) -> torch.Tensor:
        """The plain decode step: final hidden states [b, 1, hidden] for ``tokens``
        [b, 1] at ``start`` [b]."""
        return self.forward(cache, tokens, start)

    def verify(self, cache: KVCache, tokens: torch.Tensor, start: torch.Tensor, *,
               rope_positions: Optional[torch.Tensor] = None,
               new_token_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
        """A speculative step's verification forward: ``tokens`` [b, T] (a chain's root
        and drafts, causal; or a tree's nodes with ``new_token_mask`` [b, T, T] and
        ``rope_positions``) at ``start`` [b]. Returns hidden states [b, T, hidden]."""
        return self.forward(cache, tokens, start, rope_positions=rope_positions,
                            new_token_mask=new_token_mask)
