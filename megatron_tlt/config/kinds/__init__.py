"""Each drafter kind's own settings: ``rollout.speculative.kinds.<kind>.<field>``.

The shared ``rollout.speculative`` section (``config/sections.py``) holds what every
kind uses (the drafter value, the threshold, the tuner, the costs). A kind with
settings of its own declares them as a ``KindSection`` dataclass in its own file in
this folder (fields with help texts and defaults, checks in ``__post_init__`` and
``check``) and registers it with one field of ``KindSettings`` below, named after the
kind's config value (``Drafter.name``); its rollout file (rollout/speculative/) points
at the class (``Drafter.settings_section``) and reads its values through
``Drafter.section(sc)``. The config layer imports these files without the rollout
package, so a recipe is parsed and checked (``--dry-run`` included) before any kind is
imported. tests/rollout/test_drafter_registry.py checks that both registrations agree
and that no kind's field sits on the shared section.

    rollout.speculative.drafter=self rollout.speculative.kinds.self.group=128
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from ..base import _help
from .section import KindSection
from .self_drafter import SelfSettings


@dataclass
class KindSettings:
    """Each drafter kind's own settings, one section per kind (the shared ones are in
    rollout.speculative)."""

    # registration: one field per kind with settings, named after its config value
    self: SelfSettings = _help("The self-drafter's (drafter=self).", factory=SelfSettings)

    def sections(self) -> dict[str, KindSection]:
        """Kind name -> its settings."""
        return {f.name: getattr(self, f.name) for f in fields(self)}

    def check(self, sc) -> None:
        """Every section against the shared settings ``sc``."""
        for section in self.sections().values():
            section.check(sc)


def renamed_keys(prefix: str = "rollout.speculative") -> dict[str, str]:
    """Old flat keys of the shared section -> the kind's key that replaced each."""
    return {f"{prefix}.{old}": f"{prefix}.kinds.{f.name}.{new}"
            for f in fields(KindSettings) for old, new in f.default_factory.renamed.items()}


__all__ = ["KindSection", "KindSettings", "SelfSettings", "renamed_keys"]
