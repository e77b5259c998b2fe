"""A toy drafter kind for the registry's tests: it proposes the row's last token again,
``depth`` times. Its own file; adding it to an engine takes one registration line
(``drafters.register(RepeatLast)``) and the config value ``repeat``."""

from __future__ import annotations

from megatron_tlt.rollout.speculative.model_free import ModelFreeDrafter


class RepeatLast(ModelFreeDrafter):
    name = "repeat"
    label = "the repeat-last-token drafter"
    color = "tab:olive"

    def propose(self, tokens, depth):
        return [tokens[-1]] * depth

    @classmethod
    def from_value(cls, value, **kw):
        return cls() if value == cls.name else None
