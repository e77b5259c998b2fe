"""The RL training sections: data, reward, GRPO, train, drafter group, checkpoint, tracking."""

from __future__ import annotations

from dataclasses import dataclass

from .base import ConfigError, _choice, _help, _positive
from .drafter_loss import LOSS_PRESETS


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
    routing_replay: bool = _help(
        "Mixture-of-experts policies: the rollout records each token's experts per MoE "
        "layer, and the old-log-prob and training forwards route every token to them "
        "(rollout routing replay), so a near-tie in the router cannot send a token to "
        "other experts than the sampler used. No effect on dense models.", True)

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
        "padding); bounds a micro-batch's activations and its logits (tokens x "
        "vocabulary / TP in the model dtype; the loss's fp32 work is bounded by "
        "loss_chunk_tokens); 0 = no token budget.", 4096)
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
    recompute_granularity: str = _help(
        "megatron-core activation recomputation of the trained model: none; selective "
        "(core attention recomputed in the backward: drops the attention scores, the "
        "5·a·s/h term per layer); full (whole layers recomputed: each layer keeps only its "
        "input, 2·s·b·h bytes in 16-bit, at about one extra forward of compute).", "none")
    recompute_method: str = _help(
        "With recompute_granularity=full: uniform (the stage's layers in chunks of "
        "recompute_num_layers, every chunk recomputed) or block (only the first "
        "recompute_num_layers layers of each pipeline stage recomputed).", "uniform")
    recompute_num_layers: int = _help(
        "With recompute_granularity=full: layers per recomputed chunk (uniform) or "
        "layers recomputed per pipeline stage (block); at most the layers of a stage.", 1)
    loss_chunk_tokens: int = _help(
        "Tokens per chunk of the log-prob / loss / entropy computation over the "
        "vocabulary: at most this many rows of fp32 [tokens, vocabulary / TP] "
        "temporaries exist at once (0 = the whole micro-batch at once).", 1024)
    max_nonfinite_steps: int = _help(
        "Steps whose reward or loss is NaN or inf are skipped (no optimizer update), "
        "warned about and counted (metrics nonfinite/*); the run stops with an error "
        "once more than this many were skipped (0 = at the first).", 3)
    offload_during_rollout: bool = _help(
        "Lend the rollout the memory only the update needs: during every generation "
        "(the step's rollout and the evaluations) the policy's gradient buffers are "
        "released and its optimizer state (Adam moments, fp32 main parameters) waits in "
        "pinned host memory (on CPU: a temporary file), so the rollout's KV budget can "
        "use that memory (the dry run prints the rollout with and without); they are "
        "brought back bit-identical before the log-prob and update phases and before "
        "any checkpoint (timing/offload, timing/reload). Off by default: it costs two "
        "transfers of those bytes per step and gains only where the rollout is the "
        "peak or the KV budget is sized from what it leaves.", False)
    moe_aux_loss_coef: float = _help(
        "Mixture-of-experts policies: coefficient of megatron-core's load-balancing "
        "auxiliary loss (0 = off, the default: a pretrained router is already balanced "
        "and the term pulls against the RL objective; the expert load is reported "
        "either way).", 0.0)

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
        _choice("train", "recompute_granularity", self.recompute_granularity,
                ("none", "selective", "full"))
        _choice("train", "recompute_method", self.recompute_method, ("uniform", "block"))
        _positive("train", "recompute_num_layers", self.recompute_num_layers)
        if self.loss_chunk_tokens < 0:
            raise ConfigError("train.loss_chunk_tokens must be >= 0 (0 = no chunking)")
        if self.moe_aux_loss_coef < 0:
            raise ConfigError(f"train.moe_aux_loss_coef must be >= 0 (0 = off), got "
                              f"{self.moe_aux_loss_coef}")


@dataclass
class DrafterGroupConfig:
    """Online drafter training on idle replicas (the drafter group): a DP replica that
    finished its rollout trains the drafter on its buffered responses until the last
    replica finishes; at the step barrier the replicas' drafters and optimizer states
    are averaged, weighted by their step counts."""

    enable: bool = _help(
        "Train the drafter in the rollout tail. Needs rollout.speculative or starts from "
        "a random drafter when rollout.speculative.drafter is empty. At PP > 1 needs "
        "rollout.pipeline_mode=gathered (the default).", False)
    train: bool = _help(
        "false = the group keeps, synchronises and measures the drafter (the after-update "
        "canary) but never trains it: a frozen baseline measured the same way.", True)
    min_idle_replicas: int = _help(
        "Replicas that must have finished before any of them trains (1 = each trains as "
        "soon as it finishes).", 1)
    max_steps_per_window: int = _help(
        "Drafter optimizer steps per replica per RL step at most (0 = auto: 32 on CPU; on "
        "CUDA the micro-steps that fill a 5-minute idle window, "
        "drafter_training/sizing.py).", 0)
    loss: str = _help(
        "Drafter loss preset (eagle, kl, tv, log_accept, kl+tv, kl+tv+hidden), computed at "
        "the rollout's sampling settings (grpo.temperature / top_p / top_k); the default is "
        "the warm-up's.", "kl+tv")
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
        "preemption bound: the last replica waits for at most one of its stop_checks "
        "chunks (0 = auto: 512 on CPU; on CUDA about 0.25 s of the device's throughput "
        "for the drafter's size, capped by memory, within 2,048-16,384).", 0)
    stop_checks: int = _help(
        "Stop-flag reads per micro-step: its rows run in this many chunks whose gradients "
        "accumulate, the flag read before each; a stop mid-step applies the chunks done. "
        "The last replica then waits for one chunk, not one micro-step (1 = per step).", 4)
    buffer_tokens: int = _help(
        "Responses' feature rows held per replica for training (CPU memory: rows x "
        "hidden x the feature dtype's bytes); the current and the previous step's "
        "responses, oldest dropped first (0 = auto: 65,536 on CPU; on CUDA 8 GiB of "
        "host memory).", 0)
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
        _positive("drafter_group", "stop_checks", self.stop_checks)
        for name in ("max_steps_per_window", "batch_tokens", "buffer_tokens"):
            if getattr(self, name) < 0:
                raise ConfigError(f"drafter_group.{name} must be >= 0 (0 = auto: derived "
                                  f"from the device), got {getattr(self, name)}")
        _choice("drafter_group", "lr_decay", self.lr_decay, ("constant", "cosine"))
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
        "On SIGTERM, SIGUSR1 or the file {save}/STOP the run abandons the step in progress "
        "(or finishes it, past its first optimizer step), checkpoints the last completed "
        "step and exits with code 75 (requeue); if that takes longer than this, or a "
        "second signal comes, it exits at once with code 76 without writing (0 = no "
        "deadline). Keep it below the scheduler's warning time (--signal=B:TERM@120).",
        90.0)
    keep_last: int = _help("Keep the newest N checkpoints under checkpoint.save, removing "
                           "older ones after each save; 0 = keep all.", 3)
    fallback_to_previous: bool = _help(
        "On resume, when the newest checkpoint is incomplete or corrupt, load the newest "
        "complete older one instead of stopping with the error.", False)
    async_save: str = _help(
        "Write the policy's shards in a background process (megatron-core's async save) "
        "while training goes on; the checkpoint is published once every rank's writes "
        "finished. auto = on when training on CUDA (it costs a host-memory copy of the "
        "rank's shards while writing), off on CPU; true, false.", "auto")

    def __post_init__(self):
        self.async_save = str(self.async_save).lower()  # YAML true / false arrive as bools
        _choice("checkpoint", "async_save", self.async_save, ("auto", "true", "false"))
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
