"""A paged KV cache (``rollout.kv_cache=paged``): ``KVCache``'s interface over blocks.

K and V live in pools [layers, blocks, kv_heads, block_size, head_dim] (layout "bgsd",
for SDPA over gathered blocks) or [layers, blocks, block_size, kv_heads, head_dim]
("bsgd": a layer's pool is the (num_blocks, page_block_size, nheads_k, headdim) cache
flash-attn's ``flash_attn_with_kvcache`` reads through a block table, ``rollout.flash``;
its table is then int32, as that kernel takes it); each row (a running sequence) reads
its positions through its block table (``kv_blocks.BlockPool``).
The engine's consumers use the same calls as on the contiguous ``KVCache``:

- ``write`` stores the new keys and values at (block, offset) of their positions and
  returns every row's K and V over positions 0..span-1 gathered from its blocks
  ("bgsd" order, whatever the pools' layout), so SDPA, chain and tree verification run
  unchanged; the gather reads
  only the table (no host read), so the same code is what a CUDA graph replays;
- ``move_row`` is a table swap, ``copy_row`` shares the prompt's full blocks by
  reference (``BlockPool.share``) and copies the partly filled last one;
- ``span`` / ``copy_positions`` / ``move_positions`` / ``row_routes`` /
  ``record_routes`` address positions through the table;
- ``reserve`` / ``trim`` / ``free_row`` are the engine's block lifecycle (no-ops on
  ``KVCache``): blocks for the positions a step may write (k + 1 with speculation),
  returned on rollback and when a row finishes.

Memory: the pools are made for the whole budget; on the CPU with ``torch.empty``, so
the operating system maps a block's pages when it is first written, and a block is
zeroed the first time it is handed out (a gathered read may cover a block's unwritten
positions; they must hold finite values for the length mask). Bytes in use follow the
blocks rows hold (``bytes_in_use``), within one block per row of their tokens.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from .kv_blocks import SCRATCH, BlockPool, blocks_for
from .kv_cache import LAYOUTS, KVCache


def block_bytes(*, num_layers: int, kv_heads: int, block_size: int, head_dim: int,
                itemsize: int, routes: Optional[tuple[int, int]] = None,
                features: Optional[tuple[int, torch.dtype]] = None) -> int:
    """Bytes of one block: K and V of every layer (+ the experts recorded per position,
    + the drafter's features per position)."""
    kv = 2 * num_layers * kv_heads * block_size * head_dim * itemsize
    if features is not None:
        kv += block_size * features[0] * torch.empty((), dtype=features[1]).element_size()
    return kv + (0 if routes is None else routes[0] * block_size * routes[1] * 2)


class PagedKVCache:
    paged = True

    def __init__(self, *, num_layers: int, max_batch: int, kv_heads: int, capacity: int,
                 head_dim: int, dtype: torch.dtype, device: torch.device, num_blocks: int,
                 block_size: int, routes: Optional[tuple[int, int]] = None,
                 features: Optional[tuple[int, torch.dtype]] = None,
                 lazy_zero: Optional[bool] = None, layout: str = "bgsd"):
        if layout not in LAYOUTS:
            raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
        self.layout = layout
        self.block_size = block_size
        self.max_blocks_per_row = blocks_for(capacity, block_size)
        self.max_batch = max_batch
        self.capacity = self.max_blocks_per_row * block_size
        self.dtype, self.device = dtype, device
        self.num_blocks = num_blocks
        self.shape = ((num_layers, num_blocks, kv_heads, block_size, head_dim)
                      if layout == "bgsd" else
                      (num_layers, num_blocks, block_size, kv_heads, head_dim))
        self.route_shape = None if routes is None else (routes[0], num_blocks, block_size,
                                                        routes[1])
        # the one-layer drafter's feature store per position (its positions are the
        # target's: ``speculative.draft_cache.PagedFeatures``), [blocks, block_size, F]
        self.feature_shape = None if features is None else (num_blocks, block_size,
                                                            features[0])
        self.feature_dtype = None if features is None else features[1]
        self.feat: Optional[torch.Tensor] = None
        self.pool = BlockPool(num_blocks=num_blocks, block_size=block_size,
                              max_rows=max_batch, max_blocks_per_row=self.max_blocks_per_row,
                              device=device,
                              index_dtype=torch.long if layout == "bgsd" else torch.int32)
        # CPU: untouched blocks cost no memory until first handed out
        self.lazy_zero = device.type == "cpu" if lazy_zero is None else lazy_zero
        self.k: Optional[torch.Tensor] = None
        self.v: Optional[torch.Tensor] = None
        self.routes: Optional[torch.Tensor] = None
        self.generation = 0
        self.zeroed = 0  # (KVCache's field; a paged cache zeroes by block)
        self._written: set[int] = set()
        self.allocate()

    # ---------------------------------------------------------------- lifecycle
    # the lifecycle's bookkeeping is the slot cache's: tensors present, their bytes
    allocated = KVCache.allocated
    fits = KVCache.fits

    def release(self) -> None:
        KVCache.release(self)
        self.feat = None

    @property
    def nbytes(self) -> int:
        feat = 0 if self.feat is None else self.feat.numel() * self.feat.element_size()
        return KVCache.nbytes.fget(self) + feat

    def allocate(self, upto: Optional[int] = None) -> "PagedKVCache":
        """Make the pools if released (every block free); ``upto`` is ignored (a block
        is zeroed when first handed out)."""
        if self.k is None:
            make = torch.empty if self.lazy_zero else torch.zeros
            self.k = make(self.shape, dtype=self.dtype, device=self.device)
            self.v = make(self.shape, dtype=self.dtype, device=self.device)
            if self.route_shape is not None:
                self.routes = make(self.route_shape, dtype=torch.int16, device=self.device)
            if self.feature_shape is not None:
                self.feat = make(self.feature_shape, dtype=self.feature_dtype,
                                 device=self.device)
            self.generation += 1
            self.pool.reset()
            self._written = set() if self.lazy_zero else set(range(self.num_blocks))
            self._zero([SCRATCH])
            self.pool.take_fresh()
            self.zeroed = self.capacity
        return self

    @property
    def block_nbytes(self) -> int:
        return self.nbytes // self.num_blocks if self.k is not None else 0

    @property
    def bytes_in_use(self) -> int:
        """Bytes of the blocks rows hold now."""
        return self.pool.used * self.block_nbytes

    def _zero(self, blocks: Sequence[int]) -> None:
        new = [b for b in blocks if b not in self._written]
        if not new:
            return
        idx = torch.tensor(new, device=self.device)
        for t in (self.k, self.v):
            t.index_fill_(1, idx, 0)
        if self.routes is not None:
            self.routes.index_fill_(1, idx, 0)
        if self.feat is not None:
            self.feat.index_fill_(0, idx, 0)
        self._written.update(new)

    def _fresh(self) -> None:
        fresh = self.pool.take_fresh()
        if fresh:
            self._zero(fresh)

    # ---------------------------------------------------------------- blocks
    def reserve(self, row: int, upto: int) -> None:
        """Blocks for positions 0..upto-1 of ``row`` (``kv_blocks.OutOfBlocks`` if the
        pool lacks them)."""
        self.reserve_rows([(row, upto)])

    def reserve_rows(self, needs: Sequence[tuple[int, int]]) -> None:
        """``reserve`` for every (row, upto) of ``needs``; the blocks taken fresh are
        zeroed together, one device call per pool whatever the rows."""
        for row, upto in needs:
            self.pool.reserve(row, upto)
        self._fresh()

    def can_reserve(self, needs: Sequence[tuple[int, int]]) -> bool:
        return sum(self.pool.need(r, u) for r, u in needs) <= self.pool.free_count

    def trim(self, row: int, upto: int) -> None:
        self.pool.trim(row, upto)

    def free_row(self, row: int) -> None:
        self.pool.free_row(row)

    # ---------------------------------------------------------------- reads / writes
    def _where(self, rows, positions: torch.Tensor, row_index) -> tuple[torch.Tensor, ...]:
        table = self.pool.flush()
        tb = table[rows]
        bi = row_index if row_index is not None else \
            torch.arange(positions.shape[0], device=positions.device)[:, None]
        blk = tb[bi, torch.div(positions, self.block_size, rounding_mode="floor")]
        return tb, blk, positions % self.block_size

    def _gather(self, pool: torch.Tensor, tb: torch.Tensor, span: int) -> torch.Tensor:
        """[B, kv_heads, span, head_dim] of the rows whose tables are ``tb`` [B, blocks]."""
        nb = blocks_for(span, self.block_size)
        x = pool[tb[:, :nb]]  # [B, nb, g, bs, d] ("bsgd": [B, nb, bs, g, d])
        if self.layout == "bgsd":
            b, _, g, bs, d = x.shape
            return x.transpose(1, 2).reshape(b, g, nb * bs, d)[:, :, :span]
        b, _, bs, g, d = x.shape
        return x.reshape(b, nb * bs, g, d)[:, :span].transpose(1, 2)

    def _at(self, t: torch.Tensor, blk: torch.Tensor, off: torch.Tensor) -> torch.Tensor:
        """[L, P, kv_heads, head_dim]: pool ``t``'s entries at blocks ``blk`` [P],
        offsets ``off`` [P] (a copy)."""
        return t[:, blk, :, off].transpose(0, 1) if self.layout == "bgsd" else t[:, blk, off]

    def _put(self, t: torch.Tensor, blk: torch.Tensor, off: torch.Tensor,
             x: torch.Tensor) -> None:
        """``_at``'s entries of pool ``t`` set to x [L, P, kv_heads, head_dim]."""
        if self.layout == "bgsd":
            t[:, blk, :, off] = x.transpose(0, 1).to(t.dtype)
        else:
            t[:, blk, off] = x.to(t.dtype)

    def write(self, layer: int, rows, positions: torch.Tensor, k: torch.Tensor,
              v: torch.Tensor, span: Optional[int] = None,
              row_index: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
        """``KVCache.write``: k, v [B, T, kv_heads, head_dim] at ``positions`` [B, T] of
        ``rows`` (a slice or a row-index tensor); returns K and V gathered over
        positions 0..span-1, [B, kv_heads, span, head_dim]."""
        tb, blk, off = self._where(rows, positions, row_index)
        kp, vp = self.k[layer], self.v[layer]
        if self.layout == "bgsd":
            kp[blk, :, off] = k.to(kp.dtype)
            vp[blk, :, off] = v.to(vp.dtype)
        else:
            kp[blk, off] = k.to(kp.dtype)
            vp[blk, off] = v.to(vp.dtype)
        span = self.capacity if span is None else span
        return self._gather(kp, tb, span), self._gather(vp, tb, span)

    def block_table(self) -> torch.Tensor:
        """The block table [max_batch, blocks per row] (int64, brought up to date): the
        fused CPU kernels read the pools in place through it (``cpu_kernels``)."""
        return self.pool.flush()

    def rows_view(self, layer: int, rows: slice):
        raise NotImplementedError("the paged KV cache has no contiguous rows "
                                  "(rollout.kv_cache=paged runs attention over gathered "
                                  "blocks, or flash-attn through the block tables)")

    def tables(self, rows: slice) -> torch.Tensor:
        """The block tables of ``rows`` on the device [rows, max_blocks_per_row] (the
        fixed-shape table's rows: no host read; int32 in the "bsgd" layout)."""
        return self.pool.flush()[rows]

    def record_routes(self, moe_layer: int, rows, positions: torch.Tensor,
                      idx: torch.Tensor) -> None:
        """The experts ``idx`` [tokens, k] chosen at (``rows``, ``positions``) (a slice
        with positions [B, T], or per-token row indices with positions [tokens])."""
        if self.routes is None:
            return
        table = self.pool.flush()
        if isinstance(rows, slice):
            tb = table[rows]
            bi = torch.arange(positions.shape[0], device=positions.device)[:, None]
            blk = tb[bi, torch.div(positions, self.block_size, rounding_mode="floor")]
        else:
            blk = table[rows, torch.div(positions, self.block_size, rounding_mode="floor")]
        off = positions % self.block_size
        self.routes[moe_layer][blk.reshape(-1), off.reshape(-1)] = \
            idx.reshape(-1, idx.shape[-1]).to(torch.int16)

    def _row_positions(self, row: int, pos: torch.Tensor):
        table = self.pool.flush()
        return table[row, torch.div(pos, self.block_size, rounding_mode="floor")], \
            pos % self.block_size

    def row_routes(self, row: int, length: int) -> Optional[torch.Tensor]:
        """[length, MoE layers, k] of row ``row``'s first ``length`` positions."""
        if self.routes is None:
            return None
        blk, off = self._row_positions(row, torch.arange(length, device=self.device))
        return self.routes[:, blk, off].transpose(0, 1).contiguous()

    def read_features(self, row: int, lo: int, hi: int) -> torch.Tensor:
        """Row ``row``'s features at positions lo..hi-1, [hi - lo, F] (a copy)."""
        blk, off = self._row_positions(row, torch.arange(lo, hi, device=self.device))
        return self.feat[blk, off]

    def write_features(self, rows: torch.Tensor, positions: torch.Tensor,
                       values: torch.Tensor) -> None:
        """Features ``values`` [N, F] at (``rows``, ``positions``) [N] (blocks reserved)."""
        table = self.pool.flush()
        blk = table[rows, torch.div(positions, self.block_size, rounding_mode="floor")]
        self.feat[blk, positions % self.block_size] = values.to(self.feat.dtype)

    def span(self, which: str, row: int, lo: int, hi: int) -> torch.Tensor:
        """Row ``row``'s keys ("k") or values ("v") at positions lo..hi-1 as
        [layers, kv_heads, hi - lo, head_dim] (a copy)."""
        t = self.k if which == "k" else self.v
        blk, off = self._row_positions(row, torch.arange(lo, hi, device=self.device))
        return self._at(t, blk, off).transpose(1, 2)  # [L, P, g, d] -> [L, g, P, d]

    def copy_positions(self, other, row: int, lo: int, hi: int) -> None:
        """Positions lo..hi-1 of ``other``'s row ``row`` into this cache's row ``row``
        (its blocks reserved)."""
        if hi <= lo:
            return
        blk, off = self._row_positions(row, torch.arange(lo, hi, device=self.device))
        for which, t in (("k", self.k), ("v", self.v)):
            self._put(t, blk, off, other.span(which, row, lo, hi).transpose(1, 2))

    def move_positions(self, row: int, src: Sequence[int], dst: Sequence[int]) -> None:
        """Keys, values and routes of row ``row`` at positions ``src`` to ``dst``
        (tree compaction)."""
        s_blk, s_off = self._row_positions(row, torch.tensor(list(src), device=self.device))
        d_blk, d_off = self._row_positions(row, torch.tensor(list(dst), device=self.device))
        for t in (self.k, self.v):
            self._put(t, d_blk, d_off, self._at(t, s_blk, s_off))
        if self.routes is not None:
            self.routes[:, d_blk, d_off] = self.routes[:, s_blk, s_off]

    def move_row(self, src: int, dst: int, length: int) -> None:
        """Row ``src``'s blocks become row ``dst``'s (a table swap; ``dst``'s returned)."""
        self.pool.move(src, dst)

    def copy_row(self, src: int, dst, length: int) -> None:
        """Rows ``dst`` (indices) share row ``src``'s first ``length`` positions: full
        blocks by reference, the partly filled last one copied."""
        dst = dst.tolist() if isinstance(dst, torch.Tensor) else list(dst)
        if length <= 0 or not dst:
            return
        pairs = self.pool.share(src, dst, length)
        self._fresh()
        if pairs:
            s, d = (torch.tensor(x, device=self.device) for x in zip(*pairs))
            for t in (self.k, self.v):
                t[:, d] = t[:, s]
            if self.routes is not None:
                self.routes[:, d] = self.routes[:, s]
            if self.feat is not None:
                self.feat[d] = self.feat[s]
