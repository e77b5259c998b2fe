"""Every row of docs/errors.md: the bad input is refused before compute with the
documented message (the table's message column is asserted verbatim, as a fragment).

Each case calls the check the run calls, in this process and without a process group;
the unknown-key row goes through the training entry point's parser.

``BAD_CONFIGS`` is a table of bad configurations refused by the one validation
(``megatron_tlt/validation.py``): each gives the same message from ``--dry-run`` and
from the launch (``launch.setup``), and ``validate`` is the only caller of the rules."""

from __future__ import annotations

import ast
import json
import re

import pytest

from cli import REPO

TABLE = REPO / "docs" / "errors.md"


def _rows() -> dict[str, str]:
    """case -> message fragment, from the table's `| `case` | ... | `message` | ... |` rows."""
    rows = {}
    for line in TABLE.read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) >= 4 and re.fullmatch(r"`[a-z0-9-]+`", cells[0]):
            rows[cells[0].strip("`")] = cells[2].strip("`").replace("\\|", "|")
    return rows


ROWS = _rows()


@pytest.fixture(scope="module")
def tokenizer(smollm2_dir):
    from megatron_tlt.models import load_tokenizer

    return load_tokenizer(smollm2_dir)


def _arch(**over):
    from megatron_tlt.models.gpt import ModelArch

    cfg = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 64,
           "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
           "num_key_value_heads": 2, "vocab_size": 49152, "max_position_embeddings": 64,
           "rms_norm_eps": 1e-5, "tie_word_embeddings": True, **over}
    return ModelArch.from_hf_config(cfg)


def _cfg(*overrides):
    from megatron_tlt.config import load_config

    return load_config([], list(overrides))


def _data(tmp_path, tokenizer, text: str, *over):
    from megatron_tlt.rl.data import build_prompt_sets

    f = tmp_path / "prompts.jsonl"
    f.write_text(text)
    cfg = _cfg("data.source=jsonl", f"data.path={f}", *over)
    return build_prompt_sets(cfg.data, tokenizer)


def _trigger(case: str, tmp_path, tokenizer):
    from megatron_tlt.config import mini_batch_count
    from megatron_tlt.models.drafter import DrafterConfig
    from megatron_tlt.rl import preflight
    from megatron_tlt.validation import validate

    if case == "unknown-config-key":  # the training entry point's parser (exit code 2:
        from megatron_tlt.cli import parse  # tests/infra/test_config.py runs its CLI)

        parse(["model.dtpye=float32"])
    if case == "malformed-row":
        _data(tmp_path, tokenizer, '{"prompt": "1+1?", "answer": "2"}\n{"question": "2+2?"}\n')
    if case == "empty-dataset":
        _data(tmp_path, tokenizer, "")
    if case == "missing-dataset":
        from megatron_tlt.rl.data import build_prompt_sets

        build_prompt_sets(_cfg("data.source=jsonl",
                               f"data.path={tmp_path / 'none.jsonl'}").data, tokenizer)
    if case == "prompt-over-max-tokens":
        _data(tmp_path, tokenizer, json.dumps({"prompt": "word " * 200, "answer": "1"}) + "\n",
              "data.max_prompt_tokens=64")
    if case == "prompt-over-context":
        train, ev = _data(tmp_path, tokenizer,
                          json.dumps({"prompt": "word " * 80, "answer": "1"}) + "\n")
        preflight.check_prompts(train, ev, _cfg(), _arch())
    if case == "empty-training-set":
        preflight.check_prompts([], [], _cfg(), _arch())
    if case == "vocabulary-mismatch":
        preflight.check_vocabulary(tokenizer, _arch(vocab_size=32000), "/models/x")
    if case == "drafter-mismatch":
        DrafterConfig.for_target(_arch(hidden_size=128, intermediate_size=256)).check_target(
            _arch())
    if case == "tp-vs-heads":
        validate(_cfg("parallel.tensor_model_parallel_size=3"), _arch(), 3)
    if case == "heads-vs-kv-heads":
        _arch(num_attention_heads=14, num_key_value_heads=3, head_dim=16)
    if case == "world-vs-parallel":
        validate(_cfg("parallel.tensor_model_parallel_size=2"), _arch(), 3)
    if case == "batch-sizes":
        mini_batch_count(_cfg("grpo.prompts_per_step=2", "grpo.group_size=4",
                              "train.global_batch_size=6"))
    if case == "checkpoint-of-another-model":
        step = tmp_path / "step_0000002"
        step.mkdir()
        saved = _arch(num_hidden_layers=4)
        preflight.record_model(step, {"hf_config": saved.hf_config, "model_source": "/m/a"})
        preflight.check_checkpoint_model(step, {"hf_config": _arch().hf_config,
                                                "model_source": "/m/b"})
    if case == "bad-config-value":
        _cfg("train.max_nonfinite_steps=-1")
    if case == "paged-flash-block-size":
        _cfg("rollout.kv_cache=paged", "rollout.attention=flash")
    raise AssertionError(f"{case}: nothing was refused")


def test_the_table_has_rows():
    assert len(ROWS) >= 12, ROWS


@pytest.mark.parametrize("case", sorted(ROWS))
def test_every_documented_bad_input_is_refused_with_its_message(case, tmp_path, tokenizer):
    with pytest.raises(Exception) as info:  # noqa: PT011 - the message is what is checked
        _trigger(case, tmp_path, tokenizer)
    assert not isinstance(info.value, AssertionError), info.value
    assert ROWS[case] in str(info.value), (ROWS[case], str(info.value))


# -------------------------------------------------------------------------------------
# one validation: the dry run and the launch refuse the same configurations alike
# -------------------------------------------------------------------------------------

# (model folder, world size, overrides, message fragment)
BAD_CONFIGS = {
    "tp-vs-heads": ("llama_tied", 3, ["parallel.tensor_model_parallel_size=3"],
                    "does not divide the model's 4 attention heads"),
    "world-vs-parallel": ("llama_tied", 3, ["parallel.tensor_model_parallel_size=2"],
                          "world size 3 is not divisible"),
    "pp-vs-layers": ("llama_tied", 3, ["parallel.pipeline_model_parallel_size=3"],
                     "does not divide the model's 4 layers"),
    "drafter-group-pipelined": (
        "llama_tied", 2, ["drafter_group.enable=true", "parallel.pipeline_model_parallel_size=2",
                          "rollout.pipeline_mode=pipelined"],
        "needs rollout.pipeline_mode=gathered"),
    "ep-on-a-dense-model": ("llama_tied", 2, ["parallel.expert_model_parallel_size=2"],
                            "needs a mixture-of-experts model"),
    "groups-over-replicas": ("llama_tied", 4, ["grpo.prompts_per_step=2"],
                             "grpo.prompts_per_step=2 must be divisible by mini-batches"),
    "batch-sizes": ("llama_tied", 1, ["grpo.group_size=4", "train.global_batch_size=6"],
                    "train.global_batch_size=6 must be a multiple of grpo.group_size=4"),
    "routing-replay-pp-recompute": (
        "qwen3_moe", 2, ["parallel.pipeline_model_parallel_size=2",
                         "train.recompute_granularity=full", "train.recompute_num_layers=1"],
        "grpo.routing_replay=true with parallel.pipeline_model_parallel_size > 1"),
    "self-drafter-pipelined": (
        "llama_tied", 2, ["rollout.speculative.drafter=self",
                          "parallel.pipeline_model_parallel_size=2",
                          "rollout.pipeline_mode=pipelined"],
        "the self-drafter (rollout.speculative.drafter=self or "
        "rollout.speculative.kinds.self.also=true)"),
    "self-also-alone": ("llama_tied", 1, ["rollout.speculative.kinds.self.also=true"],
                        "rollout.speculative.kinds.self.also=true needs a drafter checkpoint"),
    "self-group-old-key": ("llama_tied", 1, ["rollout.speculative.self_group=64"],
                           "it is now 'rollout.speculative.kinds.self.group'"),
    "reward-verifier-vs-source": (
        "llama_tied", 1, ["reward.verifier=reasoning_gym", "data.source=jsonl",
                          "data.path=/p.jsonl"],
        "reward.verifier=reasoning_gym needs data.source=reasoning_gym"),
    "reward-timeout": ("llama_tied", 1, ["reward.timeout_seconds=0"],
                       "reward.timeout_seconds must be > 0"),
    "prompt-seed": ("llama_tied", 1, ["data.seed=-1"], "data.seed must be >= 0"),
    "drafter-group-untrainable": (
        "llama_tied", 2, ["drafter_group.enable=true", "rollout.speculative.drafter=self"],
        "drafter_group.enable=true trains a drafter"),
}


@pytest.fixture(scope="module")
def model_dirs(tiny_hf_dirs, qwen3_hf_dirs):
    return {**tiny_hf_dirs, **qwen3_hf_dirs}


@pytest.mark.parametrize("case", sorted(BAD_CONFIGS))
def test_the_dry_run_and_the_launch_refuse_alike(case, model_dirs, monkeypatch, capsys):
    from megatron_tlt import cli
    from megatron_tlt.config import ConfigError, load_config
    from megatron_tlt.launch import setup

    model, world, over, fragment = BAD_CONFIGS[case]
    args = [f"model.hf_path={model_dirs[model]}", *over]
    monkeypatch.setenv("WORLD_SIZE", str(world))
    rc = cli.run(["--dry-run", "--world-size", str(world), *args])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and err.startswith("error: "), (rc, err)
    with pytest.raises(ConfigError) as info:  # before any process group or weight
        setup(load_config([], args))
    assert str(info.value) == err[len("error: "):], (str(info.value), err)
    assert fragment in err, (fragment, err)


RULE_HOMES = {"megatron_tlt/validation.py"}  # the registry, the rules' one caller


def _calls(tree) -> list[tuple[str, str]]:
    """(owner, name) of every call: ``f(...)`` -> ("", "f"), ``m.f(...)`` -> ("m", "f")."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            f = node.func
            if isinstance(f, ast.Name):
                out.append(("", f.id))
            elif isinstance(f, ast.Attribute):
                owner = f.value.id if isinstance(f.value, ast.Name) else ""
                out.append((owner, f.attr))
    return out


def test_validate_is_the_only_caller_of_the_rules():
    """Every registered rule (and the rules the registered wrappers call) is called only
    by ``validation.py``: in the package, the tools and the entry script; and the entry
    points call ``validate``."""
    from megatron_tlt.validation import RULES

    names = {f.__name__ for f in RULES.values()} | {"check_config"}
    qualified = {("moe_replay", "check"), ("drafters", "check_config")}
    files = [*(REPO / "megatron_tlt").rglob("*.py"), *(REPO / "tools").glob("*.py"),
             REPO / "pretrain_rl_tlt.py"]
    found = []
    for path in files:
        rel = str(path.relative_to(REPO))
        if rel in RULE_HOMES:
            continue
        for owner, name in _calls(ast.parse(path.read_text())):
            if (owner, name) in qualified or (name in names and owner in ("", "loading",
                                                                          "validation")):
                found.append(f"{rel}: {owner + '.' if owner else ''}{name}")
    assert not found, "rules called outside validation.validate:\n" + "\n".join(found)
    for entry in ("megatron_tlt/launch.py", "megatron_tlt/rl/plan.py",
                  "megatron_tlt/gpu_check/first_step.py", "tools/convert_hf_checkpoint.py",
                  "tools/plan_tlt.py"):
        assert ("", "validate") in _calls(ast.parse((REPO / entry).read_text())), entry


def test_the_only_caller_check_bites():
    tree = ast.parse("from megatron_tlt.models import moe_replay\nmoe_replay.check(c, a)\n"
                     "check_parallel_sizes(c, a, 1)\n")
    assert {("moe_replay", "check"), ("", "check_parallel_sizes")} <= set(_calls(tree))


def test_the_planner_refuses_what_the_launch_refuses(model_dirs, monkeypatch, capsys):
    """tools/plan_tlt.py predicts no recipe the launch would refuse: the same message."""
    from cli import run_main

    from megatron_tlt.config import ConfigError, load_config
    from megatron_tlt.launch import setup

    model, world, over, fragment = BAD_CONFIGS["routing-replay-pp-recompute"]
    args = [f"model.hf_path={model_dirs[model]}", *over]
    recipe = REPO / "examples" / "rl" / "smollm2_cpu.yaml"
    r = run_main("tools/plan_tlt.py", "--config", recipe, "--world-size", str(world), *args)
    monkeypatch.setenv("WORLD_SIZE", str(world))
    with pytest.raises(ConfigError) as info:
        setup(load_config([recipe], args))
    assert r.returncode == 2 and r.stderr.strip() == f"error: {info.value}", r.stderr
    assert fragment in r.stderr
