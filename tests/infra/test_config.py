"""Config: YAML + overrides, and errors that name the field and the fix, before compute."""

from __future__ import annotations


import pytest

from megatron_tlt.config import Config, ConfigError, describe, load_config
from megatron_tlt.validation import validate
from megatron_tlt.models.gpt import ModelArch

from cli import REPO, run_script

SMOLLM2_LIKE = ModelArch.from_hf_config(dict(
    model_type="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536,
    num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3))


def _cfg(*overrides: str) -> Config:
    return load_config([], list(overrides))


def test_defaults_then_yaml_then_overrides(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("parallel:\n  tensor_model_parallel_size: 2\nplatform:\n  seed: 7\n")
    cfg = load_config([recipe], ["platform.seed=9", "model.dtype=float32"])
    assert cfg.parallel.tensor_model_parallel_size == 2  # from YAML
    assert cfg.platform.seed == 9  # command line wins over YAML
    assert cfg.model.dtype == "float32"
    assert cfg.parallel.pipeline_model_parallel_size == 1  # default


def test_unknown_key_suggests_closest():
    with pytest.raises(ConfigError, match="did you mean 'parallel.tensor_model_parallel_size'"):
        _cfg("parallel.tensor_parallel_size=2")


def test_unknown_key_in_yaml_names_file_and_line(tmp_path):
    recipe = tmp_path / "bad.yaml"
    recipe.write_text("model:\n  dtype: float32\nparallel:\n  pipline_model_parallel_size: 2\n")
    with pytest.raises(ConfigError) as e:
        load_config([recipe])
    assert f"{recipe}:4" in str(e.value)
    assert "parallel.pipeline_model_parallel_size" in str(e.value)


def test_wrong_type_names_the_field():
    with pytest.raises(ConfigError, match="'parallel.tensor_model_parallel_size'.*'two'"):
        _cfg("parallel.tensor_model_parallel_size=two")


def test_bad_choice_lists_valid_values():
    with pytest.raises(ConfigError, match="model.dtype='bf16'.*bfloat16"):
        _cfg("model.dtype=bf16")


def test_checkpoint_async_save_is_auto_true_or_false(tmp_path):
    from megatron_tlt.checkpoint import async_enabled

    assert _cfg().checkpoint.async_save == "auto"
    assert _cfg("checkpoint.async_save=false").checkpoint.async_save == "false"
    recipe = tmp_path / "r.yaml"
    recipe.write_text("checkpoint:\n  async_save: true\n")  # a YAML bool
    assert load_config([recipe]).checkpoint.async_save == "true"
    with pytest.raises(ConfigError, match="checkpoint.async_save='yes'.*auto, true, false"):
        _cfg("checkpoint.async_save=yes")
    assert async_enabled("auto", "cuda") and not async_enabled("auto", "cpu")
    assert async_enabled("true", "cpu") and not async_enabled("false", "cuda")


def test_drafter_group_loss_is_a_loss_preset():
    assert _cfg("drafter_group.loss=tv").drafter_group.loss == "tv"
    with pytest.raises(ConfigError, match="drafter_group.loss='kl-tv'.*did you mean 'kl\\+tv'"):
        _cfg("drafter_group.loss=kl-tv")


def test_non_positive_size():
    with pytest.raises(ConfigError, match="pipeline_model_parallel_size must be >= 1"):
        _cfg("parallel.pipeline_model_parallel_size=0")


def test_malformed_override():
    with pytest.raises(ConfigError, match="section.field=value"):
        _cfg("parallel.tensor_model_parallel_size")


def test_tp_must_divide_attention_heads():
    with pytest.raises(ConfigError, match="does not divide the model's 9 attention heads"):
        validate(_cfg("parallel.tensor_model_parallel_size=2"), SMOLLM2_LIKE, 2)


def test_tp_must_divide_kv_groups():
    arch = ModelArch.from_hf_config(dict(
        model_type="qwen2", vocab_size=64, hidden_size=64, intermediate_size=64,
        num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=2))
    validate(_cfg("parallel.tensor_model_parallel_size=2"), arch, 2)
    with pytest.raises(ConfigError, match="does not divide the model's 2 KV groups"):
        validate(_cfg("parallel.tensor_model_parallel_size=4"), arch, 4)


def test_world_size_must_be_multiple_of_tp_pp():
    cfg = _cfg("parallel.tensor_model_parallel_size=3", "parallel.pipeline_model_parallel_size=2")
    validate(cfg, SMOLLM2_LIKE, 12)
    with pytest.raises(ConfigError, match="world size 8 is not divisible by .* = 6"):
        validate(cfg, SMOLLM2_LIKE, 8)


def test_drafter_group_at_pp2_needs_the_gathered_rollout():
    pp2 = ("drafter_group.enable=true", "parallel.pipeline_model_parallel_size=2")
    validate(_cfg(*pp2), SMOLLM2_LIKE, 4)  # rollout.pipeline_mode=gathered (default)
    with pytest.raises(ConfigError, match="drafter_group.enable=true at parallel.pipeline_model"
                       "_parallel_size=2 needs rollout.pipeline_mode=gathered .* got "
                       "rollout.pipeline_mode=pipelined; set rollout.pipeline_mode=gathered"):
        validate(_cfg(*pp2, "rollout.pipeline_mode=pipelined"), SMOLLM2_LIKE, 4)


def test_pp_must_divide_layers():
    with pytest.raises(ConfigError, match="does not divide the model's 30 layers"):
        validate(_cfg("parallel.pipeline_model_parallel_size=4"), SMOLLM2_LIKE, 4)


def test_missing_config_file():
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(["/nonexistent/recipe.yaml"])


@pytest.mark.parametrize("recipe", sorted((REPO / "examples").rglob("*.yaml")),
                         ids=lambda p: p.name)
def test_shipped_recipes_load(recipe):
    load_config([recipe])


def test_configuration_reference_is_current():
    """docs/configuration.md is generated from the dataclasses (make docs)."""
    doc = (REPO / "docs/configuration.md").read_text()
    assert doc.strip() == describe(markdown=True).strip(), "run `make docs`"


def test_entry_point_fails_before_compute(tiny_hf_dirs):
    """A bad launch is refused with the field and fix, before any process group exists."""
    r = run_script("tools/generate.py", f"model.hf_path={tiny_hf_dirs['qwen2']}",
                   "parallel.tensor_model_parallel_size=3")
    assert r.returncode == 2
    assert "tensor_model_parallel_size=3 does not divide the model's 4 attention heads" in r.stderr
    assert "Traceback" not in r.stderr
    r = run_script("tools/generate.py", "model.dtpye=float32")
    assert r.returncode == 2 and "did you mean 'model.dtype'" in r.stderr


@pytest.mark.parametrize("value", [
    "[aeiou]{2}", "[0-9]+", r"^\d{1,3}(,\d{3})*$", "{a: 1}", "key: value", "'single'",
    '"double"', "a=b=c", "${not.an.interpolation}", r"\${escaped}", "#not a comment",
    "*:2_1_2", "  padded  ", "true", "12", "null"])
def test_string_fields_take_override_text_verbatim(value):
    cfg = _cfg(f"generate.prompt={value}", f"tracking.run_name={value}")
    assert cfg.generate.prompt == value and cfg.tracking.run_name == value


def test_regex_with_brackets_reaches_the_verifier():
    assert _cfg("reward.format_pattern=[aeiou]{2}").reward.format_pattern == "[aeiou]{2}"
    with pytest.raises(ConfigError, match="reward.format_pattern is not a valid regex"):
        _cfg("reward.format_pattern=[0-9")


def test_strategy_strings_are_not_read_as_numbers():
    cfg = _cfg("rollout.speculative.strategy=6_1_6", "rollout.speculative.arms=*:2_1_2")
    assert cfg.rollout.speculative.strategy == "6_1_6"
    assert cfg.rollout.speculative.arms == "*:2_1_2"


@pytest.mark.parametrize("override, match", [
    ("policy=greedy", "policy='greedy' is not valid.*egreedy, ucb1, fixed"),
    ("epsilon=1.5", "epsilon must be in \\[0, 1\\], got 1.5"),
    ("window=0", "window must be >= 1, got 0"),
    ("ucb_c=-1", "ucb_c must be a finite number >= 0, got -1"),
    ("probe_budget=1.5", "probe_budget must be in \\[0, 1\\), got 1.5"),
    ("strategy=6_1_7", "rollout.speculative: .*verify_tokens=7"),
    ("arms=3:2_1_2", "rollout.speculative: bucket key '3' is not a bucket bound"),
    ("kinds.self.arms=3:2_1_2",
     "rollout.speculative.kinds.self.arms: bucket key '3' is not a bucket bound"),
])
def test_speculation_settings_are_validated_once_here(override, match):
    """The tuner takes these as given: config/ is where they are checked."""
    with pytest.raises(ConfigError, match=match):
        _cfg(f"rollout.speculative.{override}")


def test_the_self_drafters_arms_follow_arms_unless_both_are_defaults():
    """kinds.self.arms=auto: the deeper self-drafter arms while `arms` is the default, else
    `arms` (a user's arms apply to both kinds); set, it is the self kind's; the
    one-layer drafter always uses `arms`."""
    from megatron_tlt.config.kinds.self_drafter import SELF_ARMS
    from megatron_tlt.config.sections import DEFAULT_ARMS
    from megatron_tlt.rollout.speculative.kind_eagle import EagleKind
    from megatron_tlt.rollout.speculative.self_drafter import SelfDrafter

    sc = _cfg().rollout.speculative
    assert SelfDrafter.tuner_config(sc).arms == SELF_ARMS != DEFAULT_ARMS
    assert EagleKind.tuner_config(sc).arms == DEFAULT_ARMS
    sc = _cfg("rollout.speculative.arms=*:2_1_2").rollout.speculative
    assert SelfDrafter.tuner_config(sc).arms == "*:2_1_2" == EagleKind.tuner_config(sc).arms
    sc = _cfg("rollout.speculative.kinds.self.arms=*:5_1_5").rollout.speculative
    assert SelfDrafter.tuner_config(sc).arms == "*:5_1_5"
    assert EagleKind.tuner_config(sc).arms == DEFAULT_ARMS
    sc = _cfg("rollout.speculative.kinds.self.arms=").rollout.speculative
    assert SelfDrafter.tuner_config(sc).arms == DEFAULT_ARMS


def test_empty_value_means_off_or_unset():
    cfg = _cfg("tracking.wandb_project=", "rollout.speculative.drafter=", "model.hf_path=")
    assert cfg.tracking.wandb_project == "" and cfg.rollout.speculative.drafter == ""
    assert cfg.model.hf_path is None  # Optional[str]: empty = not set
    assert _cfg("model.hf_path=smollm2", "model.hf_path=").model.hf_path is None


def test_non_string_fields_are_still_parsed():
    cfg = _cfg("train.steps=7", "train.lr=3e-5", "tracking.progress=false",
               "data.task_params={min_terms: 2, max_terms: 3}", "data.task_params.seed=4")
    assert cfg.train.steps == 7 and cfg.train.lr == 3e-5 and cfg.tracking.progress is False
    assert cfg.data.task_params == {"min_terms": 2, "max_terms": 3, "seed": 4}


@pytest.mark.parametrize("item,field", [
    ("train.steps=[0-9]+", "train.steps"), ("train.steps=", "train.steps"),
    ("train.lr=fast", "train.lr"), ("tracking.progress=maybe", "tracking.progress"),
    ("data.task_params=[unclosed", "data.task_params"), ("train.steps={", "train.steps"),
    ("generate.prompt=???", "generate.prompt")])
def test_bad_non_string_value_is_one_line_naming_the_field(item, field):
    with pytest.raises(ConfigError) as e:
        _cfg(item)
    msg = str(e.value)
    assert f"'{field}" in msg and "\n" not in msg


def test_unknown_key_with_unparsable_value_is_reported_as_unknown():
    with pytest.raises(ConfigError, match="unknown config key 'train.stpes'.*train.steps"):
        _cfg("train.stpes=[1")


def test_bad_override_on_the_command_line_is_one_line_without_traceback():
    r = run_script("pretrain_rl_tlt.py", "--dry-run", "model.hf_path=smollm2",
                   "data.task_params=[0-9")
    assert r.returncode == 2, r.stderr
    assert "Traceback" not in r.stderr and "'data.task_params'" in r.stderr
