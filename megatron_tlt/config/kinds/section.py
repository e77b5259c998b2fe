"""What a drafter kind's settings section is: a dataclass of its own fields (each with a
help text), checked on its own in ``__post_init__`` and against the shared
``rollout.speculative`` fields in ``check``."""

from __future__ import annotations

from typing import ClassVar


class KindSection:
    """Base of a kind's settings dataclass (``rollout.speculative.kinds.<kind>``)."""

    # old flat keys of rollout.speculative -> this section's field: such a key is an
    # error that names the new key (config/keys.py), never taken silently
    renamed: ClassVar[dict] = {}

    def check(self, sc) -> None:
        """Raise ``ConfigError`` when the section does not fit ``sc``, the shared
        ``rollout.speculative`` settings (e.g. its arms against ``sc.buckets``)."""
