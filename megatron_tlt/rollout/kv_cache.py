"""A contiguous per-sequence KV cache: one row per running sequence.

Memory is fixed when the cache is made and bounded by its shape:

    2 (K and V) x layers x max_batch x kv_heads_per_tp_rank x capacity x head_dim x dtype size

where ``capacity`` is the longest prompt + new tokens the engine admits. Rows 0..n-1
hold the n running sequences; when a sequence finishes, the last running row is moved
into its place (``move_row``), so the running batch is always a contiguous slice and
attention reads a view of the cache, never a gathered copy.

Lifecycle: the cache object outlives its memory. ``release()`` frees the K and V
tensors (the rollout engine does so before the policy update, ``rollout.memory``) and
``allocate()`` makes them again, zeroed, with the same shape; ``generation`` counts the
allocations, so whatever holds addresses inside the cache (CUDA graphs) can tell a
re-made cache from the one it captured. ``allocate(upto)`` zeroes only positions
0..upto-1 of every row (``zeroed``), the span a call can reach; a later call that
reaches further zeroes the rest of its span first. On the CPU the positions beyond are
then never touched, so the operating system never maps their pages: a cache sized for
the configured longest prompt costs what this rollout's sequences reach (re-making a
released 1 GB cache page by page took seconds per rollout on the 2-core machine). Every
read stays below the zeroed span, so the cache never holds a non-finite value that a
masked position could turn into a NaN.

Layouts: "bgsd" (batch, kv heads, positions, head dim) for torch scaled_dot_product
attention; "bsgd" (batch, positions, kv heads, head dim) for flash-attn's KV-cache
kernel.

Routes (mixture-of-experts models, ``routes=(moe_layers, k)``): beside K and V, the
experts each position's token was routed to, ``routes`` [MoE layers, rows, capacity, k]
int16, written by the forward like the keys and moved, copied, released with them
(``rollout.experts``; a finished row's are read by ``row_routes``).
"""

from __future__ import annotations

from typing import Optional

import torch

LAYOUTS = ("bgsd", "bsgd")


def kv_bytes(*, num_layers: int, rows: int, kv_heads: int, capacity: int, head_dim: int,
             itemsize: int) -> int:
    """Bytes of a cache of this shape (K and V): the one formula the engine's caches
    and the dry run's memory model share."""
    return 2 * num_layers * rows * kv_heads * capacity * head_dim * itemsize


class KVCache:
    paged = False  # (``kv_paged.PagedKVCache``: blocks and tables)

    def __init__(self, *, num_layers: int, max_batch: int, kv_heads: int, capacity: int,
                 head_dim: int, dtype: torch.dtype, device: torch.device,
                 layout: str = "bgsd", upto: Optional[int] = None,
                 routes: Optional[tuple[int, int]] = None):
        if layout not in LAYOUTS:
            raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
        self.layout = layout
        self.max_batch, self.capacity = max_batch, capacity
        if layout == "bgsd":
            self.shape = (num_layers, max_batch, kv_heads, capacity, head_dim)
        else:
            self.shape = (num_layers, max_batch, capacity, kv_heads, head_dim)
        self.dtype, self.device = dtype, device
        self.k: Optional[torch.Tensor] = None
        self.v: Optional[torch.Tensor] = None
        self.route_shape = None if routes is None else (routes[0], max_batch, capacity,
                                                        routes[1])
        self.routes: Optional[torch.Tensor] = None
        self.generation = 0  # allocations so far
        self.zeroed = 0  # positions 0..zeroed-1 of every row hold finite values
        self.allocate(upto)

    # ---------------------------------------------------------------- lifecycle
    @property
    def allocated(self) -> bool:
        return self.k is not None

    def allocate(self, upto: Optional[int] = None) -> "KVCache":
        """Make the K and V tensors if released, zeroed at positions 0..upto-1 of every
        row (all positions without ``upto``); on an allocated cache, zero the positions
        of that span not zeroed yet."""
        want = self.capacity if upto is None else max(0, min(int(upto), self.capacity))
        if self.k is None:
            make = torch.zeros if want >= self.capacity else torch.empty
            self.k = make(self.shape, dtype=self.dtype, device=self.device)
            self.v = make(self.shape, dtype=self.dtype, device=self.device)
            self.zeroed = self.capacity if make is torch.zeros else 0
            self.generation += 1
            if self.route_shape is not None:
                self.routes = torch.zeros(self.route_shape, dtype=torch.int16,
                                          device=self.device)
        if want > self.zeroed:
            lo = self.zeroed
            for c in (self.k, self.v):
                (c[:, :, :, lo:want] if self.layout == "bgsd" else c[:, :, lo:want]).zero_()
            self.zeroed = want
        return self

    def release(self) -> None:
        """Free the K and V tensors; ``allocate`` makes them again."""
        self.k = self.v = self.routes = None
        self.zeroed = 0

    @staticmethod
    def bytes_needed(*, num_layers: int, max_batch: int, kv_heads: int, capacity: int,
                     head_dim: int, dtype: torch.dtype) -> int:
        return kv_bytes(num_layers=num_layers, rows=max_batch, kv_heads=kv_heads,
                        capacity=capacity, head_dim=head_dim,
                        itemsize=torch.empty((), dtype=dtype).element_size())

    @property
    def nbytes(self) -> int:
        """Bytes held now (0 when released)."""
        if self.k is None:
            return 0
        routes = 0 if self.routes is None else self.routes.numel() * 2
        return 2 * self.k.numel() * self.k.element_size() + routes

    def fits(self, max_batch: int, capacity: int) -> bool:
        return self.max_batch >= max_batch and self.capacity >= capacity

    def write(self, layer: int, rows: slice, positions: torch.Tensor, k: torch.Tensor,
              v: torch.Tensor, span: Optional[int] = None,
              row_index: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Store k, v [B, T, kv_heads, head_dim] at ``positions`` [B, T] of ``rows``.

        Returns K and V views of those rows over positions 0..span-1 in "bgsd" order.
        ``row_index`` (arange(B)[:, None]) may be passed to save making it per layer.
        """
        if not isinstance(rows, slice):
            raise TypeError("KVCache.write takes a slice of rows (running rows are contiguous)")
        kc, vc = self.k[layer, rows], self.v[layer, rows]
        bi = row_index if row_index is not None else \
            torch.arange(positions.shape[0], device=positions.device)[:, None]
        if self.layout == "bgsd":
            kc[bi, :, positions] = k.to(kc.dtype)
            vc[bi, :, positions] = v.to(vc.dtype)
            if span is not None:
                kc, vc = kc[:, :, :span], vc[:, :, :span]
            return kc, vc
        kc[bi, positions] = k.to(kc.dtype)
        vc[bi, positions] = v.to(vc.dtype)
        if span is not None:
            kc, vc = kc[:, :span], vc[:, :span]
        return kc.transpose(1, 2), vc.transpose(1, 2)

    # the paged cache's block lifecycle: nothing to do for fixed slots
    def reserve(self, row: int, upto: int) -> None:
        pass

    def reserve_rows(self, needs) -> None:
        pass

    def can_reserve(self, needs) -> bool:
        return True

    def trim(self, row: int, upto: int) -> None:
        pass

    def free_row(self, row: int) -> None:
        pass

    @property
    def bytes_in_use(self) -> int:
        return self.nbytes

    def record_routes(self, moe_layer: int, rows, positions: torch.Tensor,
                      idx: torch.Tensor) -> None:
        """The experts ``idx`` chosen at (``rows``, ``positions``) (``experts.record``)."""
        if self.routes is None:
            return
        store = self.routes[moe_layer]
        if isinstance(rows, slice):
            b, t = positions.shape
            bi = torch.arange(b, device=positions.device)[:, None]
            store[rows][bi, positions] = idx.view(b, t, -1).to(store.dtype)
        else:
            store[rows, positions] = idx.to(store.dtype)

    def move_positions(self, row: int, src, dst) -> None:
        """Keys, values and routes of row ``row`` at positions ``src`` to ``dst``."""
        s = torch.tensor(list(src), device=self.k.device)
        d = torch.tensor(list(dst), device=self.k.device)
        for c in (self.k, self.v):
            if self.layout == "bgsd":
                c[:, row, :, d] = c[:, row, :, s]
            else:
                c[:, row, d] = c[:, row, s]
        if self.routes is not None:
            self.routes[:, row, d] = self.routes[:, row, s]

    def rows_view(self, layer: int, rows: slice) -> tuple[torch.Tensor, torch.Tensor]:
        """Raw (layout-ordered) K and V views of ``rows`` for attention kernels."""
        return self.k[layer, rows], self.v[layer, rows]

    def move_row(self, src: int, dst: int, length: int) -> None:
        """Copy the first ``length`` positions of row ``src`` into row ``dst``."""
        if src == dst or length <= 0:
            return
        if self.layout == "bgsd":
            self.k[:, dst, :, :length] = self.k[:, src, :, :length]
            self.v[:, dst, :, :length] = self.v[:, src, :, :length]
        else:
            self.k[:, dst, :length] = self.k[:, src, :length]
            self.v[:, dst, :length] = self.v[:, src, :length]
        if self.routes is not None:
            self.routes[:, dst, :length] = self.routes[:, src, :length]

    def row_routes(self, row: int, length: int) -> Optional[torch.Tensor]:
        """A copy of row ``row``'s experts at positions 0..length-1 [length, MoE layers,
        k], on the cache's device (None without routes)."""
        if self.routes is None:
            return None
        return self.routes[:, row, :length].transpose(0, 1).clone(
            memory_format=torch.contiguous_format)

    def span(self, which: str, row: int, lo: int, hi: int) -> torch.Tensor:
        """A view of row ``row``'s keys (``which`` "k") or values ("v") at positions
        lo..hi-1 as [layers, kv_heads, hi - lo, head_dim], whatever the layout."""
        t = self.k if which == "k" else self.v
        return t[:, row, :, lo:hi] if self.layout == "bgsd" else t[:, row, lo:hi].transpose(1, 2)

    def copy_positions(self, other: "KVCache", row: int, lo: int, hi: int) -> None:
        """Positions lo..hi-1 of ``other``'s row ``row`` (same layers, heads and head
        size; either layout) into this cache's row ``row``."""
        if hi > lo:
            for which in ("k", "v"):
                self.span(which, row, lo, hi).copy_(other.span(which, row, lo, hi))

    def copy_row(self, src: int, dst: torch.Tensor, length: int) -> None:
        """Copy the first ``length`` positions of row ``src`` into every row of ``dst``
        (a tensor of row indices on the cache's device, ``src`` not among them): one
        broadcast write per K and V, no temporary of the copies' size."""
        if length <= 0 or dst.numel() == 0:
            return
        for c in (self.k, self.v):
            if self.layout == "bgsd":
                c[:, dst, :, :length] = c[:, src: src + 1, :, :length]
            else:
                c[:, dst, :length] = c[:, src: src + 1, :length]
        if self.routes is not None:
            self.routes[:, dst, :length] = self.routes[:, src: src + 1, :length]


def reuse_or_make(cache: Optional[KVCache], *, max_batch: int, capacity: int,
                  upto: Optional[int] = None, **shape) -> KVCache:
    """``cache`` (re-allocated if it was released) when it holds ``max_batch`` rows of
    ``capacity`` positions; otherwise its tensors are freed first and a new cache of that
    size is made (``shape``: KVCache's other arguments). ``upto``: the positions this
    call can reach, zeroed (``KVCache.allocate``; None: all)."""
    if cache is not None and cache.fits(max_batch, capacity):
        return cache.allocate(upto)
    if cache is not None:
        cache.release()
    return KVCache(max_batch=max_batch, capacity=capacity, upto=upto, **shape)
