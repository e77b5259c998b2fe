"""Typed configuration: dataclasses, YAML recipes, ``section.field=value`` overrides.

One convention everywhere: a run's configuration is the defaults below, then each
``--config recipe.yaml`` in order, then command-line overrides written as dotted
``section.field=value`` pairs, e.g.::

    torchrun --nproc_per_node 2 pretrain_rl_tlt.py --config examples/rl/demo_cpu.yaml \
        parallel.tensor_model_parallel_size=2 model.dtype=float32

A string field takes the text after the first ``=`` verbatim (a regular expression or
a prompt needs no quoting; an empty value is "" or, for an optional string, not set);
other fields are parsed as YAML. OmegaConf does the merging and type coercion (the
same structured-config model NeMo and Hydra use); this module adds what users need on
top: errors that name the field, the file and line, and the closest valid key, and
checks against the model and the world size that fail before any compute.
"""

from __future__ import annotations

import argparse
import difflib
import sys
from dataclasses import MISSING, dataclass, field, fields, is_dataclass
from pathlib import Path
from typing import Any, Optional, Sequence

from .spec_strategy import POLICIES, Strategy, parse_arms

__all__ = [
    "Config", "ConfigError", "ModelConfig", "ParallelConfig", "PlatformConfig",
    "GenerateConfig", "RolloutConfig", "SpeculativeConfig", "DataConfig", "RewardConfig",
    "GRPOConfig", "TrainConfig", "DrafterGroupConfig", "CheckpointConfig", "TrackingConfig", "build_parser", "config_from_args", "load_config", "parse_args",
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
        "bfloat16, float16 (trained with megatron-core's dynamic loss scaling; steps whose "
        "gradients overflow are skipped and counted in updates_skipped).", "auto")
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
    collective_timeout_s: float = _help(
        "torch.distributed timeout of every collective (the process group's): a rank "
        "that waits longer for its peers fails instead of hanging.", 1800.0)
    heartbeat_timeout_s: float = _help(
        "Each rank beats through the rendezvous store; a rank whose peer sent no beat for "
        "this long exits (code 71) naming the dead or frozen rank (0 = off; one-process "
        "runs have none).", 300.0)

    def __post_init__(self):
        _positive("parallel", "tensor_model_parallel_size", self.tensor_model_parallel_size)
        _positive("parallel", "pipeline_model_parallel_size", self.pipeline_model_parallel_size)
        if self.collective_timeout_s <= 0 or self.heartbeat_timeout_s < 0:
            raise ConfigError("parallel.collective_timeout_s must be > 0 and "
                              "parallel.heartbeat_timeout_s >= 0 (0 = off)")


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
        "median of a sliding window of accepted tokens per second; with break_even, where "
        "speculation pays, the greedy arm is the gate's best speedup estimate, which "
        "compares chains on one shared acceptance profile), ucb1, or fixed (always "
        "`strategy`, for benchmarks).", "egreedy")
    strategy: str = _help(
        "The fixed strategy, depth_topk_verifytokens (top-k 1 = chain, e.g. 6_1_6; tree "
        "e.g. 5_4_16).", "7_1_7")
    buckets: str = _help("Batch-size bucket upper bounds, ascending.", "1,2,4,8,16,32")
    arms: str = _help(
        "Arms per bucket: 'BOUNDS:arm,arm;...' with a bound, a range lo-hi or * (the "
        "rest); arms are depth_topk_verifytokens, and 0_0_0 is 'do not speculate' (a "
        "plain step), so a bucket can learn that speculation does not pay there. In a "
        "YAML recipe quote a value that starts with * (YAML reads * as an alias); on the "
        "command line no quoting is needed (rollout.speculative.arms=*:2_1_2).",
        "1:6_1_6,7_1_7,8_1_8;2:4_1_4,5_1_5,6_1_6;3-4:3_1_3,4_1_4,5_1_5;"
        "5-8:2_1_2,3_1_3,4_1_4;*:0_0_0,1_1_1,2_1_2")
    min_draft_prob: float = _help(
        "Chains stop drafting once the drafter's probability of the whole draft would "
        "fall below this (0 = always draft the arm's depth); verification then spends "
        "rows only where acceptance is likely. Exact either way.", 0.0)
    epsilon: float = _help("egreedy: probability of a random arm.", 0.1)
    window: int = _help("Rewards per arm kept for the median (sliding window).", 50)
    ucb_c: float = _help("ucb1: exploration weight.", 1.0)
    break_even: bool = _help(
        "Break-even gate (egreedy, ucb1): every bucket may decline to speculate. From this "
        "run's own step times (plain decoding's at each batch size; each arm's relative to "
        "it, with its tokens per sequence) a bucket decodes plainly while its best arm's "
        "estimated rate is below plain's, and re-measures at a bounded cost "
        "(probe_budget), so a weak or stale drafter costs at most that and a retrained one "
        "is picked up again. false = the bandit alone (0_0_0 arms only where listed).",
        True)
    probe_budget: float = _help(
        "Break-even gate: the share of recent decode time (~200 steps, per bucket and "
        "over all buckets) that speculative steps may lose against plain decoding, "
        "probes included; a probe that confirms the loss halves it (down to an eighth).",
        0.01)
    seed: int = _help("Seed of the tuner's own random stream.", 0)
    tuner_state: str = _help(
        "JSON file the tuner's state is loaded from when it exists and saved to after "
        "each generate call; empty = not persisted.", "")

    def __post_init__(self):
        _positive("rollout.speculative", "threshold", self.threshold)
        _choice("rollout.speculative", "policy", self.policy, POLICIES)
        _positive("rollout.speculative", "window", self.window)
        for name, ok, want in (
                ("ucb_c", 0.0 <= self.ucb_c < float("inf"), "a finite number >= 0"),
                ("probe_budget", 0.0 <= self.probe_budget < 1.0, "in [0, 1)"),
                ("min_draft_prob", 0.0 <= self.min_draft_prob < 1.0, "in [0, 1)"),
                ("epsilon", 0.0 <= self.epsilon <= 1.0, "in [0, 1]")):
            if not ok:
                raise ConfigError(f"rollout.speculative.{name} must be {want}, got "
                                  f"{getattr(self, name)}")
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
    cpu_kernels: str = _help(
        "Fused CPU kernels for decode steps of up to 64 rows in float32 (panel-packed "
        "GEMM, RMSNorm, RoPE + KV write + attention, SwiGLU; the whole layer stack in "
        "one call at TP=1), compiled on first use for the CPU's instruction set (~1 min, "
        "cached; MEGATRON_TLT_CPU_ISA=avx512|avx2|portable forces a variant). auto: a "
        "calibration on the build's first use (a few seconds, stored next to the build, "
        "logged) times each kernel family against eager torch ops and they run only at "
        "the batch sizes where they measured faster; true: at every size; false: never "
        "(also MEGATRON_TLT_NO_CPU_KERNELS=1). Eager torch ops if compiling fails.",
        "auto")
    cuda_graphs: bool = _help(
        "Capture decode steps in CUDA graphs (CUDA only; one graph per batch-size "
        "bucket).", False)
    hidden_states_dtype: str = _help(
        "dtype of returned hidden states (kept on CPU): auto (model dtype), float32, "
        "bfloat16, float16.", "auto")
    sampling_mode: str = _help(
        "How sampled (temperature > 0) tokens are drawn. standard: per-request random "
        "generators; speculative decoding accepts drafts by rejection sampling (exact in "
        "distribution). coupled: every token is argmax(log p + Gumbel noise) with the "
        "noise a hash of (request seed, position in the response, token id), so a "
        "request's response is the same token for token whatever its batch, whether "
        "speculation is on, the drafter, the TP size or the device (up to floating-point "
        "near-ties); the drafter drafts with the same noise and verification accepts "
        "while its token equals the target's. Same distribution, reproducible rollouts; "
        "acceptance per token >= (1-TV)/(1+TV) instead of 1-TV.", "standard")
    speculative: SpeculativeConfig = _help("Speculative decoding.",
                                           factory=SpeculativeConfig)

    def __post_init__(self):
        _positive("rollout", "max_batch_size", self.max_batch_size)
        if self.max_seq_len < 0:
            raise ConfigError(f"rollout.max_seq_len must be >= 0 (0 = model's), "
                              f"got {self.max_seq_len}")
        _positive("rollout", "prefill_tokens", self.prefill_tokens)
        _choice("rollout", "attention", self.attention, ("auto", "sdpa", "flash"))
        # YAML / CLI booleans arrive as True / "False"; Python callers may pass bools
        self.cpu_kernels = str(self.cpu_kernels).strip().lower()
        _choice("rollout", "cpu_kernels", self.cpu_kernels, ("auto", "true", "false"))
        _choice("rollout", "hidden_states_dtype", self.hidden_states_dtype,
                ("auto", "float32", "bfloat16", "float16"))
        _choice("rollout", "sampling_mode", self.sampling_mode, ("standard", "coupled"))


# -------------------------------------------------------------------------------------
# RL training (pretrain_rl_tlt.py)
# -------------------------------------------------------------------------------------

@dataclass
class DataConfig:
    """Prompts: a reasoning-gym task, or a JSONL / Parquet file with reference answers."""

    source: str = _help(
        "reasoning_gym (a procedurally generated task, see data.task), jsonl or parquet "
        "(data.path, read with the `datasets` library).", "reasoning_gym")
    task: str = _help("reasoning-gym task name (data.source=reasoning_gym).",
                      "basic_arithmetic")
    task_params: dict = _help(
        "reasoning-gym task parameters, e.g. {min_terms: 2, max_terms: 2}; they override "
        "the task's preset key by key.", factory=dict)
    path: str = _help("Prompt file (data.source=jsonl or parquet).", "")
    prompt_field: str = _help(
        "Field holding the prompt: a string (the user message) or a list of chat messages "
        "({role, content}).", "prompt")
    answer_field: str = _help("Field holding the reference answer.", "answer")
    instruction: str = _help(
        "Appended to every user message on a new line (answer-format instruction); empty "
        "= none.", "Explain your steps, then state the final answer.")
    system_prompt: str = _help("System message; empty keeps the chat template's default.",
                               "")
    train_size: int = _help(
        "reasoning-gym: prompts in the training set (the run cycles through it, shuffled "
        "per epoch); files: 0 = every row.", 10000)
    eval_size: int = _help(
        "Held-out prompts scored every train.eval_interval steps (reasoning-gym: drawn "
        "from a disjoint seed; files: the last eval_size rows). 0 = no evaluation.", 0)
    seed: int = _help("Seed of the prompt set and of the per-epoch shuffle.", 0)
    max_prompt_tokens: int = _help(
        "Prompts longer than this (after the chat template) are an error (or skipped "
        "with data.skip_bad_rows).", 1024)
    skip_bad_rows: bool = _help(
        "Skip malformed rows (counted and reported) instead of stopping with an error "
        "that names the file, line and field.", False)

    def __post_init__(self):
        _choice("data", "source", self.source, ("reasoning_gym", "jsonl", "parquet"))
        if self.source != "reasoning_gym" and not self.path:
            raise ConfigError(f"data.source={self.source} needs data.path (the prompt file)")
        if self.train_size < 0 or self.eval_size < 0:
            raise ConfigError("data.train_size and data.eval_size must be >= 0")
        _positive("data", "max_prompt_tokens", self.max_prompt_tokens)


@dataclass
class RewardConfig:
    """Verifiers: how a response is scored against the reference answer."""

    verifier: str = _help(
        "auto (reasoning_gym for reasoning-gym tasks, math otherwise), reasoning_gym (the "
        "task's own score_answer), math (math-verify equivalence), exact (normalised "
        "string match).", "auto")
    answer_extraction: str = _help(
        "How the answer is taken from a response: auto (<answer> tag, else \\boxed{}, "
        "else the last number), answer_tag, boxed, last_number, last_line.", "auto")
    format_reward: float = _help(
        "Added to the reward when the response matches reward.format_pattern (0 = off).",
        0.0)
    format_pattern: str = _help(
        "Regular expression (searched, DOTALL) a well-formatted response matches.",
        r"<answer>.*?</answer>")
    correct_threshold: float = _help(
        "A response counts as correct (the accuracy metric) when its verifier score is at "
        "least this.", 1.0)
    timeout_seconds: float = _help(
        "Wall-clock bound per math-verify call (no SIGALRM: it runs in worker threads).",
        5.0)

    def __post_init__(self):
        _choice("reward", "verifier", self.verifier,
                ("auto", "reasoning_gym", "math", "exact"))
        _choice("reward", "answer_extraction", self.answer_extraction,
                ("auto", "answer_tag", "boxed", "last_number", "last_line"))
        import re as _re

        try:
            _re.compile(self.format_pattern)
        except _re.error as e:
            raise ConfigError(f"reward.format_pattern is not a valid regex: {e}") from None


@dataclass
class GRPOConfig:
    """The GRPO loss family (GRPO, DAPO, Dr. GRPO): sampling, advantages, loss."""

    prompts_per_step: int = _help("Prompts per RL step (over all DP replicas).", 32)
    group_size: int = _help(
        "Responses sampled per prompt (the GRPO group); >= 2: advantages are relative to "
        "the group, so a group of one has no baseline.", 8)
    max_new_tokens: int = _help("Response length cap in tokens.", 1024)
    temperature: float = _help(
        "Rollout sampling temperature T. The training, old, reference and rollout "
        "log-probs are all taken at it, log softmax(logits / T), so the PPO ratio, the TIS "
        "weight and the mismatch metric compare the distribution the sampler used.", 1.0)
    top_p: float = _help("Rollout top-p (1.0 = off). Shapes the sampling only: log-probs "
                         "are not truncated (verl's convention; see temperature).", 1.0)
    top_k: int = _help("Rollout top-k (0 = off). Shapes the sampling only, as top_p.", 0)
    norm_adv_by_std: bool = _help(
        "Divide group-centred rewards by the group's std (GRPO); false = Dr. GRPO.", True)
    clip_eps_low: float = _help("PPO ratio clip below: 1 - clip_eps_low.", 0.2)
    clip_eps_high: float = _help("PPO ratio clip above: 1 + clip_eps_high (DAPO "
                                 "clip-higher uses 0.28).", 0.28)
    dual_clip_c: float = _help("Dual-clip constant c > 1 for negative advantages "
                               "(0 = off).", 0.0)
    kl_beta: float = _help("KL-to-reference coefficient (0 = off, no reference model).",
                           0.0)
    kl_type: str = _help("KL estimator: k1 (logp - logp_ref) or k3 (exp(r) - r - 1, "
                         "r = logp_ref - logp).", "k3")
    entropy_coef: float = _help("Entropy bonus coefficient (entropy is reported "
                                "always).", 0.0)
    loss_agg: str = _help(
        "token-mean (DAPO), seq-mean-token-mean (GRPO), seq-mean-token-sum-norm (Dr. GRPO: "
        "token sums / max_new_tokens); denominators are global to the mini-batch.",
        "token-mean")
    overlong: str = _help(
        "Responses that hit max_new_tokens: none, mask (excluded from the loss) or penalty "
        "(DAPO soft punishment over the last overlong_buffer tokens).", "none")
    overlong_buffer: int = _help("penalty: length of the linear penalty zone.", 64)
    overlong_penalty: float = _help("penalty: reward subtracted at the cap (and "
                                    "beyond it: the penalty is floored there).", 1.0)
    dynamic_sampling: bool = _help(
        "DAPO dynamic sampling: replace groups whose rewards are all equal by fresh "
        "prompts, up to dynamic_sampling_rounds extra rollouts.", False)
    dynamic_sampling_rounds: int = _help("Extra rollout rounds at most per step.", 2)
    use_rollout_logprobs: bool = _help(
        "Use the engine's log-probs as the old log-probs instead of a forward pass of the "
        "pre-update model (saves a forward; exact only when engine and training forward "
        "agree).", False)
    tis_cap: float = _help(
        "Truncated importance sampling for the train/rollout mismatch: weight each token "
        "by min(exp(logp_old - logp_rollout), tis_cap) (0 = off).", 0.0)
    ppo_epochs: int = _help("Passes over the step's samples.", 1)

    def __post_init__(self):
        _positive("grpo", "prompts_per_step", self.prompts_per_step)
        if self.group_size < 2:
            raise ConfigError(
                f"grpo.group_size must be >= 2, got {self.group_size}: GRPO's advantage "
                f"is a response's reward relative to the others of its prompt's group, so a "
                f"group of one always has advantage 0 and nothing would be learned; "
                f"sample at least 2 responses per prompt")
        _positive("grpo", "max_new_tokens", self.max_new_tokens)
        _positive("grpo", "ppo_epochs", self.ppo_epochs)
        _choice("grpo", "kl_type", self.kl_type, ("k1", "k3"))
        _choice("grpo", "loss_agg", self.loss_agg,
                ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"))
        _choice("grpo", "overlong", self.overlong, ("none", "mask", "penalty"))
        if self.temperature <= 0:
            raise ConfigError("grpo.temperature must be > 0 (RL samples; greedy rollouts "
                              "give every group equal rewards)")
        if not (0 <= self.clip_eps_low < 1) or self.clip_eps_high < 0:
            raise ConfigError("grpo.clip_eps_low must be in [0, 1) and grpo.clip_eps_high "
                              ">= 0")
        if self.dual_clip_c and self.dual_clip_c <= 1:
            raise ConfigError(f"grpo.dual_clip_c must be > 1 (or 0 = off), got "
                              f"{self.dual_clip_c}")
        if self.overlong == "penalty" and not 0 < self.overlong_buffer <= self.max_new_tokens:
            raise ConfigError(f"grpo.overlong_buffer must be in [1, grpo.max_new_tokens="
                              f"{self.max_new_tokens}] with grpo.overlong=penalty, got "
                              f"{self.overlong_buffer}")
        if self.tis_cap < 0 or self.kl_beta < 0:
            raise ConfigError("grpo.tis_cap and grpo.kl_beta must be >= 0")


@dataclass
class TrainConfig:
    """Optimisation: steps, batches, optimizer, schedule, evaluation."""

    steps: int = _help("RL steps to run (a resumed run continues up to this many).", 100)
    global_batch_size: int = _help(
        "Samples (responses) per optimizer step, over all DP replicas; 0 = all of a step's "
        "samples (one optimizer step per ppo epoch). Must divide prompts_per_step x "
        "group_size.", 0)
    micro_batch_size: int = _help("Samples per forward/backward at most.", 4)
    micro_batch_tokens: int = _help(
        "Padded tokens per micro-batch at most (samples are sorted by length to minimise "
        "padding); bounds the logits' memory (tokens x vocabulary / TP x 4 bytes, a few "
        "copies); 0 = no token budget.", 4096)
    optimizer: str = _help(
        "auto (megatron-core's optimizer; its distributed optimizer on CUDA), megatron, "
        "torch (torch.optim.AdamW over megatron-core DDP's gradient buffers; no fp32 main "
        "weights and no loss scaling: refused with model.dtype=float16).", "auto")
    lr: float = _help("Peak learning rate.", 1e-6)
    min_lr: float = _help("Final learning rate of the cosine decay.", 0.0)
    lr_warmup_steps: int = _help("Linear warm-up, in optimizer steps.", 0)
    lr_decay: str = _help("After warm-up: constant or cosine (to min_lr at the last "
                          "optimizer step).", "constant")
    weight_decay: float = _help("AdamW weight decay.", 0.0)
    adam_beta1: float = _help("AdamW beta1.", 0.9)
    adam_beta2: float = _help("AdamW beta2.", 0.999)
    adam_eps: float = _help("AdamW epsilon.", 1e-8)
    clip_grad: float = _help("Gradient clipping by global norm (0 = off).", 1.0)
    eval_interval: int = _help("Evaluate on the held-out prompts (data.eval_size) every "
                               "N steps, before the first and after the last; 0 = never.",
                               0)
    eval_temperature: float = _help("Sampling temperature for evaluation (0 = greedy).",
                                    0.0)
    max_nonfinite_steps: int = _help(
        "Steps whose reward or loss is NaN or inf are skipped (no optimizer update), "
        "warned about and counted (metrics nonfinite/*); the run stops with an error "
        "once more than this many were skipped (0 = at the first).", 3)

    def __post_init__(self):
        _positive("train", "steps", self.steps)
        _positive("train", "micro_batch_size", self.micro_batch_size)
        _choice("train", "optimizer", self.optimizer, ("auto", "megatron", "torch"))
        _choice("train", "lr_decay", self.lr_decay, ("constant", "cosine"))
        if self.lr < 0 or self.min_lr < 0 or self.min_lr > self.lr:
            raise ConfigError("train.lr must be >= 0 and 0 <= train.min_lr <= train.lr")
        if self.global_batch_size < 0 or self.micro_batch_tokens < 0:
            raise ConfigError("train.global_batch_size and train.micro_batch_tokens must "
                              "be >= 0")
        if self.max_nonfinite_steps < 0:
            raise ConfigError("train.max_nonfinite_steps must be >= 0")


@dataclass
class DrafterGroupConfig:
    """Online drafter training on idle replicas (the drafter group): a DP replica that
    finished its rollout trains the drafter on its buffered responses until the last
    replica finishes; at the step barrier the replicas' drafters and optimizer states
    are averaged, weighted by their step counts."""

    enable: bool = _help(
        "Train the drafter in the rollout tail. Needs rollout.speculative or starts from "
        "a random drafter when rollout.speculative.drafter is empty; PP = 1 only.", False)
    min_idle_replicas: int = _help(
        "Replicas that must have finished before any of them trains (1 = each trains as "
        "soon as it finishes).", 1)
    max_steps_per_window: int = _help("Drafter optimizer steps per replica per RL step at "
                                      "most.", 32)
    loss: str = _help(
        "Drafter loss preset (eagle, kl, tv, log_accept, kl+tv), computed at the rollout's "
        "sampling settings (grpo.temperature / top_p / top_k); the default is the warm-up's.",
        "kl+tv")
    lr: float = _help("Drafter AdamW peak learning rate (chosen by tools/sweep_drafter_lr.py: "
                      "docs/benchmarks.md).", 1e-3)
    lr_warmup_steps: int = _help("Linear warm-up, in drafter optimizer steps.", 4)
    lr_decay: str = _help("After warm-up: constant or cosine (to lr x min_lr_ratio at "
                          "train.steps x max_steps_per_window drafter steps).", "constant")
    min_lr_ratio: float = _help("Final learning rate of the cosine decay, as a fraction of "
                                "lr.", 0.1)
    weight_decay: float = _help("Drafter AdamW weight decay.", 0.0)
    grad_clip: float = _help("Drafter gradient clipping by global norm (0 = off).", 1.0)
    batch_tokens: int = _help(
        "Padded tokens per drafter micro-step (one response per row). A micro-step is the "
        "preemption bound: the last replica waits for at most one.", 512)
    stop_checks: int = _help(
        "Stop-flag reads per micro-step: its rows run in this many chunks whose gradients "
        "accumulate, the flag read before each; a stop mid-step applies the chunks done. "
        "The last replica then waits for one chunk, not one micro-step (1 = per step).", 4)
    buffer_tokens: int = _help(
        "Responses' feature rows held per replica for training (CPU memory: rows x "
        "hidden x 4 bytes); the current and the previous step's responses, oldest "
        "dropped first.", 65536)
    canary_sequences: int = _help("Buffered responses the after-update canary measures "
                                  "alpha on (0 = no canary).", 4)
    canary_min_alpha: float = _help(
        "Warn when the canary's alpha falls below this (a drafter corrupted by a weight "
        "update accepts about 1 token per step).", 0.05)
    overlap_sync: bool = _help(
        "Run the step's drafter averaging (one coalesced transfer of weights and AdamW "
        "moments) behind the policy update instead of before it; its write-back and "
        "checksum follow the update, before the canary and the next rollout.", True)
    poll_seconds: float = _help("Wait between checks while fewer than min_idle_replicas "
                                "have finished.", 0.005)

    def __post_init__(self):
        _positive("drafter_group", "min_idle_replicas", self.min_idle_replicas)
        _positive("drafter_group", "max_steps_per_window", self.max_steps_per_window)
        _positive("drafter_group", "batch_tokens", self.batch_tokens)
        _positive("drafter_group", "stop_checks", self.stop_checks)
        _positive("drafter_group", "buffer_tokens", self.buffer_tokens)
        _choice("drafter_group", "lr_decay", self.lr_decay, ("constant", "cosine"))
        from .drafter_training.losses import LOSS_PRESETS

        _choice("drafter_group", "loss", self.loss, tuple(LOSS_PRESETS))
        if self.lr <= 0 or not 0 <= self.min_lr_ratio <= 1:
            raise ConfigError("drafter_group.lr must be > 0 and drafter_group.min_lr_ratio "
                              f"in [0, 1], got {self.lr} and {self.min_lr_ratio}")
        if self.lr_warmup_steps < 0 or self.canary_sequences < 0 or self.poll_seconds < 0:
            raise ConfigError("drafter_group.lr_warmup_steps, canary_sequences and "
                              "poll_seconds must be >= 0")


@dataclass
class CheckpointConfig:
    """Run state on disk: model, optimizer, data position, RNG, tuner, drafter."""

    save: str = _help("Folder for checkpoints (empty = none are written).", "")
    load: str = _help("Folder to resume from (its latest checkpoint); empty = start "
                      "fresh.", "")
    save_interval: int = _help("Save every N steps (and at the end); 0 = only at the "
                               "end.", 0)
    export_hf: bool = _help(
        "At the end of the run, write the trained policy as a Hugging Face folder "
        "(safetensors, config, tokenizer) to {save}/hf, or {run folder}/hf when "
        "checkpoint.save is empty, with the drafter (if any) in its drafter/ subfolder; "
        "tools/convert_hf_checkpoint.py does the same for any saved step.", False)
    stop_deadline_s: float = _help(
        "On SIGTERM, SIGUSR1 or the file {save}/STOP the run checkpoints after the current "
        "step and exits with code 75 (requeue); if that takes longer than this, or a "
        "second signal comes, it exits at once with code 76 without writing (0 = no "
        "deadline). Keep it below the scheduler's warning time (--signal=B:TERM@120).",
        90.0)
    keep_last: int = _help("Keep the newest N checkpoints under checkpoint.save, removing "
                           "older ones after each save; 0 = keep all.", 3)
    fallback_to_previous: bool = _help(
        "On resume, when the newest checkpoint is incomplete or corrupt, load the newest "
        "complete older one instead of stopping with the error.", False)

    def __post_init__(self):
        if self.save_interval < 0:
            raise ConfigError("checkpoint.save_interval must be >= 0")
        if self.stop_deadline_s < 0:
            raise ConfigError("checkpoint.stop_deadline_s must be >= 0 (0 = no deadline)")
        if self.keep_last < 0:
            raise ConfigError(f"checkpoint.keep_last={self.keep_last} must be >= 0 "
                              f"(0 keeps every checkpoint)")


@dataclass
class TrackingConfig:
    """Where metrics go: JSONL, Weights & Biases, the terminal."""

    output_dir: str = _help("Where run folders go: a run writes {output_dir}/{run_name}/ "
                            "(config.json, metrics.jsonl, summary.json, plots, W&B files).",
                            "runs/rl")
    run_name: str = _help("Run name (W&B and the run folder); empty = the start time "
                          "(a clash takes a versioned name, as on_existing_run=new_version).",
                          "")
    on_existing_run: str = _help(
        "A new run (checkpoint.load empty) whose run folder already holds files: error "
        "= stop before anything is loaded or written, naming the folder and the ways on; "
        "new_version = write {run_name}-1 (then -2, ...) instead. Nothing is ever "
        "overwritten: a resumed run (checkpoint.load set) appends to its folder after the "
        "resumed step, moves records an interrupted attempt wrote past that step to "
        "metrics.after-step-N.jsonl, and keeps each attempt's config "
        "(config.json, config.resume-1.json, ...).", "error")
    wandb_project: str = _help("W&B project; empty = W&B off.", "")
    wandb_mode: str = _help("offline (default: no network, sync later with `wandb sync`), "
                            "online, disabled.", "offline")
    wandb_entity: str = _help("W&B entity (team); empty = the default.", "")
    progress: bool = _help("Rich progress bars with ETA on the terminal (rank 0).", True)
    plots: bool = _help("Write PNG plots of the run at the end (tools/plot_run.py).",
                        True)

    def __post_init__(self):
        _choice("tracking", "wandb_mode", self.wandb_mode,
                ("offline", "online", "disabled"))
        _choice("tracking", "on_existing_run", self.on_existing_run,
                ("error", "new_version"))


@dataclass
class Config:
    """Everything a megatron_tlt run reads. Sections are added as features land."""

    model: ModelConfig = _help("Model and weights.", factory=ModelConfig)
    parallel: ParallelConfig = _help("Parallel layout.", factory=ParallelConfig)
    platform: PlatformConfig = _help("Device, backend, seed.", factory=PlatformConfig)
    generate: GenerateConfig = _help("Plain generation.", factory=GenerateConfig)
    rollout: RolloutConfig = _help("Rollout engine.", factory=RolloutConfig)
    data: DataConfig = _help("Prompts.", factory=DataConfig)
    reward: RewardConfig = _help("Verifiers.", factory=RewardConfig)
    grpo: GRPOConfig = _help("GRPO loss family.", factory=GRPOConfig)
    train: TrainConfig = _help("Optimisation.", factory=TrainConfig)
    drafter_group: DrafterGroupConfig = _help("Online drafter training on idle replicas.",
                                              factory=DrafterGroupConfig)
    checkpoint: CheckpointConfig = _help("Checkpoints.", factory=CheckpointConfig)
    tracking: TrackingConfig = _help("Metrics and logging.", factory=TrackingConfig)


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
    from .overrides import apply_override

    for item in overrides:
        merged = apply_override(merged, item, cls)
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
    if cfg.drafter_group.enable and pp > 1:
        raise ConfigError(
            f"drafter_group.enable=true needs parallel.pipeline_model_parallel_size=1 "
            f"(the drafter group trains on unsharded stages), got {pp}; set "
            f"drafter_group.enable=false (rollout.speculative.drafter still speculates "
            f"at PP > 1) or PP = 1")
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
