"""One validation for every entry point: ``validate(cfg, arch, world_size)``.

The launch (``launch.setup``), the dry run (``rl/plan.py``), the planner
(``tools/plan_tlt.py``), the GPU check's first step and the conversion tool call it, so a recipe the dry run accepts is one the launch accepts,
with the same message when it is not. A rule may live next to the code it protects
(``config/loading.py``, ``config/expert_layout.py``, ``models/moe_replay.py``, the
drafter kinds through ``rollout/speculative/drafters.py``); it is registered here, in
``RULES``, and nothing else calls it (tests/rl/test_errors_table.py checks both).

Every rule takes ``(cfg, arch, world_size)`` and raises ``ConfigError`` naming the
field and the fix. Checks that need more than the config, the model's config.json and
the world size (the data, the tokenizer, a drafter checkpoint's own settings, a run
checkpoint) run later, in ``rl/preflight.py`` and where those inputs are read, still
before any compute.
"""

from __future__ import annotations

from typing import Callable

from .config import Config, ConfigError
from .config.expert_layout import check_expert_layout
from .config.loading import (check_data_parallel_layout, check_drafter_group_layout,
                             check_parallel_sizes)
from .models import moe_replay
from .rollout.speculative import drafters
from .tasks.answers import EXTRACTION_MODES

Rule = Callable[[Config, object, int], None]


def check_routing_replay(cfg: Config, arch, world_size: int) -> None:
    """Routing replay under PP > 1 with recomputation (``models/moe_replay.py``)."""
    moe_replay.check(cfg, arch)


def check_drafter_kinds(cfg: Config, arch, world_size: int) -> None:
    """The drafter kinds' own rules (a kind's settings against the kinds, each
    configured kind's layout)."""
    drafters.check_config(cfg)


def check_drafter_group_kind(cfg: Config, arch, world_size: int) -> None:
    """The drafter group trains a drafter: a configured drafter must be of a trainable
    kind (none configured, or model-free kinds only: the trainer attaches an untrained
    one, a cold start, the free kinds per row beside it)."""
    if not cfg.drafter_group.enable:
        return
    sc = cfg.rollout.speculative
    kinds = [drafters.kind_of_value(v) for v in drafters.configured_values(sc)]
    if kinds and not any(k.trainable for k in kinds) and not all(k.free for k in kinds):
        names = ", ".join(f"{k.label} ({k.name})" for k in dict.fromkeys(kinds))
        raise ConfigError(f"drafter_group.enable=true trains a drafter, and {names} needs "
                          "no training: set drafter_group.enable=false, or give "
                          "rollout.speculative.drafter a drafter checkpoint (or leave it "
                          "empty for a cold start)")


def check_reward_settings(cfg: Config, arch, world_size: int) -> None:
    """The verifier's settings (``rl/rewards.py`` ``Verifier`` trusts them)."""
    r, d = cfg.reward, cfg.data
    if r.answer_extraction not in EXTRACTION_MODES:
        raise ConfigError(f"reward.answer_extraction={r.answer_extraction!r} is not valid; "
                          f"choose one of {', '.join(EXTRACTION_MODES)}")
    if r.verifier == "reasoning_gym" and d.source != "reasoning_gym":
        raise ConfigError(
            f"reward.verifier=reasoning_gym needs data.source=reasoning_gym (got "
            f"{d.source}); use math or exact for file prompts")
    if r.timeout_seconds <= 0:
        raise ConfigError(f"reward.timeout_seconds must be > 0, got {r.timeout_seconds}")


def check_prompt_settings(cfg: Config, arch, world_size: int) -> None:
    """The generated prompt set's settings (``rl/data.py`` trusts them)."""
    d = cfg.data
    if d.source == "reasoning_gym":
        if d.seed < 0:
            raise ConfigError(f"data.seed must be >= 0 for data.source=reasoning_gym, got "
                              f"{d.seed}")
        if d.train_size < 1:
            raise ConfigError("data.train_size must be >= 1 for data.source=reasoning_gym")


# name -> rule, in the order they run (the first failure is the message)
RULES: dict[str, Rule] = {
    "parallel_sizes": check_parallel_sizes,
    "drafter_group_layout": check_drafter_group_layout,
    "expert_layout": check_expert_layout,
    "batch_sizes": check_data_parallel_layout,
    "routing_replay": check_routing_replay,
    "drafter_kinds": check_drafter_kinds,
    "drafter_group_kind": check_drafter_group_kind,
    "reward_settings": check_reward_settings,
    "prompt_settings": check_prompt_settings,
}


def validate(cfg: Config, arch, world_size: int) -> None:
    """Run every registered rule on ``cfg`` for ``arch`` (``models.gpt.ModelArch``) and
    ``world_size`` processes; the first that fails raises its ``ConfigError``."""
    for rule in RULES.values():
        rule(cfg, arch, world_size)
