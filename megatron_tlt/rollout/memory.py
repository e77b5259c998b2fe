"""The rollout's memory and its lifecycle (``RolloutEngine.memory``).

What a rollout holds on its device beyond the model's weights:

- the target's KV cache (``KVCache``: K and V, [layers, rows, kv_heads/TP, positions,
  head_dim] each);
- with a drafter attached: the drafter's KV cache and its feature store (the target's
  hidden state at every cache row and position, ``SpeculativeDecoder.features``);
- with ``rollout.cuda_graphs``: the decode graphs captured on the cache and their
  memory pool (one per decoder, shared by its keys: the keys' outputs and the largest
  key's working set; the dry run models it, ``rl.memory_terms.graph_keys``);
- at PP > 1 in the gathered mode, the copies of the other stages' layers
  (``GatheredRunner``, re-sent from their owners at every ``generate``);
- the hidden states a call returns (``SamplingParams.return_hidden_states``: the drafter
  group's training data). There is one copy of them: when the drafter's features are
  the target's final hidden states (a drafter without EAGLE-3 feature layers) they are
  read from the feature store when a response finishes; only without a drafter, or
  with feature layers (other tensors), does a call keep a buffer of its responses'
  hidden states [rows, max_new_tokens, hidden] for the call's duration. Each finished
  response's rows are copied to the host once, when it finishes (at PP > 1 in the
  gathered mode: once per call, after the stages exchanged them on the device).

Sizing. An engine given a configured size (the RL trainer: prompts of at most
``data.max_prompt_tokens``, responses of at most ``grpo.max_new_tokens``, at most
``rollout.max_batch_size`` running rows, or fewer when a replica never runs that many)
allocates the caches and the feature store once, at that size, at its first
``generate``; they are never re-grown from the calls it sees, so their addresses (the
CUDA graphs') stay put between releases, and a request beyond the size is a
``PromptError``. An engine without one (``RolloutEngine.from_pretrained``, tools,
tests) sizes them from its calls and makes a larger cache when a call needs more (the
old one, and graphs captured on it, freed first).

Lifecycle. ``release()`` frees all of the above: the trainer calls it between the
rollout and the policy update (``rollout.release_memory``), so the update runs beside
the weights and only what the next rollout must keep: the cache objects without their
tensors, the rotary tables, the CPU kernels' weight panels (CPU float32 only), the
tuner's state and, in the gathered mode, the copies of the vocabulary matrices (the
drafter group's canary reads them after the update). The next ``generate`` makes them again, zeroed, with the same shapes;
CUDA graphs are re-captured, one per batch-size bucket, at the bucket's first step.
Under PyTorch's caching allocator the freed blocks go back to its pool, where the
update's activations and gradients reuse them.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from ..config import ConfigError
from .kv_blocks import blocks_for
from .kv_cache import KVCache
from .kv_paged import PagedKVCache, block_bytes


class PromptError(ValueError):
    """A prompt the engine cannot run (empty, out-of-vocabulary ids, too long, or
    longer than the cache this run was sized for)."""


class RolloutMemory:
    """The caches, feature store and graphs of one engine (the ``RolloutEngine`` that
    owns it, read for its runner, config and drafter; this module imports nothing of
    the engine), sized and released here."""

    def __init__(self, engine, *, max_prompt_tokens: Optional[int] = None,
                 max_new_tokens: Optional[int] = None, max_rows: Optional[int] = None):
        if (max_prompt_tokens is None) != (max_new_tokens is None):
            raise ValueError("a configured rollout size needs both max_prompt_tokens and "
                             "max_new_tokens")
        self.engine = engine
        self.fixed = max_prompt_tokens is not None
        self.max_prompt_tokens, self.max_new_tokens = max_prompt_tokens, max_new_tokens
        rows = min(max_rows or engine.config.max_batch_size, engine.config.max_batch_size)
        # PP > 1, gathered: each stage runs its share of the rows
        self.rows = max(1, engine.runner.call_rows(rows))
        self.capacity = (min(max_prompt_tokens + max_new_tokens, engine.context)
                         if self.fixed else 0)
        self.cache: Optional[KVCache] = None
        self._paged_key: Optional[tuple] = None  # (rows, positions, blocks) of a paged cache
        self.allocations = 0  # times the target's KV cache was made (tests, logs)

    # ---------------------------------------------------------------- sizing
    def check(self, prompts: Sequence[Sequence[int]], plist: Sequence) -> None:
        """Refuse requests beyond the configured size (nothing without one)."""
        if not self.fixed:
            return
        for i, p in enumerate(prompts):
            if len(p) > self.max_prompt_tokens:
                raise PromptError(
                    f"prompt {i} has {len(p)} tokens but this engine's memory is sized "
                    f"for prompts of at most {self.max_prompt_tokens} tokens "
                    "(data.max_prompt_tokens); shorten the prompt or raise the limit")
        for i, sp in enumerate(plist):
            if sp.max_new_tokens > self.max_new_tokens:
                raise PromptError(
                    f"request {i} asks for {sp.max_new_tokens} new tokens but this "
                    f"engine's memory is sized for {self.max_new_tokens} "
                    "(grpo.max_new_tokens)")

    def batch_rows(self, max_batch: int) -> int:
        """A call's running-batch bound under the configured rows."""
        return min(max_batch, self.rows) if self.fixed else max_batch

    def spec_shape(self, max_batch: int, capacity: int) -> tuple[int, int]:
        """(rows, positions) of the drafter's cache and feature store for a call."""
        return (self.rows, self.capacity) if self.fixed else (max_batch, capacity)

    # ---------------------------------------------------------------- the caches
    def kv_cache(self, max_batch: int, capacity: int, slack: int, drafters=None) -> KVCache:
        """The target's cache for a call of ``max_batch`` rows and ``capacity``
        positions (+ ``slack`` for drafts): the configured one, (re-)made if released.
        ``drafters`` (the call's ``SpeculationController``): with the paged cache, the
        drafters' own paged caches take their pools out of the same budget, and its
        blocks hold the drafter's features beside K and V."""
        eng = self.engine
        upto = self.reach(capacity, slack)
        if self.fixed:
            max_batch, capacity = self.rows, self.capacity
        # (CUDA graphs' largest bucket is the cache's rows: no rows are added for them)
        rows, need = max_batch, capacity + slack
        c = self.cache
        if eng.config.kv_cache == "paged":
            draft = 0 if drafters is None else drafters.paged_kv_bytes(
                max_batch, capacity, eng.config.kv_block_size)
            feats = None if drafters is None else drafters.paged_features()
            return self._paged(rows, need, draft, feats)
        if c is not None and c.fits(rows, need):
            if not c.allocated:
                self.allocations += 1
            return c.allocate(upto)
        if c is not None:  # a larger call (or a drafter needing more slack): grow
            rows, need = max(rows, c.max_batch), max(need, c.capacity)
            self._release_target()  # free the old one first
        self.cache = None
        self.cache = KVCache(
            num_layers=len(eng.runner.layers), max_batch=rows, kv_heads=eng.runner.groups,
            capacity=need, head_dim=eng.arch.kv_channels, dtype=eng.runner.dtype,
            device=eng.device, layout="bsgd" if eng.attention == "flash" else "bgsd",
            upto=upto, routes=eng.runner.route_shape)
        self.allocations += 1
        return self.cache

    def _paged(self, rows: int, need: int, draft_bytes: int = 0,
               features=None) -> PagedKVCache:
        """The paged cache (``rollout.kv_cache=paged``): ``rows`` rows in flight at most,
        of ``need`` positions each at most, in a pool of ``rollout.kv_cache_gib`` less
        the drafters' pools (``draft_bytes``; 0: what ``rows`` full-length slots
        reserve, the drafters' pools beside it); ``features``: (width, dtype) of the
        drafter's features each position holds too."""
        eng, cfg = self.engine, self.engine.config
        bs = cfg.kv_block_size
        per_block = block_bytes(num_layers=len(eng.runner.layers), kv_heads=eng.runner.groups,
                                block_size=bs, head_dim=eng.arch.kv_channels,
                                itemsize=torch.empty((), dtype=eng.runner.dtype).element_size(),
                                routes=eng.runner.route_shape, features=features)
        minimum = blocks_for(need, bs)  # one row of the longest prompt + its new tokens
        if cfg.kv_cache_gib > 0:
            blocks = int(max(0, cfg.kv_cache_gib * 2**30 - draft_bytes) // per_block)
            if blocks < minimum:
                drafters = (f" beside the drafters' caches ({draft_bytes} bytes)"
                            if draft_bytes else "")
                raise ConfigError(
                    f"rollout.kv_cache_gib={cfg.kv_cache_gib} holds {blocks} KV blocks of "
                    f"{bs} positions ({per_block} bytes each){drafters}, fewer than one "
                    f"row of the longest prompt and its new tokens needs ({need} "
                    f"positions, {minimum} blocks): raise it to at least "
                    f"{(minimum * per_block + draft_bytes) / 2**30:.4g} "
                    f"(or 0: what rollout.max_batch_size full-length rows reserve)")
        else:
            blocks = max(rows * need // bs, minimum)
        key = (rows, need, blocks + 1, features)
        c = self.cache
        if c is not None and c.paged and self._paged_key == key:
            if not c.allocated:
                self.allocations += 1
            return c.allocate()
        if c is not None:
            self._release_target()
        self.cache = None
        self.cache = PagedKVCache(
            num_layers=len(eng.runner.layers), max_batch=rows, kv_heads=eng.runner.groups,
            capacity=need, head_dim=eng.arch.kv_channels, dtype=eng.runner.dtype,
            device=eng.device, num_blocks=blocks + 1, block_size=bs,
            routes=eng.runner.route_shape, features=features,
            layout="bsgd" if eng.attention == "flash" else "bgsd")
        self._paged_key = key
        self.allocations += 1
        return self.cache

    @property
    def zeroes_reach(self) -> bool:
        """Whether a call's caches zero only the positions it can reach
        (``KVCache.allocate(upto)``): not where fixed-shape steps read the whole
        capacity (CUDA graphs and their static path), nor off the CPU, where zeroing is
        a memset of memory the allocator already holds."""
        eng = self.engine
        return eng.graphs is None and eng.device.type == "cpu"

    def reach(self, capacity: int, slack: int) -> Optional[int]:
        """The positions a call of ``capacity`` positions (+ ``slack``) can reach, which
        its caches zero; None: all of them (``zeroes_reach``)."""
        return capacity + slack if self.zeroes_reach else None

    def features_serve(self) -> bool:
        """Whether the returned hidden states are read from the drafter's feature store
        (its features are the target's final hidden states)."""
        spec = self.engine.spec
        return spec is not None and spec.keeps_hidden and not spec.feature_layers

    def hidden_buffer(self, plist: Sequence, max_batch: int) -> Optional[torch.Tensor]:
        """The call's buffer of response hidden states, only where a request wants them
        and the feature store does not hold them."""
        if not any(sp.return_hidden_states for sp in plist) or self.features_serve():
            return None
        eng = self.engine
        max_new = max(sp.max_new_tokens for sp in plist)
        return torch.zeros(max_batch, max_new, eng.arch.hidden_size, dtype=eng.hidden_dtype,
                           device=eng.device)

    def response_hidden(self, hidden_buf: Optional[torch.Tensor], i: int, r,
                        on_device: bool = False) -> Optional[torch.Tensor]:
        """Running row ``i``'s (``r``, finished) response hidden states [tokens, hidden]
        as a copy (on the host, or ``on_device``), or None if not requested."""
        if not r.params.return_hidden_states:
            return None
        n = len(r.tokens)
        if hidden_buf is not None:
            src = hidden_buf[i, :n]
        elif self.features_serve():
            p = len(r.prompt) - 1  # the position whose logits gave response token 0
            src = self.engine.spec.features[i, p: p + n]
        else:
            return None
        dtype = self.engine.hidden_dtype
        return src.to(dtype=dtype, copy=True) if on_device else \
            src.to(device="cpu", dtype=dtype, copy=True)  # the one host copy

    # ---------------------------------------------------------------- lifecycle
    def _release_target(self) -> None:
        if self.cache is not None:
            self.cache.release()
        if self.engine.graphs is not None:
            self.engine.graphs.release()

    def release(self) -> None:
        """Free the caches, the feature store and the CUDA graphs (re-made at the next
        ``generate``)."""
        self._release_target()
        if self.engine.spec is not None:
            self.engine.spec.release()
        self.engine.runner.release_memory()  # PP > 1, gathered: the layer copies

    def resident_bytes(self) -> dict[str, int]:
        """Bytes held now by each part (graphs: their count; their pool is opaque)."""
        spec = self.engine.spec
        out = {"kv_cache": self.cache.nbytes if self.cache is not None else 0,
               "draft_kv_cache": 0, "features": 0,
               "cuda_graphs": self.engine.graphs.captured if self.engine.graphs else 0}
        if spec is not None:
            if spec.cache is not None:
                out["draft_kv_cache"] = spec.cache.nbytes
            if spec.features is not None:
                out["features"] = spec.features.nbytes  # (paged: inside kv_cache)
        return out
