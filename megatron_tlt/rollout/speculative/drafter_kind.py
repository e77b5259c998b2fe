"""What every drafter kind answers (``Drafter``), and the sizes its memory terms share
with the engine.

A drafter kind is one class deriving from ``Drafter`` in its own file, registered in
``drafters.py`` (the only module that turns a config value into a drafter and the only
one that knows which kinds exist). The engine, the controller, the trainer, the memory
model, the report and the tools ask a drafter what they need through the attributes and
methods below; none of them compares a kind's name or probes a drafter's attributes
(tests/rollout/test_drafter_registry.py).

    class MyKind(Drafter):
        name = "mine"                    # metrics: spec/mine/...; a config value
        label = "my drafter"             # in reports and plots
        def make_decoder(self, target):  # the SpeculativeDecoder for target's rows
            ...
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Optional, Sequence

from ...spec_strategy import Strategy


def draft_slack(arms: Sequence[Strategy]) -> int:
    """Cache positions beyond a sequence's length that drafting and verification may
    use for a tuner whose arms are ``arms``: a chain's verified tokens or a tree's
    deepest node row, plus the root and the bonus token. The one formula the engine's
    caches (``SpeculationController.slack``) and the dry run's memory model use."""
    return max(max(a.verify_tokens, (a.depth - 1) * a.top_k) for a in arms) + 2


def own_kv_bytes(arch, s, *, layers: int, rows: int, positions: int) -> float:
    """Bytes of a drafter's own KV cache of ``layers`` layers on one rank for the dry
    run (``s``: the memory model's ``Settings``): ``rows`` slots of ``positions``
    positions, or with ``rollout.kv_cache=paged`` its pool (``draft_cache``: the rows
    that speculate, each of the capacity and the draft slack, in blocks), which the KV
    budget holds."""
    from ..kv_cache import kv_bytes

    if s.kv_paged:
        from .draft_cache import pool_positions

        rows, positions = 1, pool_positions(rows=rows, capacity=s.capacity,
                                            slack=s.draft_slack, block_size=s.kv_block,
                                            threshold=s.spec_threshold)
    return kv_bytes(num_layers=layers, rows=rows,
                    kv_heads=max(arch.num_query_groups // s.tp, 1), capacity=positions,
                    head_dim=arch.kv_channels, itemsize=s.dtype_bytes)


@dataclass
class MemoryTerm:
    """One tensor family a drafter kind holds on each rank, for the dry run's memory
    model: ``lifetime`` "resident" (kept through the policy update: weights, a
    quantized copy) or "rollout" (the rollout's caches, freed before the update when
    ``rollout.release_memory``)."""

    name: str
    nbytes: float
    lifetime: str
    note: str = ""


class Drafter:
    """A drafter kind's instance: what the engine attaches.

    Class attributes say what the kind is; methods make its per-engine state. Defaults
    fit a kind without weights."""

    name: ClassVar[str] = ""          # its config value and metrics prefix (spec/<name>)
    label: ClassVar[str] = ""         # how reports and plots name it
    color: ClassVar[str] = "tab:gray"  # its band in the run's timeline plot
    trainable: ClassVar[bool] = False  # the drafter group may train it (``model``)
    saveable: ClassVar[bool] = False   # its weights go into the run's checkpoints
    # what it is fed: "features" (the target's hidden states, as EAGLE or MTP heads)
    # or "tokens" (a copy of the model, a model-free proposer)
    fed: ClassVar[str] = "tokens"
    graphed_drafting: ClassVar[bool] = False  # its drafting forwards are CUDA-graphed
    # it drafts with a copy of the policy itself (nothing to train; acceptance near 1:
    # the planner assumes it instead of a learned curve)
    copies_policy: ClassVar[bool] = False
    # config words it takes besides its name (EAGLE's "random": an untrained drafter);
    # only the kind's own file parses them (tests/rollout/test_drafter_registry.py)
    words: ClassVar[tuple] = ()
    # its proposals cost nothing on the accelerator (a host lookup): beside other kinds
    # it is offered per row over the bucket's kind (``multi.KindDecoder``)
    free: ClassVar[bool] = False
    # what it drafts from is the same after a resume: rebuilt, or saved in checkpoints
    # (``drafting_state``); False: standard sampling resumes exact in distribution only
    resumes_exactly: ClassVar[bool] = True
    # its own settings' dataclass (config/kinds/: rollout.speculative.kinds.<name>),
    # registered there under its name; None: it has none
    settings_section: ClassVar[Optional[type]] = None

    @property
    def model(self):
        """The module the drafter group trains and checkpoints save (None: none)."""
        return None

    @property
    def feature_layers(self) -> tuple:
        """The target layers whose outputs it reads (EAGLE-3); () = the final hidden
        states or none."""
        return ()

    def settings(self) -> dict:
        """Its kind and settings, JSON-able (benchmark records)."""
        return {"kind": self.name}

    def drafting_state(self) -> Optional[dict]:
        """What it drafts from that a run's checkpoints carry (per rank, as
        ``checkpoint.safe_files.write_tree`` stores: tensors, numbers, strings, lists,
        dicts), e.g. a history of earlier responses; None: nothing (weights are
        ``model``'s)."""
        return None

    def load_drafting_state(self, state: dict) -> None:
        """Restore ``drafting_state()``'s state."""

    def check_target(self, arch) -> None:
        """Raise when it cannot draft for a target of ``arch``."""

    def make_decoder(self, target):
        """The ``SpeculativeDecoder`` that drafts with it for ``target``'s rows (a
        ``ModelRunner``)."""
        raise NotImplementedError(f"drafter kind {self.name!r} makes no decoder")

    def token_runner(self, target):
        """A token-fed kind's runner that drafts for ``target`` (a ``ModelRunner``, its
        weights up to date): the self-drafter's quantized copy; None for kinds without
        one (feature-fed kinds draft through ``model``; model-free kinds through no
        model)."""
        return None

    @classmethod
    def section(cls, sc):
        """Its settings in ``sc`` (``rollout.speculative``): ``sc.kinds.<name>``; None
        for ``sc`` None or a kind without settings."""
        if sc is None or cls.settings_section is None:
            return None
        return getattr(sc.kinds, cls.name)

    @classmethod
    def joins(cls, sc) -> bool:
        """Whether ``sc`` attaches this kind beside the kind of ``sc.drafter`` (the
        self-drafter's ``kinds.self.also``)."""
        return False

    @classmethod
    def check_settings(cls, sc) -> None:
        """Raise ``ConfigError`` when its settings in ``sc`` need what the rest of
        ``sc`` does not give (checks against the kinds, which the config layer cannot
        import)."""

    @classmethod
    def tuner_config(cls, sc):
        """The ``SpeculativeConfig`` its strategy tuner is built from (its own arms)."""
        return sc

    # ---------------------------------------------------------------- the dry run
    @classmethod
    def memory_terms(cls, arch, s, sc) -> list[MemoryTerm]:
        """What it holds per rank for the dry run (``rl.memory_model``): ``arch`` the
        target's, ``s`` the model's ``Settings`` (layout, dtype bytes, rows and
        capacity of the rollout, its draft slack ``s.draft_slack``), ``sc`` the
        ``rollout.speculative`` config."""
        return []

    @classmethod
    def kv_layers(cls, arch) -> int:
        """Layers of its own KV cache (0: none), which page with the target's cache
        (``draft_cache``; the KV budget holds them: ``drafters.paged_kv_bytes``)."""
        return 0

    @classmethod
    def reads_vocabulary(cls) -> bool:
        """Whether it reads the target's embedding and output layer (at PP > 1 every
        stage then holds copies of the vocabulary matrices it does not own)."""
        return False

    @classmethod
    def untrained_value(cls, draft_vocab: int) -> Optional[str]:
        """The config value of an untrained (seeded) drafter of this kind with a
        ``draft_vocab``-token draft vocabulary (0: the full one), or None: it has none."""
        return None

    @classmethod
    def resolve_value(cls, value: str, *, draft_vocab: int) -> Optional[str]:
        """A tool's value made concrete for this kind (its bare untrained word at
        ``draft_vocab``), or None when ``value`` is not one of its words."""
        return None

    @classmethod
    def is_untrained(cls, value: str) -> bool:
        """Whether ``value`` asks this kind for an untrained drafter."""
        return False

    @classmethod
    def check_layout(cls, cfg) -> None:
        """Raise ``ConfigError`` when ``cfg``'s layout cannot run it."""

    @classmethod
    def from_value(cls, value: str, *, arch, dtype, device, sc=None,
                   seed: int = 0) -> Optional["Drafter"]:
        """This kind's drafter for config value ``value`` (``rollout.speculative.drafter``
        or a tool's ``--drafter``), or None when the value is not this kind's."""
        return None
