"""A drafter's own KV cache: fixed slots (``KVCache``) or, with ``rollout.kv_cache=paged``,
blocks (``PagedKVCache``) with a table per row and a pool of its own.

The drafters (the one-layer drafter, the self-drafter's copy) hold state only for the
rows that speculate: a batch speculates only while it has at most
``rollout.speculative.threshold`` rows, and running rows are contiguous, so drafter
positions are only ever written in rows 0..threshold-1. A paged drafter cache has
that many rows' worth of blocks (``pool_blocks``: each row's positions up to the
call's capacity and the draft slack), so it never runs out and never preempts; the
engine's memory counts the pool against ``rollout.kv_cache_gib`` (``pool_bytes``,
``rollout.memory``). Its table has a row per cache row (a row moved in from past the
threshold brings an empty table) and is as wide as the drafter's reach, including the
padded catch-up's pad slots past each row's run (they land in the scratch block
where the row holds no block, and are never read unmasked).

The drafter's decoder reserves blocks for the positions a speculative step may write
(each row's length + 1 + the slack: the root, the chain or tree slots) before its
catch-up, returns those past the positions it keeps after the step (``committed``),
and a row's blocks when it leaves the batch (finished or preempted) or holds a new
sequence. Bytes in use therefore follow the positions the drafter holds, within one
block per row.
"""

from __future__ import annotations

from typing import Optional, Union

import torch

from ..kv_blocks import blocks_for
from ..kv_cache import KVCache, reuse_or_make
from ..kv_paged import PagedKVCache, block_bytes

DraftCache = Union[KVCache, PagedKVCache]


def pool_blocks(pool_rows: int, positions: int, block_size: int) -> int:
    """Blocks of a paged drafter cache: ``pool_rows`` rows of ``positions`` positions,
    and the scratch block."""
    return max(1, pool_rows) * blocks_for(positions, block_size) + 1


def pool_positions(*, rows: int, capacity: int, slack: int, block_size: int,
                   threshold: int = 0) -> int:
    """Positions of the pool of a paged drafter cache (``begin``'s): the rows of batches
    that speculate (``rows`` up to ``threshold``; 0: all) of the call's ``capacity``
    and draft slack, in blocks, and the scratch block. The dry run's formula too
    (``drafter_kind.own_kv_bytes``)."""
    pool_rows = max(1, min(rows, threshold or rows))
    return pool_blocks(pool_rows, capacity + slack + 1, block_size) * block_size


def pool_bytes(*, num_layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype,
               pool_rows: int, positions: int, block_size: int) -> int:
    """Bytes of that pool (K and V of every layer of each block)."""
    per = block_bytes(num_layers=num_layers, kv_heads=kv_heads, block_size=block_size,
                      head_dim=head_dim,
                      itemsize=torch.empty((), dtype=dtype).element_size())
    return per * pool_blocks(pool_rows, positions, block_size)


def make(cache: Optional[DraftCache], *, block_size: Optional[int], num_layers: int,
         rows: int, width: int, pool_rows: int, positions: int, kv_heads: int,
         head_dim: int, dtype: torch.dtype, device: torch.device,
         upto: Optional[int] = None, layout: str = "bgsd") -> DraftCache:
    """The drafter's cache for a call: ``rows`` rows reaching ``width`` positions
    (fixed slots: zeroed up to ``upto``, ``kv_cache.reuse_or_make``); with
    ``block_size`` a paged cache of that table, its pool ``pool_rows`` rows of
    ``positions`` positions (re-used when its shape is the same); ``layout`` as the
    drafter's attention reads it ("bsgd": flash-attn's)."""
    shape = dict(num_layers=num_layers, kv_heads=kv_heads, head_dim=head_dim, dtype=dtype,
                 device=device, layout=layout)
    if block_size is None:
        if cache is not None and cache.paged:
            cache.release()
            cache = None
        return reuse_or_make(cache, max_batch=rows, capacity=width, upto=upto, **shape)
    blocks = pool_blocks(pool_rows, positions, block_size)
    if (cache is not None and cache.paged and cache.max_batch == rows
            and cache.capacity == blocks_for(width, block_size) * block_size
            and cache.num_blocks == blocks and cache.block_size == block_size
            and cache.shape[0] == num_layers and cache.layout == layout):
        cache.allocate()
        cache.pool.reset()  # a call starts with no drafter state (an interrupted one's)
        return cache
    if cache is not None:
        cache.release()
    return PagedKVCache(max_batch=rows, capacity=width, num_blocks=blocks,
                        block_size=block_size, **shape)


def reserve(cache: Optional[DraftCache], rows, slack: int) -> None:
    """Blocks for the positions a speculative step may write in each of ``rows`` (its
    length + 1 + ``slack``), the table then on the device (every change to it since the
    last step: moves, returns); nothing for fixed slots."""
    if cache is not None and cache.paged:
        cache.reserve_rows([(i, r.length + 1 + slack) for i, r in enumerate(rows)])
        cache.pool.flush()  # (graphed drafting reads the device table as it stands)


def trim(cache: Optional[DraftCache], kept) -> None:
    """Return the blocks past the ``kept[i]`` positions each row i holds (paged)."""
    if cache is not None and cache.paged:
        for i, n in enumerate(kept):
            cache.trim(i, n)


def free_row(cache: Optional[DraftCache], row: int) -> None:
    """Return row ``row``'s blocks (paged; a row past the table's holds none)."""
    if cache is not None and cache.paged and row < cache.max_batch:
        cache.free_row(row)


def bytes_in_use(cache: Optional[DraftCache]) -> int:
    """Bytes of the blocks the drafter's rows hold (paged), or of its slots."""
    if cache is None or not cache.allocated:
        return 0
    return cache.bytes_in_use


class PagedFeatures:
    """The one-layer drafter's feature store (the target's features per row and
    position) in the target's paged cache (``PagedKVCache.feat``): its positions are
    the target's, so the target's tables, sharing, moves and returns serve it, and its
    bytes are the target's blocks' (inside ``rollout.kv_cache_gib``). Reads as the
    store's tensor does: ``features[row, lo:hi]`` -> [hi - lo, F]."""

    nbytes = 0  # (counted in the target cache's bytes)

    def __init__(self, cache, width: int):
        if cache.feat is None or cache.feature_shape[-1] != width:
            raise RuntimeError(f"the paged KV cache holds no drafter features of width "
                               f"{width} (rollout.memory sizes it with the drafter's)")
        self.cache = cache
        self.dtype, self.device = cache.feat.dtype, cache.feat.device

    def __getitem__(self, key) -> torch.Tensor:
        row, span = key
        hi = span.stop
        return self.cache.read_features(int(row), span.start or 0, hi)
