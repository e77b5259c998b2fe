"""Offline drafter warm-up as a library: a ``WarmupConfig`` in, a drafter and a report out.

    cfg = WarmupConfig.from_recipe("examples/rl/smollm2_cpu.yaml", train_prompts=64)
    result = run_warmup(cfg)            # result.drafter, result.report (JSON-able dict)

1. Responses of the target on the task's prompts, sampled at the rollout's settings
   (temperature, top-p, top-k, ``samples_per_prompt`` per prompt as GRPO groups them;
   a recipe sets all of them), optionally kept in a resumable ``ResponseStore``.
2. The target's features over every prompt + response: taken during generation
   (``sampled_data.py``: no second forward) unless a response store or EAGLE-3
   features ask for a separate forward (``target_features``).
3. The draft vocabulary: the tokens carrying most of p̃'s mass at the rollout's
   settings (``vocab.py``; or the most frequent response tokens), with the coverage of
   several sizes reported.
4. Training (``DrafterTrainer`` with a ``losses.LossConfig`` at the same settings).
5. Held-out report: the exact α by draft depth, E[max p̃], the draft vocabulary's mass
   and the predicted chain acceptance length (``alpha.measure_alpha``) on responses to
   unseen prompts, then the acceptance length speculative decoding measures on them
   (greedy warm-ups also check the outputs equal plain decoding).

``tools/warmup_drafter.py`` is its command line; ``make demo`` and bench_spec call it.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

import torch

from .losses import LOSS_PRESETS, LossConfig

__all__ = ["WarmupConfig", "WarmupResult", "WarmupError", "run_warmup", "DEFAULT_LOSS",
           "recipe_prompts", "generate_responses", "response_samples"]

# chosen by measurement (docs/benchmarks.md, "Drafter α against training tokens")
DEFAULT_LOSS = "kl+tv"
COVERAGE_SIZES = (512, 1024, 2048, 4096, 8192, 16384, 0)


class WarmupError(ValueError):
    """A warm-up setting that cannot work (the message names the field and the fix)."""


@dataclass
class WarmupConfig:
    model: str = "smollm2"  # HF folder, converted checkpoint or 'smollm2'
    out: Optional[str] = None  # checkpoint path (.safetensors or folder); None: not saved
    task: str = ""  # reasoning-gym task ('' = tasks.DEFAULT_TASK)
    task_params: dict = field(default_factory=dict)
    instruction: Optional[str] = None  # None: tasks.DEFAULT_INSTRUCTION
    system_prompt: Optional[str] = None
    train_prompts: int = 256
    eval_prompts: int = 8
    samples_per_prompt: int = 1
    max_new_tokens: int = 256
    temperature: float = 0.0  # 0 = greedy responses
    top_p: float = 1.0
    top_k: int = 0
    epochs: int = 6
    lr: float = 2e-3
    batch_tokens: int = 4096
    draft_vocab: int = 0  # 0 = full vocabulary
    draft_vocab_by: str = "mass"  # mass (of p̃) or count (of response tokens)
    eagle3: bool = False
    loss: str = DEFAULT_LOSS  # a LOSS_PRESETS name
    hidden_weight: Optional[float] = None  # overrides the preset's hidden-state weight
    unroll: int = 1
    eval_strategy: str = "6_1_6"  # measured acceptance (chains: also the alpha depth)
    eval_new_tokens: int = 128
    responses: Optional[str] = None  # resumable JSON-lines store of the responses
    generate_only: bool = False
    chunk: int = 256
    init: Optional[str] = None  # start from this drafter checkpoint
    seed: int = 0
    recipe: Optional[str] = None  # the RL recipe the settings came from (reported)

    def __post_init__(self):
        if self.train_prompts < 1 or self.chunk < 1 or self.samples_per_prompt < 1:
            raise WarmupError("train_prompts, samples_per_prompt and chunk must be >= 1")
        if self.eval_prompts < 0 or self.epochs < 0:
            raise WarmupError("epochs and eval_prompts must be >= 0")
        if self.epochs == 0 and not self.init:
            raise WarmupError("--epochs 0 (no training) needs --init: a drafter to "
                              "re-select the draft vocabulary of and evaluate")
        if self.generate_only and not self.responses:
            raise WarmupError("--generate-only needs --responses (where the responses "
                              "are kept)")
        if self.loss not in LOSS_PRESETS:
            raise WarmupError(f"loss {self.loss!r} is not one of {sorted(LOSS_PRESETS)}")
        if self.draft_vocab_by not in ("mass", "count"):
            raise WarmupError(f"draft_vocab_by must be mass or count, got "
                              f"{self.draft_vocab_by!r}")
        from ..spec_strategy import Strategy

        try:
            Strategy.parse(self.eval_strategy)
        except ValueError as e:
            raise WarmupError(f"eval_strategy: {e}") from None
        self.loss_config()  # validates the loss settings

    def loss_config(self) -> LossConfig:
        kw = dict(unroll=self.unroll)
        if self.hidden_weight is not None:
            kw["hidden"] = self.hidden_weight
        try:
            return LossConfig.for_sampling(self.loss, self.temperature, self.top_k,
                                           self.top_p, **kw)
        except ValueError as e:
            raise WarmupError(f"loss settings: {e}") from None

    @property
    def alpha_depth(self) -> int:
        from ..spec_strategy import Strategy

        s = Strategy.parse(self.eval_strategy)
        return s.depth if s.is_chain else 4

    @classmethod
    def from_recipe(cls, path: str | Path, **overrides) -> "WarmupConfig":
        """Settings of an RL recipe (YAML): its model, its task and prompt format, its
        rollout sampling (grpo.temperature / top_p / top_k, group_size responses per
        prompt, max_new_tokens); ``overrides`` replace any field."""
        from ..config import ConfigError, load_config

        try:
            rc = load_config([path])
        except ConfigError as e:
            raise WarmupError(f"--config {path}: {e}") from None
        if rc.data.source != "reasoning_gym":
            raise WarmupError(f"{path}: data.source={rc.data.source}; the warm-up draws "
                              "prompts from a reasoning-gym task (data.source=reasoning_gym)"
                              "; pass --task instead of --config")
        g = rc.grpo
        base = dict(model=rc.model.hf_path or "smollm2", task=rc.data.task,
                    task_params=dict(rc.data.task_params),
                    instruction=rc.data.instruction or "",
                    system_prompt=rc.data.system_prompt or None,
                    samples_per_prompt=g.group_size, max_new_tokens=g.max_new_tokens,
                    temperature=g.temperature, top_p=g.top_p, top_k=g.top_k,
                    seed=rc.data.seed, recipe=str(path))
        base.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**base)


@dataclass
class WarmupResult:
    drafter: object  # EagleDrafter (None with generate_only)
    report: dict
    path: Optional[Path] = None


def recipe_prompts(cfg: WarmupConfig, tok, n: int, seed: Optional[int] = None
                   ) -> list[list[int]]:
    """``n`` token-id prompts of ``cfg``'s task in its prompt format; ``seed`` (default
    ``cfg.seed``, the warm-up's own) picks another, unrelated set."""
    from ..tasks import DEFAULT_TASK, reasoning_gym_prompts

    kw = {} if cfg.instruction is None else {"instruction": cfg.instruction}
    return [p.token_ids for p in reasoning_gym_prompts(
        tok, cfg.task or DEFAULT_TASK, n=n, seed=cfg.seed if seed is None else seed,
        system_prompt=cfg.system_prompt, **kw, **cfg.task_params)]


def generate_responses(cfg, engine, reqs, sp, log, tag):
    """Responses (token ids) of ``engine`` to the prompts ``reqs`` at ``sp``, in chunks of
    ``cfg.chunk``; for the training set (``tag == "train"``) with ``cfg.responses`` they
    are read from / added to that resumable store. ``log`` takes the progress lines."""
    store = None
    if cfg.responses and tag == "train":
        from .responses import ResponseStore, ResponseStoreMismatch, weights_signature

        from ..tasks import DEFAULT_TASK

        meta = {"model": str(cfg.model), "weights": weights_signature(engine.runner.model),
                "task": cfg.task or DEFAULT_TASK, "seed": cfg.seed, "max_new_tokens": cfg.max_new_tokens,
                "temperature": cfg.temperature, "samples_per_prompt": cfg.samples_per_prompt}
        if cfg.top_p != 1.0 or cfg.top_k or cfg.task_params or cfg.instruction is not None:
            meta.update(top_p=cfg.top_p, top_k=cfg.top_k, task_params=cfg.task_params,
                        instruction=cfg.instruction)
        try:
            store = ResponseStore(cfg.responses, meta)
        except ResponseStoreMismatch as e:
            raise WarmupError(f"--responses: {e}") from None
    resp: list = [None] * len(reqs)
    if store is not None:
        resp = [store.get(i, p) for i, p in enumerate(reqs)]
        log(f"  {sum(r is not None for r in resp)}/{len(reqs)} responses reused from "
            f"{cfg.responses}")
    todo = [i for i, r in enumerate(resp) if r is None]
    t0 = time.perf_counter()
    for c in range(0, len(todo), cfg.chunk):
        idx = todo[c: c + cfg.chunk]
        for i, o in zip(idx, engine.generate([reqs[i] for i in idx], sp)):
            resp[i] = o.token_ids
        if store is not None:
            store.add_many((i, reqs[i], resp[i]) for i in idx)
        log(f"  {c + len(idx)}/{len(todo)} generated ({time.perf_counter() - t0:.0f}s)")
    return resp


def response_samples(engine, drafter, reqs, resp, log):
    """``DraftSample``s of prompts ``reqs`` + responses ``resp``: the target's features
    (``drafter``'s feature layers) from a forward over each whole sequence."""
    from .trainer import DraftSample, target_features

    seqs = [p + r for p, r in zip(reqs, resp)]
    t0 = time.perf_counter()
    every = max(1, len(seqs) // 10)
    feats = target_features(
        engine.runner, seqs, drafter.config.feature_layers,
        progress=lambda k: (k % every == 0 or k == len(seqs)) and log(
            f"  {k}/{len(seqs)} sequences ({time.perf_counter() - t0:.0f}s)"))
    return [DraftSample(s, len(p), f, h) for s, p, (f, h) in zip(seqs, reqs, feats)]


def run_warmup(cfg: WarmupConfig, *, engine=None,
               log: Callable[[str], None] = lambda s: print(s, flush=True)) -> WarmupResult:
    """Run the warm-up ``cfg`` describes (``engine``: a ``RolloutEngine`` of the target
    to reuse, else one is loaded from ``cfg.model``)."""
    from ..config import RolloutConfig
    from ..models.drafter import DrafterConfig, EagleDrafter, load_drafter, save_drafter
    from ..rollout import RolloutEngine, SamplingParams
    from ..tasks import DEFAULT_TASK
    from .alpha import measure_alpha, measured_accept_len
    from .losses import cache_target_probs
    from .trainer import DrafterTrainer, draft_vocabulary
    from .vocab import coverage, draft_vocabulary_by_mass, token_mass

    torch.manual_seed(cfg.seed)
    t_start = time.perf_counter()
    if engine is None:
        src = cfg.model
        if src == "smollm2":
            from ..assets import require_smollm2

            src = require_smollm2()
        engine = RolloutEngine.from_pretrained(src, RolloutConfig(max_batch_size=32))
    arch, tok = engine.arch, engine.tokenizer
    task = cfg.task or DEFAULT_TASK
    prompts = recipe_prompts(cfg, tok, cfg.train_prompts + cfg.eval_prompts)
    train_p, eval_p = prompts[: cfg.train_prompts], prompts[cfg.train_prompts:]
    sp = SamplingParams(temperature=cfg.temperature, top_p=cfg.top_p, top_k=cfg.top_k,
                        max_new_tokens=cfg.max_new_tokens, seed=cfg.seed)
    sampling = (f"temperature {cfg.temperature:g}" + (f", top-p {cfg.top_p:g}"
                if cfg.top_p < 1 else "") + (f", top-k {cfg.top_k}" if cfg.top_k else ""))
    reqs = [p for p in train_p for _ in range(cfg.samples_per_prompt)]

    # 1. responses
    log(f"[1/5] generating {len(reqs)} responses ({task}, {cfg.samples_per_prompt} per "
        f"prompt, max {cfg.max_new_tokens} tokens, {sampling})")
    t0 = time.perf_counter()
    need_features = cfg.epochs > 0 or bool(cfg.draft_vocab and cfg.draft_vocab_by == "mass")
    samples = None
    if need_features and not cfg.responses and not cfg.eagle3:
        # the features come with the generation (sampled_data.py): no second forward
        from .sampled_data import sampled_samples

        samples = sampled_samples(
            engine, train_p, sp, per_prompt=cfg.samples_per_prompt,
            chunk=max(cfg.samples_per_prompt, cfg.chunk - cfg.chunk % cfg.samples_per_prompt),
            progress=lambda got: log(f"  {len(got)}/{len(reqs)} generated, with features "
                                     f"({time.perf_counter() - t0:.0f}s)"))
        resp = [s.tokens[s.prompt_len:] for s in samples]
    else:
        resp = generate_responses(cfg, engine, reqs, sp, log, "train")
    n_resp = sum(len(r) for r in resp)
    report: dict = {"task": task, "recipe": cfg.recipe, "temperature": cfg.temperature,
                    "top_p": cfg.top_p, "top_k": cfg.top_k, "responses": len(resp),
                    "response_tokens": n_resp, "loss": dataclasses.asdict(cfg.loss_config()),
                    "generate_seconds": time.perf_counter() - t0}
    if cfg.generate_only:
        log(f"{len(resp)} responses ({n_resp} tokens) in {cfg.responses}; done in "
            f"{time.perf_counter() - t_start:.0f}s")
        return WarmupResult(None, report)

    # 2. drafter and features
    if cfg.init:
        drafter = load_drafter(cfg.init, arch, dtype=engine.runner.dtype, device=engine.device)
    else:
        dcfg = DrafterConfig.for_target(arch, feature_layers="auto" if cfg.eagle3 else ())
        drafter = EagleDrafter(dcfg, arch, dtype=engine.runner.dtype, device=engine.device)
        drafter.reset_parameters(cfg.seed)
    if samples is not None:
        log(f"[2/5] target features: taken with the responses ({n_resp} tokens)")
    elif need_features:
        log(f"[2/5] target features for {len(reqs)} sequences ({n_resp} response tokens)")
        samples = response_samples(engine, drafter, reqs, resp, log)
    else:
        log("[2/5] no forward over the responses (no training)")

    # 3. draft vocabulary
    lc = cfg.loss_config()
    if cfg.draft_vocab:  # (the head is the target's: re-selecting keeps --init's training)
        eos = list(engine.eos_token_ids)
        if cfg.draft_vocab_by == "mass":
            mass = token_mass(engine.runner, samples, temperature=cfg.temperature,
                              top_k=cfg.top_k, top_p=cfg.top_p)
            cov = coverage(mass, COVERAGE_SIZES)
            report["draft_vocab_coverage"] = {str(k or "full"): v for k, v in cov.items()}
            log("  p mass covered by the best N tokens: " + ", ".join(
                f"{k or 'full'}: {v:.3f}" for k, v in cov.items()))
            ids = draft_vocabulary_by_mass(mass, cfg.draft_vocab, always=eos)
        else:
            ids = draft_vocabulary(resp, cfg.draft_vocab, arch.vocab_size, always=eos)
        drafter.set_draft_vocabulary(ids)
        covered = torch.isin(torch.tensor([t for r in resp for t in r]),
                             drafter.d2t.cpu()).float().mean()
        report["draft_vocab"] = cfg.draft_vocab
        log(f"[3/5] draft vocabulary {cfg.draft_vocab} tokens (by {cfg.draft_vocab_by}) "
            f"covers {covered:.1%} of response tokens")
    else:
        log("[3/5] full draft vocabulary")

    # 4. training
    hist: list[dict] = []
    t2 = time.perf_counter()
    if cfg.epochs == 0:
        log("[4/5] no training (--epochs 0)")
    else:
        from .trainer import length_batches

        total = cfg.epochs * len(length_batches(samples, cfg.batch_tokens))
        log(f"[4/5] training: {cfg.epochs} epochs, {total} steps, lr {cfg.lr}, loss "
            f"{cfg.loss} (unroll {lc.unroll}, hidden weight {lc.hidden:g}, at "
            f"T={lc.temperature:g})")
        cache_target_probs(samples, engine.runner, drafter, lc)  # (pruned vocabularies)
        trainer = DrafterTrainer(drafter, engine.runner, lr=cfg.lr, total_steps=total,
                                 warmup_steps=max(1, total // 20), loss=lc)
        hist = trainer.fit(samples, epochs=cfg.epochs, batch_tokens=cfg.batch_tokens,
                           seed=cfg.seed, log=log, log_every=max(1, total // 20))
    report.update(train_steps=len(hist), train_seconds=time.perf_counter() - t2,
                  final_loss=hist[-1]["loss"] if hist else None,
                  final_top1=hist[-1]["top1"] if hist else None,
                  final_alpha=hist[-1]["alpha"] if hist else None)
    path = None
    if cfg.out:
        extra = {"task": task, "temperature": cfg.temperature, "loss": cfg.loss,
                 "unroll": lc.unroll}
        if cfg.epochs:  # (without training the checkpoint keeps its own training record)
            extra.update(train_prompts=cfg.train_prompts, response_tokens=n_resp,
                         epochs=cfg.epochs)
        if cfg.init:
            extra["init"] = Path(cfg.init).name
        path = save_drafter(drafter, cfg.out, extra=extra)
        report["checkpoint"] = str(path)
        log(f"  saved {path}")

    # 5. held-out report
    if eval_p:
        report.update(_evaluate(cfg, engine, drafter, eval_p, log, measure_alpha,
                                measured_accept_len))
    report["total_seconds"] = time.perf_counter() - t_start
    log(f"done in {report['total_seconds']:.0f}s")
    return WarmupResult(drafter, report, path)


def _evaluate(cfg, engine, drafter, eval_p, log, measure_alpha, measured_accept_len) -> dict:
    from ..rollout import SamplingParams
    from .alpha import held_out_samples

    out: dict = {"eval_prompts": len(eval_p)}
    depth = cfg.alpha_depth
    t_alpha = cfg.temperature or 1.0
    hsp = SamplingParams(temperature=t_alpha, top_p=cfg.top_p, top_k=cfg.top_k,
                         max_new_tokens=cfg.max_new_tokens, seed=cfg.seed + 1)
    if drafter.config.feature_layers:
        held = held_out_samples(engine, eval_p, hsp, per_prompt=min(cfg.samples_per_prompt, 4),
                                feature_layers=drafter.config.feature_layers)
    else:  # features from the generation itself
        from .sampled_data import sampled_samples

        held = sampled_samples(engine, eval_p, hsp, per_prompt=min(cfg.samples_per_prompt, 4))
    rep = measure_alpha(drafter, engine.runner, held, temperature=t_alpha, top_k=cfg.top_k,
                        top_p=cfg.top_p, depth=depth)
    esp = SamplingParams(temperature=cfg.temperature, top_p=cfg.top_p, top_k=cfg.top_k,
                         max_new_tokens=cfg.eval_new_tokens, seed=cfg.seed + 2)
    log(f"[5/5] held-out: {len(held)} sampled responses to {len(eval_p)} prompts; "
        f"speculative decoding with {cfg.eval_strategy} at "
        f"{'greedy' if esp.greedy else f'T={cfg.temperature:g}'}, {cfg.eval_new_tokens} "
        "tokens")
    if esp.greedy:
        from ..config import SpeculativeConfig

        plain = [o.token_ids for o in engine.generate(eval_p, esp)]
        old = engine.config.speculative, engine.spec, engine.tuner
        engine.config.speculative = SpeculativeConfig(policy="fixed",
                                                      strategy=cfg.eval_strategy,
                                                      threshold=1 << 30)
        try:
            engine.attach_drafter(drafter)
            spec = [o.token_ids for o in engine.generate(eval_p, esp)]
            summ = engine.last_stats.spec.summary()
        finally:
            engine.config.speculative, engine.spec, engine.tuner = old
        same = sum(a == b for a, b in zip(plain, spec))
        out.update(identical=same, accept_len=summ["accept_len"],
                   accept_rate_at_position=summ["accept_rate_at_position"])
        log(f"  acceptance length {summ['accept_len']:.2f} tokens per step; outputs "
            f"identical to plain decoding for {same}/{len(eval_p)} prompts")
    else:
        m = measured_accept_len(engine, drafter, eval_p, esp, depth)
        out.update(accept_len=m["accept_len"],
                   accept_rate_at_position=m["accept_rate_at_position"])
    rep.measured_accept_len = out["accept_len"] if not esp.greedy else None
    out["alpha"] = rep.to_dict()
    log("  " + rep.line())
    return out
