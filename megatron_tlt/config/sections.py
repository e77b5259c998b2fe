"""The model, layout, platform, generation and rollout sections, and ``Config`` itself."""

from __future__ import annotations


from dataclasses import dataclass
from typing import Optional

from ..spec_strategy import POLICIES, Strategy, parse_arms
from .base import ConfigError, _choice, _help, _positive
from .kinds import KindSettings
from .rl_sections import (CheckpointConfig, DataConfig, DrafterGroupConfig, GRPOConfig,
                          RewardConfig, TrackingConfig, TrainConfig)


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
    expert_model_parallel_size: int = _help(
        "Expert-parallel size EP of mixture-of-experts models: each rank of an EP group "
        "(EP consecutive data-parallel ranks) holds num_experts / EP experts of every "
        "MoE layer; must divide num_experts and the data-parallel size. The EP group's "
        "replicas decode their prompts together in the rollout. 1 for dense models.", 1)
    sequence_parallel: str = _help(
        "megatron-core sequence parallelism of the trained model at TP > 1 (the "
        "activations outside attention and MLP sharded along the sequence over the TP "
        "group: activation memory / TP for those parts; micro-batches are padded to a "
        "multiple of TP): auto (on at TP > 1), on, off. Ignored at TP = 1.", "auto")
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
        _positive("parallel", "expert_model_parallel_size", self.expert_model_parallel_size)
        # YAML reads a bare on/off as a boolean: take true/false as on/off
        self.sequence_parallel = {"true": "on", "false": "off"}.get(
            str(self.sequence_parallel).lower(), str(self.sequence_parallel))
        _choice("parallel", "sequence_parallel", self.sequence_parallel, ("auto", "on", "off"))
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


# flash-attn 2.x (2.7.3, the gpu extra's floor, through 2.8.3): a paged KV cache's
# page_block_size must be a multiple of this (its mha_fwd_kvcache checks it)
FLASH_PAGE_MULTIPLE = 256

# the tuner's arms per batch-size bucket (a kind may set its own: config/kinds/)
DEFAULT_ARMS = ("1:6_1_6,7_1_7,8_1_8;2:4_1_4,5_1_5,6_1_6;3-4:3_1_3,4_1_4,5_1_5;"
                "5-8:2_1_2,3_1_3,4_1_4;*:0_0_0,1_1_1,2_1_2")


@dataclass
class SpeculativeConfig:
    """Speculative decoding in the rollout engine (exact verification): the settings
    every drafter kind shares; a kind's own are in `kinds` (config/kinds/)."""

    drafter: str = _help(
        "Drafter checkpoint (.safetensors file or folder, from tools/warmup_drafter.py), "
        "or 'self': the policy's own weight-only int8 copy (self-speculation; no "
        "training, re-quantized after every policy update); empty = speculative "
        "decoding off.", "")
    free_too: str = _help(
        "Model-free drafter kinds beside drafter (comma-separated: prompt_lookup, "
        "group_history): each row takes a free kind's match where it is expected to emit "
        "at least what the bucket's kind would (rollout/speculative/multi.py).", "")
    free_alone: bool = _help(
        "Where the bucket's kind is declined (its break-even gate, or a 0_0_0 arm), rows "
        "whose model-free match is expected to pay still speculate with it, the others "
        "decoding plainly in the same verification (multi.KindDecoder.alone); false: "
        "such steps decode plainly. Needs a free kind (drafter or free_too).", True)
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
        DEFAULT_ARMS)
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
    costs: str = _help(
        "What the tuner and its break-even gate charge a decode step: modelled (a step-"
        "cost table measured once at start, frozen and saved with the run, so decisions "
        "follow the run's state: the same seed and config decide the same, a resume "
        "decides as the uninterrupted run) or measured (the step's wall-clock time: "
        "follows the machine's load as it runs, but runs are not reproducible in "
        "standard sampling; docs/speculation.md, 'Costs').", "modelled")
    step_costs: str = _help(
        "costs=modelled: the step-cost table file, read when it exists, else calibrated "
        "(a few short calls on synthetic prompts before the first rollout) and written "
        "there; auto = $MEGATRON_TLT_CACHE/step_costs/<model, drafter, arms and machine "
        "key>.json, so reruns on this machine share one table. A resume takes the "
        "checkpoint's table.", "auto")
    seed: int = _help("Seed of the tuner's own random stream.", 0)
    tuner_state: str = _help(
        "JSON file the tuner's state is loaded from when it exists and saved to after "
        "each generate call; empty = not persisted.", "")
    kinds: KindSettings = _help(
        "Each drafter kind's own settings: rollout.speculative.kinds.<kind>.<field>.",
        factory=KindSettings)

    def __post_init__(self):
        _positive("rollout.speculative", "threshold", self.threshold)
        _choice("rollout.speculative", "policy", self.policy, POLICIES)
        _choice("rollout.speculative", "costs", self.costs, ("modelled", "measured"))
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
        self.kinds.check(self)


@dataclass
class RolloutConfig:
    """Rollout engine (``megatron_tlt.rollout.RolloutEngine``)."""

    max_batch_size: int = _help(
        "Sequences decoded at once; more prompts queue and enter as rows free up. "
        "KV-cache memory is 2 x layers x rows x kv_heads/TP x capacity x head_dim x "
        "dtype bytes; in training it is allocated once, rows = min(max_batch_size, a "
        "replica's responses per step), capacity = data.max_prompt_tokens + "
        "grpo.max_new_tokens (at most max_seq_len); elsewhere capacity follows the "
        "longest prompt + max_new_tokens of the calls.", 64)
    max_seq_len: int = _help(
        "Longest prompt + response, in tokens; 0 means the model's "
        "max_position_embeddings. A prompt this long or longer is an error.", 0)
    kv_cache: str = _help(
        "How the target's KV cache holds rows. paged: fixed-size blocks of "
        "kv_block_size positions, a block table per row, blocks taken as tokens are "
        "written and returned when a row finishes; a GRPO group's rows share their "
        "prompt's blocks; rows are admitted while blocks are free (at most "
        "max_batch_size in flight) and, when blocks run out, the newest row is "
        "preempted and recomputed later with the same output (attention: flash-attn's "
        "paged kernel through the block tables when kv_block_size is a multiple of "
        "256, else SDPA over the gathered blocks). slots: every row reserves capacity "
        "positions (max_batch_size rows).", "slots")
    kv_block_size: int = _help(
        "Positions per KV block (rollout.kv_cache=paged). flash-attn's paged kernel "
        "needs a multiple of 256: rollout.attention=auto uses it on CUDA when "
        "installed and the size is one (else SDPA over gathered blocks); "
        "rollout.attention=flash with another size is an error.", 16)
    kv_cache_gib: float = _help(
        "KV budget of the paged cache in GiB per GPU (the target's K and V, and its "
        "expert routes, the one-layer drafter's features per position, and the "
        "drafters' own paged KV caches: the rows up to speculative.threshold); 0 means what max_batch_size full-length slots reserve "
        "(max_batch_size x capacity positions), the drafters' caches beside it. The dry "
        "run proposes a value from the memory left after the rest of the step.", 0.0)
    prefill_tokens: int = _help(
        "Prompt tokens (padded) processed per prefill forward; bounds prefill "
        "activation memory.", 4096)
    share_prefill: bool = _help(
        "Prefill each distinct prompt once per generate call: requests with the same "
        "prompt tokens (a GRPO group's G responses) get a copy of its KV-cache rows "
        "(and of the drafter's prompt features) and their first token is sampled from "
        "its last hidden state, each with its own random stream. A copy comes from the "
        "same admission or from a running row that holds the prompt; a prompt whose "
        "rows have all finished is prefilled again. At PP > 1 in the gathered mode the "
        "stages also split the prompts in contiguous blocks of the call's requests "
        "grouped by prompt (instead of every stages-th request), so a group is "
        "prefilled on one stage. false prefills every request.", True)
    attention: str = _help(
        "Attention kernel: auto (flash-attn's KV-cache kernel on CUDA with a "
        "bfloat16/float16 model when installed, with rollout.kv_cache=paged only when "
        "rollout.kv_block_size is a multiple of 256; else torch "
        "scaled_dot_product_attention), sdpa, flash.", "auto")
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
    cuda_graphs: str = _help(
        "Capture the target's decode and speculative verification forwards, and the "
        "one-layer drafter's catch-up, chain and tree forwards, in CUDA graphs, one per "
        "(batch-size bucket, new tokens per row, tree mask width), replayed at every "
        "step (padding rows attend over their own few tokens). auto: on with CUDA, off "
        "on CPU and with rollout.pipeline_mode=pipelined or an EAGLE-3 feature-layer "
        "drafter, and per key only where its graph measured faster than the same step "
        "run eagerly (3 replays against 3 eager runs at its first capture; the choices "
        "and times are in the rollout stats' graphs); true: every key graphed, an "
        "error where graphs are not supported; false: eager steps. Prefill, logits, "
        "sampling, acceptance and the self-drafter's drafting stay eager.", "auto")
    release_memory: bool = _help(
        "Free the rollout's KV caches, the drafter's feature store and the CUDA graphs "
        "between the rollout and the policy update, so the update has that memory; the "
        "next rollout makes them again (zeroed; graphs re-captured, one per batch-size "
        "bucket at its first step). false keeps them across steps.", True)
    hidden_states_dtype: str = _help(
        "dtype of returned hidden states (kept on CPU): auto (model dtype), float32, "
        "bfloat16, float16.", "auto")
    sampling_mode: str = _help(
        "How sampled (temperature > 0) tokens are drawn. standard: counter-based "
        "per-request random streams (a hash of the request seed, the response position "
        "and the draw's purpose; no generator state); "
        "speculative decoding accepts drafts by rejection sampling (exact in "
        "distribution). coupled: every token is argmax(log p + Gumbel noise) with the "
        "noise a hash of (request seed, position in the response, token id), so a "
        "request's response is the same token for token whatever its batch, whether "
        "speculation is on, the drafter, the TP size or the device (up to floating-point "
        "near-ties); the drafter drafts with the same noise and verification accepts "
        "while its token equals the target's. Same distribution, reproducible rollouts; "
        "acceptance per token >= (1-TV)/(1+TV) instead of 1-TV.", "standard")
    pipeline_mode: str = _help(
        "How a replica decodes at pipeline parallelism > 1. gathered: at every "
        "generate each pipeline rank receives the other stages' layers (a copy, "
        "refreshed from the trained weights each call) and decodes its share of the "
        "prompts as a PP=1 engine; outputs are all-gathered in prompt order. pipelined: "
        "each stage runs only its own layers and KV cache, activations pass stage to "
        "stage (no weight copies, the stages take turns).", "gathered")
    speculative: SpeculativeConfig = _help("Speculative decoding.",
                                           factory=SpeculativeConfig)

    def __post_init__(self):
        _positive("rollout", "max_batch_size", self.max_batch_size)
        if self.max_seq_len < 0:
            raise ConfigError(f"rollout.max_seq_len must be >= 0 (0 = model's), "
                              f"got {self.max_seq_len}")
        _positive("rollout", "prefill_tokens", self.prefill_tokens)
        _choice("rollout", "kv_cache", self.kv_cache, ("paged", "slots"))
        _positive("rollout", "kv_block_size", self.kv_block_size)
        if (self.kv_cache == "paged" and self.attention == "flash"
                and self.kv_block_size % FLASH_PAGE_MULTIPLE):
            raise ConfigError(
                f"rollout.attention=flash with rollout.kv_cache=paged needs "
                f"rollout.kv_block_size to be a multiple of {FLASH_PAGE_MULTIPLE} "
                f"(flash-attn's paged KV cache), got {self.kv_block_size}: set "
                f"rollout.kv_block_size={FLASH_PAGE_MULTIPLE}, or rollout.attention=auto "
                f"or sdpa (SDPA over the gathered blocks)")
        if self.kv_cache_gib < 0:
            raise ConfigError(f"rollout.kv_cache_gib must be >= 0 (0 = what "
                              f"max_batch_size full-length slots reserve), got "
                              f"{self.kv_cache_gib}")
        _choice("rollout", "attention", self.attention, ("auto", "sdpa", "flash"))
        # YAML / CLI booleans arrive as True / "False"; Python callers may pass bools
        self.cpu_kernels = str(self.cpu_kernels).strip().lower()
        _choice("rollout", "cpu_kernels", self.cpu_kernels, ("auto", "true", "false"))
        self.cuda_graphs = str(self.cuda_graphs).strip().lower()
        _choice("rollout", "cuda_graphs", self.cuda_graphs, ("auto", "true", "false"))
        _choice("rollout", "hidden_states_dtype", self.hidden_states_dtype,
                ("auto", "float32", "bfloat16", "float16"))
        _choice("rollout", "sampling_mode", self.sampling_mode, ("standard", "coupled"))
        _choice("rollout", "pipeline_mode", self.pipeline_mode, ("gathered", "pipelined"))


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
