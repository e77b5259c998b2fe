"""The paged KV cache (rollout.kv_cache=paged) on its own: block accounting, reference
counts, a GRPO group's shared prompt, copy-on-write of the partly filled last block,
blocks returned on finish and rollback, and reads equal to the contiguous cache's
(``KVCache``) for the same writes, moves and copies."""

from __future__ import annotations

import pytest
import torch

from megatron_tlt.rollout.kv_blocks import SCRATCH, BlockPool, OutOfBlocks, blocks_for
from megatron_tlt.rollout.kv_cache import KVCache
from megatron_tlt.rollout.kv_paged import PagedKVCache

L, G, D, BS = 2, 2, 4, 16
CPU = torch.device("cpu")


def _paged(rows=8, capacity=320, blocks=200, routes=None, lazy_zero=True):
    return PagedKVCache(num_layers=L, max_batch=rows, kv_heads=G, capacity=capacity,
                        head_dim=D, dtype=torch.float32, device=CPU, num_blocks=blocks,
                        block_size=BS, routes=routes, lazy_zero=lazy_zero)


def _slots(rows=8, capacity=320, routes=None):
    return KVCache(num_layers=L, max_batch=rows, kv_heads=G, capacity=capacity, head_dim=D,
                   dtype=torch.float32, device=CPU, routes=routes)


def _fill(caches, rows: slice, start: list[int], t: int, seed: int):
    """The same random keys and values at start[b]..start[b]+t-1 of ``rows`` in every
    cache; returns each cache's K and V over span = max(start) + t."""
    g = torch.Generator().manual_seed(seed)
    b = len(start)
    k = torch.randn(b, t, G, D, generator=g)
    v = torch.randn(b, t, G, D, generator=g)
    pos = torch.tensor(start)[:, None] + torch.arange(t)[None, :]
    span = max(start) + t
    out = []
    for c in caches:
        for r, s in zip(range(rows.start, rows.stop), start):
            c.reserve(r, s + t)
        out.append([c.write(layer, rows, pos, k, v, span) for layer in range(L)])
    return out


def _assert_rows_equal(a, b, rows, lengths):
    """Rows' keys and values at their first ``lengths`` positions, in both caches."""
    for r, n in zip(rows, lengths):
        for which in ("k", "v"):
            torch.testing.assert_close(a.span(which, r, 0, n), b.span(which, r, 0, n),
                                       rtol=0, atol=0)


def test_pool_accounting_reserve_trim_free():
    p = BlockPool(num_blocks=10, block_size=4, max_rows=3, max_blocks_per_row=5, device=CPU)
    assert p.usable == 9 and p.free_count == 9
    p.reserve(0, 5)  # 2 blocks
    p.reserve(1, 4)  # 1 block
    assert p.used == 3 and p.tables[0] == [1, 2] and p.tables[1] == [3]
    assert p.host[0].tolist() == [1, 2, SCRATCH, SCRATCH, SCRATCH]
    p.reserve(0, 8)  # still 2 blocks
    assert p.used == 3
    p.reserve(0, 13)  # 4 blocks: a speculative step's k + 1 positions
    assert p.used == 5
    p.trim(0, 6)  # rollback to 6 positions: 2 blocks kept
    assert p.used == 3 and len(p.tables[0]) == 2
    p.reserve(1, 16)  # 4 blocks
    with pytest.raises(OutOfBlocks):
        p.reserve(2, 20)  # 5 blocks, 3 free: nothing taken
    assert p.used == 6 and p.tables[2] == []
    p.free_row(0)
    p.free_row(1)
    assert p.used == 0 and p.free_count == 9 and (p.host == SCRATCH).all()
    assert p.peak_used == 6


def test_move_row_is_a_table_swap():
    p = BlockPool(num_blocks=10, block_size=4, max_rows=3, max_blocks_per_row=4, device=CPU)
    p.reserve(0, 4)
    p.reserve(2, 8)
    held = list(p.tables[2])
    p.move(2, 0)  # row 0 finished: its block returned, row 2's table moves
    assert p.tables[0] == held and p.tables[2] == [] and p.used == 2
    assert p.host[0, :2].tolist() == held and (p.host[2] == SCRATCH).all()


@pytest.mark.parametrize("plen", [256, 250])
def test_a_group_of_8_stores_its_prompt_once(plen):
    """G = 8 rows of a 256-token prompt hold 16 blocks (the prompt once); with a partly
    filled last block each row holds a private copy of it (copy-on-write)."""
    c = _paged(rows=8, capacity=512, blocks=64)
    g = torch.Generator().manual_seed(0)
    c.reserve(0, plen)
    pos = torch.arange(plen)[None]
    for layer in range(L):
        c.write(layer, slice(0, 1), pos, torch.randn(1, plen, G, D, generator=g),
                torch.randn(1, plen, G, D, generator=g), plen)
    c.copy_row(0, torch.arange(1, 8), plen)
    full, part = divmod(plen, BS)
    assert c.pool.used == full + (8 if part else 0)
    assert c.bytes_in_use == c.pool.used * c.block_nbytes
    for r in range(1, 8):
        assert c.pool.tables[r][:full] == c.pool.tables[0][:full]
        for which in ("k", "v"):
            torch.testing.assert_close(c.span(which, r, 0, plen), c.span(which, 0, 0, plen),
                                       rtol=0, atol=0)
    # each row writes its own response: the source's positions stay as they were
    before = c.span("k", 0, 0, plen).clone()
    for r in range(8):
        c.reserve(r, plen + 1)
    new = torch.randn(8, 1, G, D, generator=g)
    for layer in range(L):
        c.write(layer, slice(0, 8), torch.full((8, 1), plen), new, new, plen + 1)
    torch.testing.assert_close(c.span("k", 0, 0, plen), before, rtol=0, atol=0)
    for r in range(8):
        torch.testing.assert_close(c.span("k", r, plen, plen + 1)[:, :, 0],
                                   new[r, 0][None].expand(L, G, D), rtol=0, atol=0)
    assert c.pool.used == full + 8  # the prompt once + a block per response
    # the source finishes first: its shared blocks stay with the copies
    shared = c.pool.tables[1][:full]
    c.free_row(0)
    assert all(c.pool.refs[b] == 7 for b in shared)
    for r in range(1, 8):
        c.free_row(r)
    assert c.pool.used == 0


def test_paged_reads_equal_the_contiguous_cache():
    """The same writes, moves (retire) and copies (shared prompts), then reads of every
    row: the paged cache's gathered K and V equal the slot cache's views."""
    s, p = _slots(), _paged()
    (ws, wp) = _fill([s, p], slice(0, 4), [0, 0, 0, 0], 37, seed=1)  # a prefill
    for (ks, vs), (kp, vp) in zip(ws, wp):
        torch.testing.assert_close(kp, ks, rtol=0, atol=0)
        torch.testing.assert_close(vp, vs, rtol=0, atol=0)
    lengths = [37, 37, 37, 37]
    for step in range(20):  # decode steps, ragged lengths
        start = [n + (r % 2) * step for r, n in enumerate(lengths)]
        (ws, wp) = _fill([s, p], slice(0, 4), start, 1, seed=10 + step)
        lengths = [x + 1 for x in start]
        for (ks, vs), (kp, vp) in zip(ws, wp):
            for r, n in enumerate(lengths):  # positions a row holds
                torch.testing.assert_close(kp[r, :, :n], ks[r, :, :n], rtol=0, atol=0)
    _assert_rows_equal(s, p, range(4), lengths)
    for c in (s, p):  # row 1 finished: the last running row moves into its place
        c.free_row(1)
        c.move_row(3, 1, lengths[3])
    lengths = [lengths[0], lengths[3], lengths[2]]
    _assert_rows_equal(s, p, range(3), lengths)
    for c in (s, p):  # rows 3..5 share row 2's prompt (its first 37 positions)
        c.copy_row(2, torch.tensor([3, 4, 5]), 37)
    _assert_rows_equal(s, p, range(6), lengths + [37, 37, 37])
    # a tree's accepted nodes compacted
    for c in (s, p):
        c.reserve(0, lengths[0] + 6)
    _fill([s, p], slice(0, 1), [lengths[0]], 6, seed=99)
    for c in (s, p):
        c.move_positions(0, [lengths[0] + 2, lengths[0] + 5], [lengths[0] + 1, lengths[0] + 2])
    _assert_rows_equal(s, p, [0], [lengths[0] + 3])


def test_routes_follow_the_table():
    s, p = _slots(routes=(2, 3)), _paged(routes=(2, 3))
    g = torch.Generator().manual_seed(3)
    for c in (s, p):
        c.reserve(0, 20)
        c.reserve(1, 20)
    idx = torch.randint(0, 8, (2 * 20, 3), generator=g).to(torch.int16)
    pos = torch.arange(20)[None].expand(2, 20)
    for c in (s, p):
        c.record_routes(1, slice(0, 2), pos, idx)
        c.record_routes(0, torch.tensor([1]), torch.tensor([19]), idx[:1])
        c.copy_row(0, torch.tensor([2]), 18)
    for r, n in ((0, 20), (1, 20), (2, 18)):
        assert torch.equal(s.row_routes(r, n), p.row_routes(r, n))


def test_bytes_in_use_follow_tokens_and_unwritten_blocks_cost_nothing():
    """Blocks held follow tokens within one block per row; the pool itself is made
    with empty pages, and a block is zeroed (its pages touched) only when handed out."""
    c = _paged(rows=8, capacity=320, blocks=200)
    lengths = [1, 15, 16, 17, 100, 250, 3, 64]
    for r, n in enumerate(lengths):
        c.reserve(r, n)
    tokens = sum(lengths)
    held = c.pool.used * BS
    assert tokens <= held < tokens + len(lengths) * BS
    assert c.pool.used == sum(blocks_for(n, BS) for n in lengths)
    assert len(c._written) == c.pool.used + 1  # + the scratch block


def test_release_and_allocate_reset_the_pool():
    c = _paged()
    c.reserve(0, 40)
    c.release()
    assert c.nbytes == 0 and not c.allocated
    c.allocate()
    assert c.allocated and c.pool.used == 0 and c.generation == 2


def test_drafter_features_follow_the_rows_blocks():
    """The one-layer drafter's features per position in the target's blocks: written
    and read by position, shared with a group's copies (the partly filled last block
    copied), moved with the table, freed with the row; their bytes are the blocks'."""
    F = 6
    c = PagedKVCache(num_layers=L, max_batch=4, kv_heads=G, capacity=96, head_dim=D,
                     dtype=torch.float32, device=CPU, num_blocks=20, block_size=BS,
                     features=(F, torch.float32))
    plain = _paged(rows=4, capacity=96, blocks=20)
    assert c.nbytes - plain.nbytes == 20 * BS * F * 4
    c.reserve(0, 21)
    want = torch.randn(21, F)
    c.write_features(torch.zeros(21, dtype=torch.long), torch.arange(21), want)
    assert torch.equal(c.read_features(0, 0, 21), want)
    c.copy_row(0, [1, 2], 21)  # one shared full block, the partial one copied
    assert c.pool.used == 2 + 2
    for row in (1, 2):
        assert torch.equal(c.read_features(row, 0, 21), want)
    c.reserve(2, 23)
    c.write_features(torch.tensor([2, 2]), torch.tensor([21, 22]), torch.ones(2, F))
    assert torch.equal(c.read_features(0, 0, 21), want)  # the source's copy unchanged
    assert torch.equal(c.read_features(1, 16, 21), want[16:])
    c.free_row(0)
    c.move_row(2, 0, 23)
    assert torch.equal(c.read_features(0, 0, 21), want)
    assert torch.equal(c.read_features(0, 21, 23), torch.ones(2, F))
