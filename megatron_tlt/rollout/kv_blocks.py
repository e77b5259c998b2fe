"""The paged KV cache's block accounting (``rollout.kv_cache=paged``): host-side only.

A pool of ``num_blocks`` blocks of ``block_size`` positions; block 0 is the scratch
block (never handed out: the table entries of positions a row does not hold point to
it, so a fixed-shape read or a padding row's write lands there, as megatron-core's
dynamic context points its dummy requests at a dummy block). The others sit on a free
stack. Each row (a running sequence, 0..max_rows-1) has a block table: the list of its
blocks in position order, mirrored in a fixed-shape int64 tensor
[max_rows, max_blocks_per_row] (``table``; int32 where flash-attn reads it) that
attention and CUDA graphs read; host
changes mark it dirty and ``flush`` copies it to the device once.

Sharing: a block has a reference count. ``share(src, dst, length)`` gives ``dst`` the
full blocks of ``src``'s first ``length`` positions by reference, and a private block
for the partly filled last one, which the caller copies (copy-on-write done at share
time: a row only ever writes at positions >= its length, so the shared full blocks are
never written again). A block returns to the free stack when its last reference goes.

Nothing here touches K or V: ``kv_paged.PagedKVCache`` holds the pools.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

SCRATCH = 0  # the block every unheld table entry points to


class OutOfBlocks(RuntimeError):
    """The pool has fewer free blocks than a reservation needs."""


def blocks_for(positions: int, block_size: int) -> int:
    """Blocks that hold ``positions`` positions."""
    return -(-max(0, positions) // block_size)


class BlockPool:
    def __init__(self, *, num_blocks: int, block_size: int, max_rows: int,
                 max_blocks_per_row: int, device: torch.device,
                 index_dtype: torch.dtype = torch.long):
        if num_blocks < 2:
            raise ValueError("a block pool needs the scratch block and at least one more")
        self.num_blocks, self.block_size = num_blocks, block_size
        self.max_rows, self.max_blocks_per_row = max_rows, max_blocks_per_row
        self.device = device
        self.host = torch.full((max_rows, max_blocks_per_row), SCRATCH, dtype=index_dtype)
        self.table = self.host if device.type == "cpu" else self.host.to(device)
        self.reset()

    def reset(self) -> None:
        """Every block free, every table empty."""
        # a stack: the lowest ids are taken first (pages first touched in order)
        self.free = list(range(self.num_blocks - 1, 0, -1))
        self.refs = [0] * self.num_blocks
        self.tables: list[list[int]] = [[] for _ in range(self.max_rows)]
        self.host.fill_(SCRATCH)
        self.dirty = self.table is not self.host
        self.peak_used = 0
        self.fresh: list[int] = []  # blocks handed out since the last ``take_fresh``

    # ---------------------------------------------------------------- counts
    @property
    def usable(self) -> int:
        """Blocks rows can hold (all but the scratch block)."""
        return self.num_blocks - 1

    @property
    def free_count(self) -> int:
        return len(self.free)

    @property
    def used(self) -> int:
        return self.usable - len(self.free)

    def held(self, row: int) -> int:
        """Positions row ``row``'s blocks cover."""
        return len(self.tables[row]) * self.block_size

    def need(self, row: int, upto: int) -> int:
        """New blocks row ``row`` needs to hold positions 0..upto-1."""
        return max(0, blocks_for(upto, self.block_size) - len(self.tables[row]))

    # ---------------------------------------------------------------- changes
    def _take(self) -> int:
        if not self.free:
            raise OutOfBlocks(f"all {self.usable} KV blocks are in use")
        b = self.free.pop()
        self.refs[b] = 1
        self.fresh.append(b)
        return b

    def _drop(self, b: int) -> None:
        self.refs[b] -= 1
        if self.refs[b] == 0:
            self.free.append(b)

    def _set(self, row: int) -> None:
        t = self.tables[row]
        if len(t) > self.max_blocks_per_row:
            raise OutOfBlocks(f"row {row} would hold {len(t)} blocks; a row holds at most "
                              f"{self.max_blocks_per_row}")
        self.host[row, : len(t)] = torch.tensor(t, dtype=self.host.dtype)
        self.host[row, len(t):] = SCRATCH
        self.dirty = self.table is not self.host

    def reserve(self, row: int, upto: int) -> None:
        """Blocks for positions 0..upto-1 of ``row`` (upto capped at the table's width);
        all or nothing (``OutOfBlocks``)."""
        upto = min(upto, self.max_blocks_per_row * self.block_size)
        n = self.need(row, upto)
        if n == 0:
            return
        if n > len(self.free):
            raise OutOfBlocks(f"row {row} needs {n} more KV blocks, {len(self.free)} free")
        self.tables[row].extend(self._take() for _ in range(n))
        self.peak_used = max(self.peak_used, self.used)
        self._set(row)

    def trim(self, row: int, upto: int) -> None:
        """Return ``row``'s blocks past those holding positions 0..upto-1 (a rollback)."""
        keep = blocks_for(upto, self.block_size)
        t = self.tables[row]
        if len(t) > keep:
            for b in t[keep:]:
                self._drop(b)
            del t[keep:]
            self._set(row)

    def free_row(self, row: int) -> None:
        """Return all of ``row``'s blocks (a finished or preempted row)."""
        if self.tables[row]:
            for b in self.tables[row]:
                self._drop(b)
            self.tables[row] = []
            self._set(row)

    def move(self, src: int, dst: int) -> None:
        """Row ``src``'s table becomes ``dst``'s (whose blocks are returned first)."""
        if src == dst:
            return
        self.free_row(dst)
        self.tables[dst], self.tables[src] = self.tables[src], []
        self._set(dst)
        self._set(src)

    def share(self, src: int, dst: Sequence[int], length: int) -> list[tuple[int, int]]:
        """Give every row of ``dst`` (their blocks returned first) ``src``'s first
        ``length`` positions: the full blocks by reference, the partly filled last one
        as a private block. Returns the (source block, new block) pairs the caller
        copies."""
        full, part = divmod(length, self.block_size)
        if full + (1 if part else 0) > len(self.tables[src]):
            raise ValueError(f"row {src} holds {self.held(src)} positions, not {length}")
        for d in dst:
            self.free_row(d)
        if part and len(self.free) < len(dst):
            raise OutOfBlocks(f"{len(dst)} shared rows need a block each, "
                              f"{len(self.free)} free")
        copies = []
        shared = self.tables[src][:full]
        for d in dst:
            for b in shared:
                self.refs[b] += 1
            self.tables[d] = list(shared)
            if part:
                b = self._take()
                self.tables[d].append(b)
                copies.append((self.tables[src][full], b))
            self._set(d)
        self.peak_used = max(self.peak_used, self.used)
        return copies

    def take_fresh(self) -> list[int]:
        """The blocks handed out since the last call (the storage zeroes those it has
        never written)."""
        out, self.fresh = self.fresh, []
        return out

    def flush(self) -> Optional[torch.Tensor]:
        """The device table, brought up to date with the host's (one copy if changed)."""
        if self.dirty:
            self.table.copy_(self.host, non_blocking=True)
            self.dirty = False
        return self.table
