"""A pure-torch stand-in for flash-attn's ``flash_attn_with_kvcache`` (written from its
documented contract, for the CPU suite: flash-attn needs CUDA), and ``use_fake_flash``,
which makes ``megatron_tlt.rollout.flash`` choose and call it on the CPU in float32.

The contract (flash-attn 2.x's docstring and argument checks):

- q [batch, seqlen_q, nheads, headdim]; k_cache, v_cache [batch_cache, seqlen_cache,
  nheads_k, headdim] without a block table, or [num_blocks, page_block_size, nheads_k,
  headdim] with ``block_table`` [batch, max_blocks_per_seq] int32 (a paged cache;
  page_block_size a multiple of the page multiple, 256 in flash-attn 2.x: ``page``
  here, so a test can stand for a build with smaller pages); nheads a multiple of
  nheads_k (query head h reads KV head h // (nheads / nheads_k));
- k, v [batch, seqlen_new, nheads_k, headdim], when given, are written into the cache
  in place at positions cache_seqlens[b] .. cache_seqlens[b] + seqlen_new - 1 of row b
  (through the block table when paged); the cache must hold them;
- cache_seqlens: an int or [batch] int32; row b then holds cache_seqlens[b] (+
  seqlen_new) keys;
- causal: the mask is aligned to the bottom right: query i of row b sees keys
  j <= i + seqlen_k[b] - seqlen_q; a query that sees no key outputs zeros;
- softmax_scale (default headdim^-0.5); the output has q's shape and dtype.

Nothing else (rotary embedding, cache_batch_idx, left padding, windows, softcap, ALiBi,
the log-sum-exp) is implemented: those arguments must keep their defaults.
"""

from __future__ import annotations

from typing import Optional, Union

import torch


def make_fake(page: int = 256):
    """A ``flash_attn_with_kvcache`` whose paged caches need page_block_size % ``page``
    == 0. Each call is recorded in the returned function's ``calls`` (paged or not,
    seqlen_q)."""
    calls: list[tuple[bool, int]] = []

    def flash_attn_with_kvcache(q, k_cache, v_cache, k=None, v=None, rotary_cos=None,
                                rotary_sin=None,
                                cache_seqlens: Optional[Union[int, torch.Tensor]] = None,
                                cache_batch_idx=None, cache_leftpad=None,
                                block_table: Optional[torch.Tensor] = None,
                                softmax_scale=None, causal=False, window_size=(-1, -1),
                                softcap=0.0, rotary_interleaved=True, alibi_slopes=None,
                                num_splits=0, return_softmax_lse=False):
        assert rotary_cos is None and rotary_sin is None and cache_batch_idx is None
        assert cache_leftpad is None and alibi_slopes is None and softcap == 0.0
        assert tuple(window_size) == (-1, -1) and not return_softmax_lse
        assert k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1
        b, sq, h, d = q.shape
        hk = k_cache.shape[2]
        assert h % hk == 0 and k_cache.shape[-1] == d and v_cache.shape == k_cache.shape
        assert k_cache.dtype == q.dtype == v_cache.dtype
        paged = block_table is not None
        if paged:
            assert block_table.dtype == torch.int32 and block_table.stride(-1) == 1
            assert block_table.shape[0] == b
            bs = k_cache.shape[1]
            assert bs % page == 0, f"Paged KV cache block size must be divisible by {page}"
            seqlen_cache = block_table.shape[1] * bs
        else:
            assert k_cache.shape[0] >= b
            seqlen_cache = k_cache.shape[1]
        calls.append((paged, sq))
        if cache_seqlens is None:
            cache_seqlens = 0
        if isinstance(cache_seqlens, int):
            cache_seqlens = torch.full((b,), cache_seqlens, dtype=torch.int32)
        assert cache_seqlens.dtype == torch.int32 and cache_seqlens.shape == (b,)
        lens = cache_seqlens.long().to(q.device)
        rows = torch.arange(b, device=q.device)[:, None]

        def where(pos: torch.Tensor):  # [b, P] positions -> cache indices
            if paged:
                bt = block_table.long()
                return bt[rows, torch.div(pos, bs, rounding_mode="floor")], pos % bs
            return rows.expand_as(pos), pos

        new = 0
        if k is not None:
            assert v is not None and k.shape == (b, k.shape[1], hk, d) and v.shape == k.shape
            new = k.shape[1]
            pos = lens[:, None] + torch.arange(new, device=q.device)
            assert int(pos.max()) < seqlen_cache, "the cache must hold the new keys"
            i, j = where(pos)
            k_cache[i, j] = k.to(k_cache.dtype)
            v_cache[i, j] = v.to(v_cache.dtype)
        seqlen_k = lens + new  # [b]
        span = int(seqlen_k.max()) if b else 0
        i, j = where(torch.arange(span, device=q.device)[None, :].expand(b, span))
        keys = k_cache[i, j].float()  # [b, span, hk, d]
        vals = v_cache[i, j].float()
        rep = h // hk
        keys = keys.repeat_interleave(rep, dim=2)  # [b, span, h, d]
        vals = vals.repeat_interleave(rep, dim=2)
        scale = d ** -0.5 if softmax_scale is None else softmax_scale
        s = torch.einsum("bqhd,bkhd->bhqk", q.float(), keys) * scale
        kpos = torch.arange(span, device=q.device)
        see = kpos[None, None, :] < seqlen_k[:, None, None]  # [b, 1, span]
        if causal:
            qi = torch.arange(sq, device=q.device)
            see = see & (kpos[None, None, :] <= qi[None, :, None]
                         + (seqlen_k - sq)[:, None, None])  # [b, sq, span]
        see = see[:, None].expand(b, h, sq, span)
        s = s.masked_fill(~see, float("-inf"))
        p = torch.softmax(s, dim=-1).nan_to_num(0.0)  # a row that sees nothing: zeros
        out = torch.einsum("bhqk,bkhd->bqhd", p, vals)
        return out.to(q.dtype)

    flash_attn_with_kvcache.calls = calls
    return flash_attn_with_kvcache


def use_fake_flash(monkeypatch, page: int = 256):
    """Make ``rollout.attention=flash`` (and auto) run ``make_fake(page)`` on this
    machine, and the config take paged blocks of a multiple of ``page``. Returns the
    fake (its ``calls``)."""
    from megatron_tlt.config import sections
    from megatron_tlt.rollout import flash

    fake = make_fake(page)
    monkeypatch.setattr(flash, "available", lambda device, dtype: True)
    monkeypatch.setattr(flash, "kernel", lambda: fake)
    monkeypatch.setattr(sections, "FLASH_PAGE_MULTIPLE", page)
    monkeypatch.setattr(flash, "FLASH_PAGE_MULTIPLE", page)
    return fake
