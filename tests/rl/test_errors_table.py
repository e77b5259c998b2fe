"""Every row of docs/errors.md: the bad input is refused before compute with the
documented message (the table's message column is asserted verbatim, as a fragment).

Each case calls the check the run calls, in this process and without a process group;
the unknown-key row goes through the training entry point's parser."""

from __future__ import annotations

import importlib.util
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
    from megatron_tlt.config import validate_for_run
    from megatron_tlt.models.drafter import DrafterConfig
    from megatron_tlt.rl import preflight
    from megatron_tlt.config import mini_batch_count

    if case == "unknown-config-key":  # the training entry point's parser (exit code 2:
        spec = importlib.util.spec_from_file_location(  # tests/infra/test_config.py runs its CLI)
            "pretrain_rl_tlt", REPO / "pretrain_rl_tlt.py")
        pretrain_rl_tlt = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(pretrain_rl_tlt)
        pretrain_rl_tlt.parse(["model.dtpye=float32"])
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
        validate_for_run(_cfg("parallel.tensor_model_parallel_size=3"), _arch(), 3)
    if case == "heads-vs-kv-heads":
        _arch(num_attention_heads=14, num_key_value_heads=3, head_dim=16)
    if case == "world-vs-parallel":
        validate_for_run(_cfg("parallel.tensor_model_parallel_size=2"), _arch(), 3)
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
    raise AssertionError(f"{case}: nothing was refused")


def test_the_table_has_rows():
    assert len(ROWS) >= 12, ROWS


@pytest.mark.parametrize("case", sorted(ROWS))
def test_every_documented_bad_input_is_refused_with_its_message(case, tmp_path, tokenizer):
    with pytest.raises(Exception) as info:  # noqa: PT011 - the message is what is checked
        _trigger(case, tmp_path, tokenizer)
    assert not isinstance(info.value, AssertionError), info.value
    assert ROWS[case] in str(info.value), (ROWS[case], str(info.value))
