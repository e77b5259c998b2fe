"""Typed configuration: dataclasses, YAML recipes, ``section.field=value`` overrides.

One convention everywhere: a run's configuration is the defaults below, then each
``--config recipe.yaml`` in order, then command-line overrides written as dotted
``section.field=value`` pairs, e.g.::

    torchrun --nproc_per_node 2 pretrain_rl_tlt.py --config examples/rl/demo_cpu.yaml \
        parallel.tensor_model_parallel_size=2 model.dtype=float32

OmegaConf does the merging and type coercion (the same structured-config model NeMo
and Hydra use); this module adds what users need on top: errors that name the field,
the file and line, and the closest valid key, and checks against the model and the
world size that fail before any compute.
"""

from __future__ import annotations

import argparse
import difflib
import sys
from dataclasses import MISSING, dataclass, field, fields, is_dataclass
from pathlib import Path
from typing import Any, Optional, Sequence

__all__ = [
    "Config", "ConfigError", "ModelConfig", "ParallelConfig", "PlatformConfig",
    "GenerateConfig", "RolloutConfig", "SpeculativeConfig", "build_parser", "config_from_args", "load_config", "parse_args",
    "validate_for_run",
]


class ConfigError(ValueError):
    """A configuration problem a user can fix; the message says which field and how."""


def _help(text: str, default: Any = MISSING, factory: Any = MISSING):
    if factory is not MISSING:
        return field(default_factory=factory, metadata={"help": text})
    return field(default=default, metadata={"help": text})


def _choice(section: str, name: str, value: str, choices: Sequence[str]) -> None:
    if value not in choices:
        close = difflib.get_close_matches(str(value), choices, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise ConfigError(
            f"{section}.{name}={value!r} is not valid{hint}; choose one of {', '.join(choices)}"
        )


def _positive(section: str, name: str, value: int) -> None:
    if value < 1:
        raise ConfigError(f"{section}.{name} must be >= 1, got {value}")


@dataclass
class ModelConfig:
    """Which model to build and where its weights come from."""

    hf_path: Optional[str] = _help(
        "Hugging Face model folder (config.json + safetensors) or a megatron_tlt "
        "checkpoint from tools/convert_hf_checkpoint.py; 'smollm2' means the prepared "
        "SmolLM2-135M-Instruct asset (tools/prepare_assets.py).", None)
    dtype: str = _help(
        "Parameter and compute dtype: auto (bfloat16 on CUDA, float32 on CPU), float32, "
        "bfloat16, float16.", "auto")
    transformer_impl: str = _help(
        "Layer implementation: auto (Transformer Engine when installed and CUDA is "
        "present, else local), local (megatron-core modules), transformer_engine.", "auto")

    def __post_init__(self):
        _choice("model", "dtype", self.dtype, ("auto", "float32", "bfloat16", "float16"))
        _choice("model", "transformer_impl", self.transformer_impl,
                ("auto", "local", "transformer_engine"))


@dataclass
class ParallelConfig:
    """megatron-core parallel layout; data parallel size is world_size / (TP x PP)."""

    tensor_model_parallel_size: int = _help(
        "Tensor-parallel size: must divide the attention heads and the KV groups.", 1)
    pipeline_model_parallel_size: int = _help(
        "Pipeline-parallel size: must divide the number of layers.", 1)

    def __post_init__(self):
        _positive("parallel", "tensor_model_parallel_size", self.tensor_model_parallel_size)
        _positive("parallel", "pipeline_model_parallel_size", self.pipeline_model_parallel_size)


@dataclass
class PlatformConfig:
    """Hardware and reproducibility."""

    device: str = _help("auto (CUDA when available, else CPU), cuda or cpu.", "auto")
    backend: str = _help("torch.distributed backend: auto (nccl on CUDA, gloo on CPU), "
                         "nccl, gloo.", "auto")
    seed: int = _help("Seed for Python, NumPy, torch and megatron-core's RNG streams.", 1234)

    def __post_init__(self):
        _choice("platform", "device", self.device, ("auto", "cuda", "cpu"))
        _choice("platform", "backend", self.backend, ("auto", "nccl", "gloo"))


@dataclass
class GenerateConfig:
    """Plain generation (the demo and tools)."""

    prompt: str = _help("User message, wrapped in the model's chat template.",
                        "What is 7 + 5? Answer briefly.")
    max_new_tokens: int = _help("Tokens to generate at most.", 32)

    def __post_init__(self):
        _positive("generate", "max_new_tokens", self.max_new_tokens)


@dataclass
class SpeculativeConfig:
    """Speculative decoding in the rollout engine (EAGLE drafter, exact verification)."""

    drafter: str = _help(
        "Drafter checkpoint (.safetensors file or folder, from tools/warmup_drafter.py); "
        "empty = speculative decoding off.", "")
    threshold: int = _help(
        "Speculate only while the running batch has at most this many sequences (the "
        "long tail); larger batches decode plainly. Switching on mid-generation costs one "
        "drafter pass over the positions it missed, never a target re-prefill.", 16)
    policy: str = _help(
        "Strategy choice per batch-size bucket: egreedy (BEG-MAB: epsilon-greedy over the "
        "median of a sliding window of accepted tokens per second), ucb1, or fixed "
        "(always `strategy`, for benchmarks).", "egreedy")
    strategy: str = _help(
        "The fixed strategy, depth_topk_verifytokens (top-k 1 = chain, e.g. 6_1_6; tree "
        "e.g. 5_4_16).", "7_1_7")
    buckets: str = _help("Batch-size bucket upper bounds, ascending.", "1,2,4,8,16,32")
    arms: str = _help(
        "Arms per bucket: 'BOUNDS:arm,arm;...' with a bound, a range lo-hi or * (the "
        "rest); arms are depth_topk_verifytokens, and 0_0_0 is 'do not speculate' (a "
        "plain step), so a bucket can learn that speculation does not pay there. On the "
        "command line quote a value that starts with * (YAML reads * as an alias): "
        "rollout.speculative.arms='\"*:2_1_2\"'.",
        "1:6_1_6,7_1_7,8_1_8;2:4_1_4,5_1_5,6_1_6;3-4:3_1_3,4_1_4,5_1_5;"
        "5-8:2_1_2,3_1_3,4_1_4;*:0_0_0,1_1_1,2_1_2")
    min_draft_prob: float = _help(
        "Chains stop drafting once the drafter's probability of the whole draft would "
        "fall below this (0 = always draft the arm's depth); verification then spends "
        "rows only where acceptance is likely. Exact either way.", 0.0)
    epsilon: float = _help("egreedy: probability of a random arm.", 0.1)
    window: int = _help("Rewards per arm kept for the median (sliding window).", 50)
    ucb_c: float = _help("ucb1: exploration weight.", 1.0)
    seed: int = _help("Seed of the tuner's own random stream.", 0)
    tuner_state: str = _help(
        "JSON file the tuner's state is loaded from when it exists and saved to after "
        "each generate call; empty = not persisted.", "")

    def __post_init__(self):
        _positive("rollout.speculative", "threshold", self.threshold)
        _choice("rollout.speculative", "policy", self.policy, ("egreedy", "ucb1", "fixed"))
        _positive("rollout.speculative", "window", self.window)
        if not 0.0 <= self.min_draft_prob < 1.0:
            raise ConfigError(f"rollout.speculative.min_draft_prob must be in [0, 1), got "
                              f"{self.min_draft_prob}")
        if not 0.0 <= self.epsilon <= 1.0:
            raise ConfigError(f"rollout.speculative.epsilon must be in [0, 1], got "
                              f"{self.epsilon}")
        from .rollout.tuner import Strategy, parse_arms

        try:
            Strategy.parse(self.strategy)
            parse_arms(self.arms, self.buckets)
        except ValueError as e:
            raise ConfigError(f"rollout.speculative: {e}") from None


@dataclass
class RolloutConfig:
    """Rollout engine (``megatron_tlt.rollout.RolloutEngine``)."""

    max_batch_size: int = _help(
        "Sequences decoded at once; more prompts queue and enter as rows free up. "
        "KV-cache memory is 2 x layers x max_batch_size x kv_heads/TP x capacity x "
        "head_dim x dtype bytes, capacity = longest prompt + max_new_tokens of a call "
        "(at most max_seq_len).", 64)
    max_seq_len: int = _help(
        "Longest prompt + response, in tokens; 0 means the model's "
        "max_position_embeddings. A prompt this long or longer is an error.", 0)
    prefill_tokens: int = _help(
        "Prompt tokens (padded) processed per prefill forward; bounds prefill "
        "activation memory.", 4096)
    attention: str = _help(
        "Attention kernel: auto (flash-attn's KV-cache kernel on CUDA when installed, "
        "else torch scaled_dot_product_attention), sdpa, flash.", "auto")
    cpu_kernels: bool = _help(
        "Fused CPU kernels for one-token decode steps of up to 64 rows in float32 "
        "(panel-packed GEMM, RMSNorm, RoPE + KV write + attention, SwiGLU; the whole "
        "layer stack in one call at TP=1); compiled on first use (~1 min, cached), eager "
        "torch ops if compiling fails.", True)
    cuda_graphs: bool = _help(
        "Capture decode steps in CUDA graphs (CUDA only; one graph per batch-size "
        "bucket).", False)
    hidden_states_dtype: str = _help(
        "dtype of returned hidden states (kept on CPU): auto (model dtype), float32, "
        "bfloat16, float16.", "auto")
    speculative: SpeculativeConfig = _help("Speculative decoding.",
                                           factory=SpeculativeConfig)

    def __post_init__(self):
        _positive("rollout", "max_batch_size", self.max_batch_size)
        if self.max_seq_len < 0:
            raise ConfigError(f"rollout.max_seq_len must be >= 0 (0 = model's), "
                              f"got {self.max_seq_len}")
        _positive("rollout", "prefill_tokens", self.prefill_tokens)
        _choice("rollout", "attention", self.attention, ("auto", "sdpa", "flash"))
        _choice("rollout", "hidden_states_dtype", self.hidden_states_dtype,
                ("auto", "float32", "bfloat16", "float16"))


@dataclass
class Config:
    """Everything a megatron_tlt run reads. Sections are added as features land."""

    model: ModelConfig = _help("Model and weights.", factory=ModelConfig)
    parallel: ParallelConfig = _help("Parallel layout.", factory=ParallelConfig)
    platform: PlatformConfig = _help("Device, backend, seed.", factory=PlatformConfig)
    generate: GenerateConfig = _help("Plain generation.", factory=GenerateConfig)
    rollout: RolloutConfig = _help("Rollout engine.", factory=RolloutConfig)


# -------------------------------------------------------------------------------------
# loading
# -------------------------------------------------------------------------------------

def _all_keys(cls, prefix: str = "") -> list[str]:
    keys = []
    for f in fields(cls):
        key = f"{prefix}{f.name}"
        sub = f.type if is_dataclass(f.type) else None
        if sub is None and f.default_factory is not MISSING and is_dataclass(f.default_factory):
            sub = f.default_factory
        if sub is not None:
            keys.append(key)
            keys.extend(_all_keys(sub, key + "."))
        else:
            keys.append(key)
    return keys


def _closest_hint(key: str, cls) -> str:
    close = difflib.get_close_matches(key, _all_keys(cls), n=1, cutoff=0.5)
    return f"; did you mean '{close[0]}'?" if close else ""


def _yaml_line(path: Path, dotted: str) -> Optional[int]:
    """1-based line of ``dotted`` (a.b.c) in a YAML file, if it can be found."""
    import yaml

    try:
        node = yaml.compose(path.read_text())
    except yaml.YAMLError:
        return None
    for part in dotted.split("."):
        if not isinstance(node, yaml.MappingNode):
            return None
        for k, v in node.value:
            if k.value == part:
                line, node = k.start_mark.line + 1, v
                break
        else:
            return None
    return line


def _translate(err: Exception, cls, origin: str, path: Optional[Path] = None) -> ConfigError:
    """omegaconf's exception -> ConfigError naming field, place and fix."""
    from omegaconf.errors import ConfigKeyError, ValidationError

    key = getattr(err, "full_key", None) or "?"
    where = origin
    if path is not None:
        line = _yaml_line(path, key)
        where = f"{path}:{line}" if line else str(path)
    if isinstance(err, ConfigKeyError):
        return ConfigError(f"{where}: unknown config key '{key}'{_closest_hint(key, cls)}")
    if isinstance(err, ValidationError):
        msg = (getattr(err, "msg", None) or str(err)).splitlines()[0]
        if key == "?":
            return ConfigError(f"{where}: {msg}")
        return ConfigError(f"{where}: bad value for '{key}': {msg}")
    return ConfigError(f"{where}: {err}")


def load_config(config_files: Sequence[str | Path] = (), overrides: Sequence[str] = (),
                cls=Config):
    """Defaults <- each YAML file in order <- ``section.field=value`` overrides."""
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    merged = OmegaConf.structured(cls)
    for f in config_files:
        path = Path(f)
        if not path.is_file():
            raise ConfigError(f"config file {path} does not exist")
        try:
            layer = OmegaConf.load(path)
        except Exception as e:  # YAML syntax errors carry their own line numbers
            raise ConfigError(f"{path}: cannot parse YAML: {e}") from None
        try:
            merged = OmegaConf.merge(merged, layer)
        except OmegaConfBaseException as e:
            raise _translate(e, cls, str(path), path) from None
    for item in overrides:
        if "=" not in item or item.startswith("="):
            raise ConfigError(
                f"command-line override {item!r} is not of the form section.field=value "
                f"(e.g. parallel.tensor_model_parallel_size=2)")
        try:
            merged = OmegaConf.merge(merged, OmegaConf.from_dotlist([item]))
        except OmegaConfBaseException as e:
            raise _translate(e, cls, "command line") from None
    try:
        return OmegaConf.to_object(merged)
    except OmegaConfBaseException as e:
        raise _translate(e, cls, "config") from None


def build_parser(description: str = "") -> argparse.ArgumentParser:
    """The entry-point parser: ``[--config FILE]... [section.field=value]...``.

    Tools add their own flags (e.g. an output folder) to it and pass the parsed
    namespace to ``config_from_args``.
    """
    parser = argparse.ArgumentParser(
        description=description,
        epilog="Overrides: section.field=value, e.g. parallel.tensor_model_parallel_size=2. "
               "All fields: --help-config.")
    parser.add_argument("--config", action="append", default=[], metavar="FILE",
                        help="YAML recipe; may repeat, later files win")
    parser.add_argument("--help-config", action="store_true",
                        help="list every config field with its default and exit")
    parser.add_argument("overrides", nargs="*", metavar="section.field=value")
    return parser


def config_from_args(args: argparse.Namespace, cls=Config):
    if args.help_config:
        print(describe(cls))
        sys.exit(0)
    return load_config(args.config, args.overrides, cls)


def parse_args(argv: Optional[Sequence[str]] = None, cls=Config, description: str = ""):
    """Parse an entry point's command line into a validated ``cls`` instance."""
    return config_from_args(build_parser(description).parse_args(argv), cls)


def describe(cls=Config, markdown: bool = False) -> str:
    """Every field with type, default and help (``--help-config``, docs/configuration.md)."""
    lines = []
    if markdown:
        lines += ["# Configuration reference", "",
                  "Generated by `python -m megatron_tlt.config --markdown`; do not edit.",
                  "Set fields in a YAML recipe (`--config FILE`) or on the command line as",
                  "`section.field=value`; later sources win.", ""]
    def emit(prefix: str, sub) -> None:
        doc = (sub.__doc__ or "").strip()
        lines.extend([f"## `{prefix}`", "", doc, "", "| field | type | default | meaning |",
                      "|---|---|---|---|"] if markdown else [f"{prefix}: {doc}"])
        nested = []
        for f in fields(sub):
            if f.default_factory is not MISSING and is_dataclass(f.default_factory):
                nested.append((f"{prefix}.{f.name}", f.default_factory))
                continue
            typ = getattr(f.type, "__name__", str(f.type)).replace("typing.", "")
            default = f.default if f.default is not MISSING else "(required)"
            if markdown:
                lines.append(f"| `{prefix}.{f.name}` | {typ} | `{default!r}` | "
                             f"{f.metadata.get('help', '')} |")
            else:
                lines.append(f"  {prefix}.{f.name} ({typ}, default {default!r}): "
                             f"{f.metadata.get('help', '')}")
        lines.append("")
        for name, cls_ in nested:
            emit(name, cls_)

    for section in fields(cls):
        emit(section.name, section.default_factory)
    return "\n".join(lines)


# -------------------------------------------------------------------------------------
# checks against the model and the launch
# -------------------------------------------------------------------------------------

def validate_for_run(cfg: Config, arch, world_size: int) -> None:
    """Checks that need the model's architecture and the world size; run before compute."""
    tp = cfg.parallel.tensor_model_parallel_size
    pp = cfg.parallel.pipeline_model_parallel_size
    if arch.num_attention_heads % tp:
        raise ConfigError(
            f"parallel.tensor_model_parallel_size={tp} does not divide the model's "
            f"{arch.num_attention_heads} attention heads; use a divisor of "
            f"{arch.num_attention_heads}")
    if arch.num_query_groups % tp:
        raise ConfigError(
            f"parallel.tensor_model_parallel_size={tp} does not divide the model's "
            f"{arch.num_query_groups} KV groups (num_key_value_heads); use a divisor of "
            f"{arch.num_query_groups}")
    if arch.num_layers % pp:
        raise ConfigError(
            f"parallel.pipeline_model_parallel_size={pp} does not divide the model's "
            f"{arch.num_layers} layers; use a divisor of {arch.num_layers}")
    if world_size % (tp * pp):
        raise ConfigError(
            f"world size {world_size} is not divisible by parallel.tensor_model_parallel_size "
            f"({tp}) x parallel.pipeline_model_parallel_size ({pp}) = {tp * pp}; launch a "
            f"multiple of {tp * pp} processes or change the parallel sizes")


if __name__ == "__main__":
    print(describe(markdown="--markdown" in sys.argv[1:]))
