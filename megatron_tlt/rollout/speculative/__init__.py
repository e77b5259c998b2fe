"""Speculative decoding in the rollout engine: an EAGLE drafter drafts, the target
verifies exactly, and a tuner decides per decode step whether and how to speculate.

A decode step reads engine -> ``controller.py`` -> ``decoder.py``:

- ``controller.py``: ``SpeculationController``, the engine's one interface (the tuner's
  protocol, the drafter's feature store, timing and stats of each step);
- ``decoder.py``: ``SpeculativeDecoder``, the speculative step (catch-up, draft,
  verify, accept) and the drafter's per-row state;
- ``drafting.py``: chain, fused-chain and tree drafting (``DraftTree``);
- ``draft_runner.py``: ``DraftRunner``, the drafter's incremental forward;
- ``self_drafter.py`` / ``self_decoder.py``: the self-drafter, the policy's own
  weight-only int8 copy as a second drafter kind (``rollout.speculative.drafter=self``);
- ``kinds.py``: both kinds in one engine, the kind chosen per batch-size bucket;
- ``acceptance.py``: exact acceptance of chains and trees;
- ``tuner.py``: ``StrategyTuner`` (``decide`` -> ``Decision``, ``record(decision,
  Outcome)``; ``decision.py``), a bucketed bandit (``bandit.py``) plus the
  break-even gate (``gate.py``);
- ``stats.py``: ``SpecStats``, what speculation did in one ``generate`` call.

Strategies and the grammar of their settings live in ``megatron_tlt.spec_strategy``
(shared with ``config/``).
"""
