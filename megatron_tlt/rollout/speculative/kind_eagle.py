"""The one-layer (EAGLE) drafter as a drafter kind: a trained megatron-core layer fed
the target's hidden states, drafting through the target's embedding and output layer
(``models/drafter.py`` holds the module, ``decoder.py`` its speculative step).

Config values: a drafter checkpoint (a ``.safetensors`` file or a folder, from
``tools/warmup_drafter.py`` or a run's export), or ``random`` / ``random:N`` (an
untrained drafter of the target's shape, with an N-token draft vocabulary; the drafter
group's cold start)."""

from __future__ import annotations

from typing import Optional

from ...models.sizes import layer_params
from .drafter_kind import Drafter, MemoryTerm, own_kv_bytes

RANDOM = "random"


class EagleKind(Drafter):
    name = "eagle"
    label = "the one-layer drafter"
    color = "tab:cyan"
    trainable = True
    saveable = True
    fed = "features"
    words = (RANDOM,)
    graphed_drafting = True

    def __init__(self, model):
        self._model = model  # an ``EagleDrafter``

    @property
    def model(self):
        return self._model

    @property
    def feature_layers(self) -> tuple:
        return tuple(self._model.config.feature_layers)

    def settings(self) -> dict:
        return {"kind": self.name, **self._model.config.to_dict()}

    def check_target(self, arch) -> None:
        self._model.config.check_target(arch)

    def make_decoder(self, target):
        from .eagle_decoder import EagleDecoder

        target.prepare_drafter(self._model)
        return EagleDecoder(self, target)

    @classmethod
    def memory_terms(cls, arch, s, sc) -> list[MemoryTerm]:
        """Its layer and fc (resident); its KV cache (one layer) and the feature store
        (the target's hidden state at every row and position) for the rollout."""
        h, db, tp = arch.hidden_size, s.dtype_bytes, s.tp
        rows = s.rollout_rows
        kv = own_kv_bytes(arch, s, layers=1, rows=rows, positions=s.capacity)
        # (paged: the feature store is in the budget's blocks, a position's hidden state
        # beside its K and V: ``draft_cache.PagedFeatures``)
        features = s.kv_tokens * h * db if s.kv_paged else rows * s.capacity * h * db
        return [MemoryTerm("drafter", (layer_params(arch, tp) + 2 * h * h / tp) * db,
                           "resident", "one layer + fc"),
                MemoryTerm("drafter KV + features", kv + features,
                           "rollout", "its KV cache, the feature store (the responses' "
                           "hidden states)")]

    @classmethod
    def kv_layers(cls, arch) -> int:
        return 1

    @classmethod
    def reads_vocabulary(cls) -> bool:
        return True

    @classmethod
    def untrained_value(cls, draft_vocab: int) -> str:
        return f"{RANDOM}:{int(draft_vocab)}"

    @classmethod
    def resolve_value(cls, value: str, *, draft_vocab: int) -> Optional[str]:
        """``random`` -> ``random:<draft_vocab>``; ``random:N`` as given."""
        if value == RANDOM:
            return cls.untrained_value(draft_vocab)
        return value if cls.is_untrained(value) else None

    @classmethod
    def is_untrained(cls, value: str) -> bool:
        return value == RANDOM or value.startswith(RANDOM + ":")

    @classmethod
    def from_value(cls, value: str, *, arch, dtype, device, sc=None,
                   seed: int = 0) -> Optional["EagleKind"]:
        """``random[:N]``: untrained (seeded); anything else non-empty: a checkpoint."""
        from ...models.drafter import DrafterConfig, EagleDrafter, load_drafter

        if not value:
            return None
        if cls.is_untrained(value):
            size = value.split(":", 1)[1] if ":" in value else "0"
            if not size.isdigit():
                raise ValueError(f"drafter {value!r}: random:N takes the draft vocabulary's "
                                 "size N (0 = the full vocabulary)")
            n = int(size)
            kw = {"draft_vocab_size": n} if 0 < n < arch.vocab_size else {}
            model = EagleDrafter(DrafterConfig.for_target(arch, **kw), arch, dtype=dtype,
                                 device=device)
            model.reset_parameters(seed=seed)
            return cls(model)
        return cls(load_drafter(value, arch, dtype=dtype, device=device))
