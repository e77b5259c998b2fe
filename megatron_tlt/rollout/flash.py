"""flash-attn's KV-cache kernel (``rollout.attention=flash``): the choice and the call.

``flash_attn_with_kvcache(q, k_cache, v_cache, k=, v=, cache_seqlens=, block_table=,
causal=True)`` appends each row's new keys and values at positions
cache_seqlens[b].. (in place) and attends every new token causally over the row's
cached prefix and the new tokens up to itself (the mask aligned to the bottom right),
in one kernel:

- fixed slots (``kv_cache.KVCache``, layout "bsgd"): the caches are the running rows'
  contiguous views [rows, capacity, kv_heads, head_dim];
- the paged cache (``kv_paged.PagedKVCache``, layout "bsgd"): the caches are a layer's
  whole pools [num_blocks, block_size, kv_heads, head_dim] and ``block_table`` the rows'
  block tables [rows, max_blocks_per_row] (int32, the fixed-shape table: no gather, no
  host read). flash-attn 2.x (the ``gpu`` extra's floor 2.7.3 through 2.8.3, the newest
  release read) takes only blocks of a multiple of ``FLASH_PAGE_MULTIPLE`` (256)
  positions (``mha_fwd_kvcache`` checks ``page_block_size % 256 == 0``); the config
  refuses ``rollout.attention=flash`` with another ``rollout.kv_block_size``, and
  ``auto`` chooses SDPA over the gathered blocks then.

Tree verification (a mask among the new tokens) runs SDPA over ``cache.write``'s
gathered K and V in either case (``forward.ModelRunner.extend``).
"""

from __future__ import annotations

import torch

from ..config.sections import FLASH_PAGE_MULTIPLE


def available(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether flash-attn's kernel can run here: CUDA, a bfloat16/float16 model and
    the package installed."""
    if device.type != "cuda" or dtype not in (torch.bfloat16, torch.float16):
        return False
    try:
        import flash_attn  # noqa: F401
    except ImportError:
        return False
    return True


def kernel():
    """``flash_attn.flash_attn_with_kvcache`` (imported on first use)."""
    from flash_attn import flash_attn_with_kvcache

    return flash_attn_with_kvcache


def resolve_attention(cfg, device: torch.device, dtype: torch.dtype) -> str:
    """"flash" or "sdpa" for ``rollout.attention`` (``cfg``: the RolloutConfig, which
    already refused flash with a paged block size flash-attn does not take)."""
    choice = cfg.attention
    if choice == "sdpa":
        return "sdpa"
    has_flash = available(device, dtype)
    if choice == "flash":
        if not has_flash:
            raise ValueError("rollout.attention=flash needs CUDA, a bfloat16/float16 model "
                             "and the flash-attn package (pip install -e .[gpu]); use auto "
                             "or sdpa")
        return "flash"
    if cfg.kv_cache == "paged" and cfg.kv_block_size % FLASH_PAGE_MULTIPLE:
        return "sdpa"  # SDPA over the gathered blocks
    return "flash" if has_flash else "sdpa"


def attend(cache, layer: int, rows: slice, q: torch.Tensor, k: torch.Tensor,
           v: torch.Tensor, start: torch.Tensor, scale: float) -> torch.Tensor:
    """Layer ``layer``'s attention for ``rows`` (a slice): q [B, T, groups, heads per
    group, head_dim], the new k, v [B, T, groups, head_dim] written at positions
    start[b]..start[b]+T-1 of each row, causally. Returns [B, T, heads x head_dim]."""
    b, t = q.shape[:2]
    if cache.paged:
        kc, vc = cache.k[layer], cache.v[layer]
        paged = {"block_table": cache.tables(rows)}
    else:
        kc, vc = cache.rows_view(layer, rows)
        paged = {}
    o = kernel()(q.reshape(b, t, -1, q.shape[-1]), kc, vc, k=k.contiguous(),
                 v=v.contiguous(), cache_seqlens=start.to(torch.int32),
                 softmax_scale=scale, causal=True, **paged)
    return o.reshape(b, t, -1)
