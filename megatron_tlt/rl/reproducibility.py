"""The reproducibility contract of a run's configuration, printed at start.

- ``exact``: bit-reproducible, and a resumed run continues exactly as the uninterrupted
  one (every logged metric but wall-clock ones): no speculation; speculation with the
  tuner on modelled costs (``rollout.speculative.costs=modelled``, the default) and no
  drafter group; coupled sampling (``rollout.sampling_mode=coupled``: the drafts never
  change the tokens), with or without the drafter group (there the drafter's own
  numbers, its loss and the acceptance, follow the idle time it trained in).
- ``distribution``: exact in distribution only (every token is still drawn from the
  policy's distribution): standard sampling with the drafter group, whose training
  amount follows each step's idle time, so later drafts, hence the sampled tokens,
  differ from run to run; or with ``costs=measured`` (the tuner follows step times); or
  with a kind whose drafting source a checkpoint does not hold (``Drafter.resumes_exactly``
  False; reruns are bit-exact). ``group_history``'s responses are in every checkpoint
  (``Drafter.drafting_state``): it resumes exactly.
"""

from __future__ import annotations

from ..rollout.speculative import drafters

EXACT, DISTRIBUTION = "exact", "distribution"


def contract(cfg) -> tuple[str, str]:
    """(class, one line for the start-up banner) of ``cfg`` (a ``Config``)."""
    sc = cfg.rollout.speculative
    group = cfg.drafter_group.enable
    if not (sc.drafter or group):
        return EXACT, "reproducible: bit-exact reruns and resumes (no speculation)"
    if cfg.rollout.sampling_mode == "coupled":
        extra = ("; the drafter's own loss and acceptance follow idle time"
                 if group else "")
        return EXACT, f"reproducible: bit-exact reruns and resumes (coupled sampling{extra})"
    if group:
        return DISTRIBUTION, ("reproducible in distribution only: the drafter group trains "
                              "for each step's idle time, so reruns and resumes draw other "
                              "tokens; rollout.sampling_mode=coupled makes them bit-exact")
    if sc.costs == "measured":
        return DISTRIBUTION, ("reproducible in distribution only: speculation follows "
                              "measured step times (rollout.speculative.costs=measured); "
                              "costs=modelled or rollout.sampling_mode=coupled makes "
                              "reruns and resumes bit-exact")
    lost = [k.name for k in drafters.configured_kinds(cfg) if not k.resumes_exactly]
    if lost:
        return DISTRIBUTION, (f"reproducible in distribution only after a resume: "
                              f"{', '.join(lost)} starts its history empty (reruns are "
                              "bit-exact); rollout.sampling_mode=coupled makes resumes "
                              "bit-exact too")
    return EXACT, ("reproducible: bit-exact reruns and resumes (speculation decided from "
                   "modelled step costs)")
