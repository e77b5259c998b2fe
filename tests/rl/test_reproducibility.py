"""The reproducibility contract (rl/reproducibility.py): each configuration's class and
the banner's line, which names rollout.sampling_mode=coupled where runs are exact in
distribution only."""

from __future__ import annotations

import pytest

from megatron_tlt.config import load_config
from megatron_tlt.rl.reproducibility import DISTRIBUTION, EXACT, contract


@pytest.mark.parametrize("overrides, expected", [
    ([], EXACT),
    (["rollout.speculative.drafter=self"], EXACT),
    (["rollout.speculative.drafter=self", "rollout.speculative.costs=measured"],
     DISTRIBUTION),
    (["rollout.speculative.drafter=self", "rollout.speculative.costs=measured",
      "rollout.sampling_mode=coupled"], EXACT),
    (["drafter_group.enable=true"], DISTRIBUTION),
    (["drafter_group.enable=true", "rollout.sampling_mode=coupled"], EXACT),
    (["rollout.speculative.drafter=prompt_lookup"], EXACT),
    (["rollout.speculative.drafter=group_history"], EXACT),  # its history is saved
    (["rollout.speculative.drafter=group_history", "rollout.sampling_mode=coupled"], EXACT),
])
def test_each_configuration_has_its_class_and_one_banner_line(overrides, expected):
    cls, line = contract(load_config([], overrides))
    assert cls == expected and "\n" not in line
    if cls == DISTRIBUTION:
        assert "in distribution only" in line and "rollout.sampling_mode=coupled" in line
    else:
        assert line.startswith("reproducible: bit-exact reruns and resumes")


def test_the_costs_field_is_checked():
    from megatron_tlt.config import ConfigError

    with pytest.raises(ConfigError, match="rollout.speculative.costs='timed'"):
        load_config([], ["rollout.speculative.costs=timed"])
