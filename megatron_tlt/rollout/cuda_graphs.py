"""CUDA graphs for decode steps (``rollout.cuda_graphs=true``; CUDA only).

A decode step at small batch is dominated by kernel-launch overhead on a GPU. This
captures ``ModelRunner.extend`` for one new token per row, once per batch-size bucket
(1, 2, 4, 8, ... up to the cache's rows), and replays it:

- inputs are copied into static buffers; rows past the running batch are padding:
  token 0 written at the cache's last position of a free row. The warm-up runs before
  capture do the same for every row of the bucket, the running ones included, so they
  must not write where a running row has keys: the last position is written by the
  step that reaches it before anything reads it (and a free row is prefilled from
  scratch before it runs);
- attention reads a fixed span (the cache's whole capacity) with a length mask, so no
  step depends on host-side values;
- the graphs are tied to one allocation of the cache (its addresses): they are
  released with it (``release``, by ``rollout.memory.RolloutMemory.release`` before the
  policy update, which frees their memory pool too), and a re-made or new cache
  re-captures each bucket at its first use.

Sampling stays outside the graph (it is per-row and cheap).
"""

from __future__ import annotations

from typing import Optional

import torch

from .forward import ModelRunner
from .kv_cache import KVCache


def bucket_for(b: int, max_rows: int) -> int:
    size = 1
    while size < b:
        size *= 2
    return min(size, max_rows)


class GraphedDecoder:
    def __init__(self, runner: ModelRunner):
        if runner.device.type != "cuda":
            raise ValueError("CUDA graphs need the model on CUDA")
        self.runner = runner
        self.cache: Optional[KVCache] = None
        self.generation = 0  # the cache allocation the graphs were captured on
        self.graphs: dict[int, tuple] = {}
        self.pool = None

    @property
    def captured(self) -> int:
        """Graphs held (one per batch-size bucket used since the last release)."""
        return len(self.graphs)

    def release(self) -> None:
        """Drop the graphs, their static buffers and memory pool (re-captured on use)."""
        self.graphs.clear()
        self.cache, self.pool, self.generation = None, None, 0

    def _reset(self, cache: KVCache) -> None:
        self.release()
        self.cache, self.generation = cache, cache.generation
        self.pool = torch.cuda.graph_pool_handle()
        self.runner.rope_tables(cache.capacity)  # grown now: never during capture

    def _capture(self, bucket: int) -> tuple:
        cache, runner = self.cache, self.runner
        tokens = torch.zeros(bucket, 1, dtype=torch.long, device=runner.device)
        start = torch.full((bucket,), cache.capacity - 1, dtype=torch.long,
                           device=runner.device)

        def step():
            return runner.extend(cache, slice(0, bucket), tokens, start, span=cache.capacity)

        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):  # warm-up outside the graph (allocator, kernels, NCCL)
                step()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            out = step()
        return graph, tokens, start, out

    def run(self, cache: KVCache, tokens: torch.Tensor, start: torch.Tensor) -> torch.Tensor:
        """Final hidden states [b, 1, hidden] for ``tokens`` [b, 1] at ``start`` [b]."""
        if cache is not self.cache or cache.generation != self.generation:
            self._reset(cache)
        b = tokens.shape[0]
        bucket = bucket_for(b, cache.max_batch)
        if bucket not in self.graphs:
            self.graphs[bucket] = self._capture(bucket)
        graph, s_tokens, s_start, out = self.graphs[bucket]
        s_tokens.zero_()
        s_start.fill_(cache.capacity - 1)  # padding rows: see the module docstring
        s_tokens[:b].copy_(tokens)
        s_start[:b].copy_(start)
        graph.replay()
        return out[:b]
