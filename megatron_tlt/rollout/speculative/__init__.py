"""Speculative decoding in the rollout engine: a drafter drafts, the target verifies
exactly, and a tuner decides per decode step whether and how to speculate.

A decode step reads engine -> ``controller.py`` -> ``decoder.py``:

- ``controller.py``: ``SpeculationController``, the engine's one interface (the tuner's
  protocol, the drafter's inputs, timing and stats of each step);
- ``decoder.py``: ``SpeculativeDecoder``, the speculative step (catch-up, draft,
  verify, accept) and the drafter's per-row state; ``emissions.py``: from the
  verification to each row's emitted tokens (``acceptance.py`` /
  ``acceptance_batched.py``: exact acceptance of chains and trees);
- ``drafting.py``: chain, fused-chain and tree drafting (``DraftTree``,
  ``draft_tree.py``); ``draft_runner.py``: the one-layer drafter's forward;
- the drafter kinds, each a ``Drafter`` (``drafter_kind.py``) in its own file and one
  line in ``drafters.py``, the only module that turns a config value into a drafter:
  ``kind_eagle.py`` (the one-layer EAGLE drafter), ``self_drafter.py`` (the policy's
  int8 / FP8 copy; ``self_runner.py``, ``self_decoder.py``, ``quantize*.py``),
  ``model_free.py`` (the base of model-free kinds); ``multi.py``: several kinds in one
  engine, the kind chosen per batch-size bucket;
- ``tuner.py``: ``StrategyTuner`` (``decide`` -> ``Decision``, ``record(decision,
  Outcome)``; ``decision.py``), a bucketed bandit (``bandit.py``) plus the break-even
  gate (``gate.py``), charging steps modelled costs (``step_costs.py``, measured
  once by ``calibrate.py``) or measured ones;
- ``stats.py``: ``SpecStats``, what speculation did in one ``generate`` call
  (``position_accept.py``: acceptance by response position).

Strategies and the grammar of their settings live in ``megatron_tlt.spec_strategy``
(shared with ``config/``).
"""
