"""Checks of the inputs against each other, run before any compute.

The config (``config.load_config``, ``validation.validate``), the data
(``rl.data``) and the drafter (``models.drafter.DrafterConfig.check_target``) check
themselves; these are the checks that need two of them at once:

* ``check_vocabulary``: the tokenizer's ids fit the model's embedding;
* ``check_prompts_fit``: every prompt fits the rollout context;
* ``record_model`` / ``check_checkpoint_model``: a checkpoint records the model it was
  saved from (``model.json`` in its step folder) and a resume compares it with the
  model loaded now before reading any weights.

docs/errors.md lists every refused input with its message.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional, Sequence

from ..config import ConfigError

MODEL_FILE = "model.json"
# HF config fields that decide the weights' shapes and meaning
MODEL_FIELDS = ("model_type", "hidden_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "intermediate_size", "vocab_size",
                "tie_word_embeddings")


class CheckpointModelError(ConfigError):
    """A resume from a checkpoint saved from another model."""


def check_vocabulary(tokenizer, arch, source) -> None:
    """The tokenizer must not produce ids past the model's vocabulary (a larger,
    padded model vocabulary is fine)."""
    n = len(tokenizer)
    if n > arch.vocab_size:
        raise ConfigError(
            f"the tokenizer of {source} has {n} tokens but the model's vocab_size is "
            f"{arch.vocab_size} (config.json): ids >= {arch.vocab_size} would index past "
            f"the embedding. Use the tokenizer saved with this model (model.hf_path), or a "
            f"model whose vocab_size is at least {n}")


def check_prompts(train: Sequence, eval_: Sequence, cfg, arch) -> None:
    """A non-empty training set, and every prompt fits the rollout context."""
    if not train:
        raise ConfigError("the training prompt set is empty: set data.train_size >= 1 "
                          "(reasoning_gym) or point data.path at a file with rows")
    context, origin = rollout_context(cfg.rollout, arch)
    check_prompts_fit([*train, *eval_], context, cfg.grpo.max_new_tokens, origin)


def check_prompts_fit(prompts: Sequence, context: int, max_new_tokens: int,
                      context_from: str) -> None:
    """Every prompt must leave room in the context for at least one response token."""
    longest = max(prompts, key=lambda p: len(p.token_ids), default=None)
    if longest is not None and len(longest.token_ids) >= context:
        raise ConfigError(
            f"prompt {longest.uid} is {len(longest.token_ids)} tokens after the chat "
            f"template but the rollout context is {context} tokens ({context_from}), which "
            f"must also hold its response (grpo.max_new_tokens={max_new_tokens}). Lower "
            f"data.max_prompt_tokens below {context} (longer rows are an error, or skipped "
            f"with data.skip_bad_rows=true), or raise rollout.max_seq_len")


def rollout_context(rollout_cfg, arch) -> tuple[int, str]:
    """The rollout engine's context (``rollout.RolloutEngine.context``) and its origin."""
    ctx = min(rollout_cfg.max_seq_len or arch.max_position_embeddings,
              arch.max_position_embeddings)
    return ctx, (f"model max_position_embeddings={arch.max_position_embeddings}, "
                 f"rollout.max_seq_len={rollout_cfg.max_seq_len}")


def record_model(step_folder: Path, meta: dict) -> None:
    """Write the model's shape-deciding fields next to a checkpoint (rank 0)."""
    from ..fileio import write_text_atomic

    cfg = meta.get("hf_config", {})
    write_text_atomic(Path(step_folder) / MODEL_FILE, json.dumps(
        {"model_source": meta.get("model_source"),
         "hf_config": {k: cfg.get(k) for k in MODEL_FIELDS}}, indent=1) + "\n")


def check_checkpoint_model(step_folder: Optional[Path], meta: dict) -> None:
    """Refuse a checkpoint whose recorded model differs from ``meta``'s (this run's).
    A checkpoint without the record (an older one) is not checked here."""
    if step_folder is None:
        return
    f = Path(step_folder) / MODEL_FILE
    if not f.is_file():
        return
    try:
        saved = json.loads(f.read_text())
    except ValueError as e:
        raise CheckpointModelError(f"{f}: not valid JSON ({e}); the checkpoint folder "
                                   f"is damaged, resume from another step_N folder") from None
    mine = meta.get("hf_config", {})
    diff = [f"{k}: checkpoint {saved['hf_config'].get(k)!r} vs model {mine.get(k)!r}"
            for k in MODEL_FIELDS if saved.get("hf_config", {}).get(k) != mine.get(k)]
    if diff:
        raise CheckpointModelError(
            f"checkpoint.load: {step_folder} was saved from another model "
            f"({saved.get('model_source')}): " + "; ".join(diff) + f". Resume with "
            f"model.hf_path={saved.get('model_source')}, or point checkpoint.load at a "
            f"checkpoint of {meta.get('model_source')}")
