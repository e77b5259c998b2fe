"""The drafter kinds: which exist, and the one place a config value becomes a drafter.

A kind is a ``Drafter`` subclass in its own file (``drafter_kind.py`` says what it must
answer), listed in ``KINDS`` below. Everything else (the engine, the trainer, the
drafter group, the memory model, the report, the tools) reaches drafters through this
module and the ``Drafter`` interface, never by a kind's name or by probing attributes
(tests/rollout/test_drafter_registry.py).

    drafter = make_drafter("self", arch=arch, dtype=dtype, device=device, sc=spec_config)
    drafters = configured(spec_config, arch=arch, dtype=dtype, device=device)
    engine.attach_drafters(drafters)     # one kind, or several chosen per bucket

Config values (``rollout.speculative.drafter``, a tool's ``--drafter``): ``self`` (the
policy's quantized copy, ``self_drafter.py``), ``prompt_lookup`` (n-gram lookup in the prompt,
``kind_prompt.py``), ``group_history`` (the GRPO group's responses, ``kind_group.py``),
``random`` / ``random:N`` or a drafter
checkpoint (the one-layer drafter, ``kind_eagle.py``); empty: none.
``rollout.speculative.kinds.self.also`` adds the self-drafter beside a checkpoint (a
kind that ``joins``). A kind's own settings are ``rollout.speculative.kinds.<name>``
(``config/kinds/``; ``Drafter.settings_section``).
``free_too`` adds model-free kinds beside any drafter.
"""

from __future__ import annotations

from typing import Optional, Sequence

from ...spec_strategy import Strategy, parse_arms
from .drafter_kind import Drafter, draft_slack
from .kind_eagle import EagleKind
from .kind_group import GroupHistory
from .kind_prompt import PromptLookup
from .self_drafter import SelfDrafter

# Registration, one line per kind. A value is offered to each kind in this order and
# the first that claims it wins: the one-layer drafter, which takes any path, last.
KINDS: list[type[Drafter]] = [SelfDrafter, PromptLookup, GroupHistory, EagleKind]


def register(kind: type[Drafter], *, before_paths: bool = True) -> None:
    """Add a kind (a plug-in, or a test's toy kind): offered values before the kinds
    that read checkpoint paths, or after every kind."""
    if any(k.name == kind.name for k in KINDS):
        raise ValueError(f"a drafter kind named {kind.name!r} is already registered")
    if before_paths:
        KINDS.insert(len(KINDS) - 1, kind)
    else:
        KINDS.append(kind)


def unregister(kind: type[Drafter]) -> None:
    KINDS.remove(kind)


def kind_named(name: str) -> type[Drafter]:
    """The kind whose metrics are ``spec/<name>``."""
    for k in KINDS:
        if k.name == name:
            return k
    raise KeyError(f"no drafter kind named {name!r}; kinds: {names()}")


def names() -> list[str]:
    return [k.name for k in KINDS]


# ------------------------------------------------------------------------- making them
def make_drafter(value: str, *, arch, dtype, device, sc=None, seed: int = 0) -> Drafter:
    """The drafter for config value ``value`` (``sc``: the ``rollout.speculative``
    settings a kind reads; ``seed``: an untrained drafter's)."""
    for kind in KINDS:
        d = kind.from_value(value, arch=arch, dtype=dtype, device=device, sc=sc, seed=seed)
        if d is not None:
            return d
    raise ValueError(f"no drafter kind takes {value!r}: give a drafter checkpoint, or one "
                     f"of {names()}")


# the warmed drafters' draft vocabulary: a tool's bare untrained value gets this size
WARMED_DRAFT_VOCAB = 1024


def resolve_value(value: str, *, draft_vocab: int = WARMED_DRAFT_VOCAB) -> str:
    """A tool's ``--drafter`` value made concrete by the kind whose word it is (e.g. an
    untrained drafter's bare word at ``draft_vocab``); other values unchanged."""
    for kind in KINDS:
        out = kind.resolve_value(value, draft_vocab=draft_vocab)
        if out is not None:
            return out
    return value


def is_untrained(value: str) -> bool:
    """Whether ``value`` asks a kind for an untrained (seeded) drafter."""
    return any(kind.is_untrained(value) for kind in KINDS)


def untrained_value(draft_vocab: int = WARMED_DRAFT_VOCAB) -> str:
    """The config value of an untrained drafter of the trainable kind."""
    return trainable_kind().untrained_value(draft_vocab)


def as_drafter(obj) -> Drafter:
    """``obj`` as a ``Drafter``: a drafter already, or a one-layer drafter module
    (``models.drafter.EagleDrafter``, as tools and tests build them)."""
    if isinstance(obj, Drafter):
        return obj
    from ...models.drafter import EagleDrafter

    if isinstance(obj, EagleDrafter):
        return EagleKind(obj)
    raise TypeError(f"not a drafter: {type(obj).__name__} (give a Drafter, an "
                    "EagleDrafter, or a config value to make_drafter)")


def configured_values(sc) -> list[str]:
    """The config values of the drafters ``sc`` (``rollout.speculative``) asks for:
    ``drafter``, the kinds that join it (the self-drafter with ``kinds.self.also``),
    then ``free_too``'s kinds."""
    values = [sc.drafter] if sc.drafter else []
    return values + [k.name for k in KINDS if k.joins(sc)] + free_too(sc)


def free_too(sc) -> list[str]:
    """The model-free kinds ``rollout.speculative.free_too`` names."""
    return [v.strip() for v in (sc.free_too or "").split(",") if v.strip()]


def configured(sc, *, arch, dtype, device, given=None) -> dict[str, Drafter]:
    """Kind name -> drafter for ``sc``; ``given`` (a drafter or an ``EagleDrafter``)
    stands in for the value of ``sc.drafter``."""
    check_spec(sc)
    values = configured_values(sc)
    out: dict[str, Drafter] = {}
    if given is not None:
        d = as_drafter(given)
        out[d.name] = d
        values = values[1:] if sc.drafter else values
    for v in values:
        d = make_drafter(v, arch=arch, dtype=dtype, device=device, sc=sc)
        out.setdefault(d.name, d)
    return out


def kind_of_value(value: str) -> type[Drafter]:
    """The kind a config value names, without building the drafter: a kind's name, or
    a path (the kind that takes paths, registered last)."""
    for k in KINDS:
        if value == k.name:
            return k
    return KINDS[-1]


def configured_kinds(cfg) -> list[type[Drafter]]:
    """The kinds a run of ``cfg`` holds (the drafter group's cold start included: it
    attaches an untrained trainable drafter when none is configured), for the dry run."""
    kinds = [kind_of_value(v) for v in configured_values(cfg.rollout.speculative)]
    if cfg.drafter_group.enable and not any(k.trainable for k in kinds):
        kinds.append(trainable_kind())
    return list(dict.fromkeys(kinds))


def trainable_kind() -> type[Drafter]:
    """The kind the drafter group trains (a cold start makes one of it)."""
    return next(k for k in KINDS if k.trainable)


def untrained(arch, *, dtype, device, seed: int = 0) -> Drafter:
    """An untrained drafter of the trainable kind, the same on every rank (``seed``)."""
    return trainable_kind().from_value(untrained_value(0), arch=arch, dtype=dtype,
                                       device=device, seed=seed)


def trainable(drafters: dict) -> Optional[Drafter]:
    """The drafter among ``drafters`` the drafter group trains and checkpoints save."""
    return next((d for d in drafters.values() if d.trainable), None)


# ------------------------------------------------------------------------- settings
def check_config(cfg) -> None:
    """Checks a run's speculative settings need beyond their own fields: each kind's
    settings against the kinds (``check_settings``), each configured kind's layout
    rule."""
    check_spec(cfg.rollout.speculative)
    for kind in configured_kinds(cfg):
        kind.check_layout(cfg)


def check_spec(sc) -> None:
    """Each kind's settings in ``sc`` against the kinds (``Drafter.check_settings``),
    and ``free_too`` names model-free kinds."""
    from ...config import ConfigError

    for kind in KINDS:
        kind.check_settings(sc)
    for v in free_too(sc):
        if not any(k.free and v == k.name for k in KINDS):
            names = ", ".join(k.name for k in KINDS if k.free)
            raise ConfigError(f"rollout.speculative.free_too={sc.free_too!r}: {v!r} is not "
                              f"a model-free drafter kind (one of: {names})")


def tuner_arms(kinds: Sequence[type[Drafter]], sc) -> list[Strategy]:
    """Every strategy the tuners of ``kinds`` may pick: their arms and the fixed
    strategy (a tuner may always be switched to it)."""
    out: list[Strategy] = []
    for k in kinds:
        ksc = k.tuner_config(sc)
        out += [a for bucket in parse_arms(ksc.arms, ksc.buckets).values() for a in bucket]
        out.append(Strategy.parse(ksc.strategy))
    return out


def paged_kv_bytes(kinds: Sequence[type[Drafter]], arch, *, tp: int, dtype_bytes: int,
                   rows: int, threshold: int, capacity: int, slack: int,
                   block_size: int) -> int:
    """Bytes on one rank of the paged caches of ``kinds``' own KV (``Drafter.kv_layers``;
    ``draft_cache.pool_positions``): what ``rollout.kv_cache_gib`` holds beside the
    target's blocks."""
    from ..kv_cache import kv_bytes
    from .draft_cache import pool_positions

    layers = sum(k.kv_layers(arch) for k in kinds)
    if not layers:
        return 0
    positions = pool_positions(rows=rows, capacity=capacity, slack=slack,
                               block_size=block_size, threshold=threshold)
    return kv_bytes(num_layers=layers, rows=1, kv_heads=max(arch.num_query_groups // tp, 1),
                    capacity=positions, head_dim=arch.kv_channels, itemsize=dtype_bytes)


def paged_feature_bytes(kinds: Sequence[type[Drafter]], arch, *, dtype_bytes: int) -> int:
    """Bytes per cached position of the feature store a feature-fed kind keeps (the
    target's hidden state; one store whatever the kinds), which the paged cache's
    blocks hold beside K and V (``draft_cache.PagedFeatures``)."""
    fed = any(k.fed == "features" for k in kinds)
    return arch.hidden_size * dtype_bytes if fed else 0


def configured_slack(kinds: Sequence[type[Drafter]], sc) -> int:
    """The draft slack of the caches for ``kinds`` (``drafter_kind.draft_slack``)."""
    arms = tuner_arms(kinds, sc)
    return draft_slack(arms) if arms else 0
