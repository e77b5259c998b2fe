"""The trained policy: megatron-core DDP, megatron-core's optimizer and LR schedule, and
the two passes the RL step needs (forward-only log-probs, forward/backward updates),
both through megatron-core's pipeline schedule so TP, PP and DP work the same way.

Gradients: the loss a micro-batch returns is already divided by the GLOBAL
denominators of its mini-batch (``grpo.LossDenominators``), so the mini-batch loss is
the plain sum over micro-batches and DP ranks. megatron-core is told exactly that:
``calculate_per_token_loss=True`` makes its DDP sum gradients over DP (no 1/DP) and its
schedule leave the loss unscaled; ``finalize_model_grads`` is called without a token
count, so nothing rescales the gradients afterwards.

Optimizer: megatron-core's (``get_megatron_optimizer``; its distributed optimizer on
CUDA). Clipping uses the optimizer's own global norm (``get_grad_norm``: model-parallel
aware, tied and TP-duplicated parameters counted once) and scales the gradients it
steps on; megatron-core's fused clip asserts CUDA tensors, this path runs everywhere.
``train.optimizer=torch`` steps torch.optim.AdamW on the same gradient buffers.

Expert parallelism (MoE, EP > 1): a MoE layer's forward and backward exchange tokens
with the EP group's other ranks, so every rank of the group runs as many micro-batches:
the ranks agree on the largest count and pad with ``MicroBatch.filler`` ones (a zero
loss through every layer, no result returned).

Load-balancing loss (``train.moe_aux_loss_coef`` > 0): megatron-core's per-micro-batch
loss (a mean over the micro-batch's routed tokens), each micro-batch's weighted by its
share of the mini-batch's tokens over DP (``MoEAuxLossAutoScaler``'s scale, times the
float16 loss scale), so the update sees the token-weighted mean over the mini-batch, as
its policy loss is a global token mean; at PP > 1 megatron-core's schedule sets the
scale (each micro-batch at weight 1).

Routing replay (MoE policies built with ``grpo.routing_replay``): each micro-batch's
forward, and its backward (a recomputed forward routes alike), routes every token to the
rollout's experts (``MicroBatch.routes``; ``models.moe_replay``).

float16: megatron-core's dynamic loss scaler (its optimizer owns it). The loss is
multiplied by the current scale before backward (``scale_loss``: here at PP = 1, through
the model config's ``grad_scale_func`` in megatron-core's pipeline schedules at PP > 1);
``prepare_grads`` divides the gradients by it, checks them for inf/nan and updates the
scale (halved after ``hysteresis`` overflowing steps, doubled after 1000 clean ones). A
step whose gradients overflowed is skipped (``StepResult.updated`` False). bfloat16 and
float32 have no scaler (scale 1).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import torch

from ..models import moe_replay
from ..runtime_env import cuda_placements_on_cpu
from ..optim_state import allocate_adam_state
from .samples import MicroBatch


# The dynamic loss scale a float16 run starts from (megatron-core's default, 2**32,
# overflows and skips the first ~16 steps; torch.amp's GradScaler starts at 2**16).
INITIAL_LOSS_SCALE = 2.0 ** 16


@dataclass
class StepResult:
    grad_norm: float
    lr: float
    updated: bool  # False when the step was skipped (non-finite gradients)
    loss_scale: float = 1.0  # the float16 loss scale after this step (1 otherwise)
    # seconds in the micro-batches' forward + backward, and in the gradient reduction
    # + optimizer step (which includes waiting for the slowest replica at DP > 1)
    compute_seconds: float = 0.0
    step_seconds: float = 0.0


def _megatron_ddp(model, *, use_distributed_optimizer: bool):
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    config = model.config
    config.calculate_per_token_loss = True  # see the module docstring
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, overlap_grad_reduce=False,
        use_distributed_optimizer=use_distributed_optimizer,
        average_in_collective=False)
    with cuda_placements_on_cpu():
        return DistributedDataParallel(config=config, ddp_config=ddp_config, module=model)


class Policy:
    """The model being trained plus its optimizer; one per rank (its TP/PP shard)."""

    def __init__(self, model, arch, train_cfg, *, total_optimizer_steps: int):
        from megatron.core import parallel_state as ps

        self.arch = arch
        self.cfg = train_cfg
        self.device = next(model.parameters()).device
        on_cuda = self.device.type == "cuda"
        kind = train_cfg.optimizer
        if kind == "auto":
            kind = "megatron"
        if kind == "torch" and model.config.fp16:
            from ..config import ConfigError

            raise ConfigError(
                "train.optimizer=torch cannot train model.dtype=float16: it has no loss "
                "scaling, so small float16 gradients underflow; use train.optimizer=auto "
                "(megatron-core's optimizer, dynamic loss scaling) or model.dtype=bfloat16")
        self.kind = kind
        self.module = model  # the GPTModel the rollout engine reads in place
        self.replay = moe_replay.enabled(model)  # routing replay (MoE, grpo.routing_replay)
        from ..parallel import expert_group

        self.ep_group = expert_group() if arch.is_moe else None
        from ..models.moe_load import ExpertLoad

        self.expert_load = ExpertLoad(model) if arch.is_moe else None
        self.aux_loss = bool(getattr(model.config, "moe_aux_loss_coeff", 0.0))
        self.ddp = _megatron_ddp(model, use_distributed_optimizer=on_cuda and kind == "megatron")
        self.pp_size = ps.get_pipeline_model_parallel_world_size()
        self.is_last_stage = ps.is_pipeline_last_stage()
        # sequence parallelism splits each sequence over the TP group
        self.seq_multiple = (ps.get_tensor_model_parallel_world_size()
                             if model.config.sequence_parallel else 1)
        # every micro-batch is sent between stages at its own shape (megatron-core
        # communicates the shape first), not at the longest micro-batch's
        model.config.variable_seq_lengths = self.pp_size > 1
        model.config.finalize_model_grads_func = None  # called by train_step itself
        if kind == "megatron":
            from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

            ocfg = OptimizerConfig(
                optimizer="adam", lr=train_cfg.lr, min_lr=train_cfg.min_lr,
                weight_decay=train_cfg.weight_decay, adam_beta1=train_cfg.adam_beta1,
                adam_beta2=train_cfg.adam_beta2, adam_eps=train_cfg.adam_eps,
                clip_grad=0.0,  # clipped in train_step (see the module docstring)
                bf16=model.config.bf16, fp16=model.config.fp16,
                params_dtype=model.config.params_dtype,
                initial_loss_scale=INITIAL_LOSS_SCALE,
                use_distributed_optimizer=on_cuda)
            with cuda_placements_on_cpu():
                self.optimizer = get_megatron_optimizer(ocfg, [self.ddp])
            if model.config.fp16:  # megatron-core's pipeline schedules multiply the last
                # stage's loss by this before backward (PP > 1); _scaled at PP = 1
                model.config.grad_scale_func = self.optimizer.scale_loss
            from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

            self.scheduler = OptimizerParamScheduler(
                self.optimizer, init_lr=0.0 if train_cfg.lr_warmup_steps else train_cfg.lr,
                max_lr=train_cfg.lr, min_lr=train_cfg.min_lr,
                lr_warmup_steps=train_cfg.lr_warmup_steps,
                lr_decay_steps=max(total_optimizer_steps, train_cfg.lr_warmup_steps + 1),
                lr_decay_style=train_cfg.lr_decay, start_wd=train_cfg.weight_decay,
                end_wd=train_cfg.weight_decay, wd_incr_steps=1, wd_incr_style="constant")
        else:
            self.optimizer = torch.optim.AdamW(
                [p for p in self.ddp.parameters() if p.requires_grad], lr=train_cfg.lr,
                betas=(train_cfg.adam_beta1, train_cfg.adam_beta2), eps=train_cfg.adam_eps,
                weight_decay=train_cfg.weight_decay)
            self.scheduler = _TorchSchedule(self.optimizer, train_cfg, total_optimizer_steps)
        # the Adam moments now, not on the first step after the first rollout: resident
        # memory is final (and a state that does not fit fails) before any rollout
        self.optimizer_state_bytes = allocate_adam_state(self.optimizer)

    # ----------------------------------------------------------------- forward passes
    def _schedule(self, micro_batches: Sequence[MicroBatch], forward_only: bool,
                  loss_fn: Optional[Callable], temperature: float = 1.0,
                  interrupt: Optional[Callable[[], bool]] = None):
        """Run megatron-core's schedule over the micro-batches; returns, on the last
        stage, one entry per micro-batch: ``loss_fn``'s metrics dict, or (forward only)
        the log-probs of the targets under softmax(logits / ``temperature``). At PP = 1
        ``interrupt`` is polled before each micro-batch: True ends the loop early."""
        from megatron.core.pipeline_parallel import get_forward_backward_func

        from ..models.inference import token_logprobs

        arch = self.arch
        micro_batches = self._lockstep([mb.fitted(self.seq_multiple) for mb in micro_batches])
        real = sum(1 for mb in micro_batches if not mb.is_filler)

        def forward_step(data_iterator, model):
            mb = next(data_iterator)
            self._replay(mb)
            logits = model(mb.input_ids, mb.position_ids, attention_mask=None)

            def finish(output, non_loss_data=False):
                if loss_fn is None:
                    return token_logprobs(output, mb.targets, arch, temperature).detach()
                if mb.is_filler:  # a zero loss whose backward runs every layer
                    return output.float().sum() * 0.0, torch.tensor(0, dtype=torch.int), {}
                loss, metrics = loss_fn(mb, output)
                return loss, torch.tensor(mb.tokens, dtype=torch.int), metrics

            return logits, finish

        if self.pp_size == 1:  # the same steps without the schedule's CUDA placements
            out = []
            weigh = self._aux_weights(micro_batches) if loss_fn is not None else None
            for mb in micro_batches:
                if interrupt is not None and interrupt():
                    break
                if weigh is not None:
                    weigh(mb)
                logits, finish = forward_step(iter([mb]), self.ddp)
                result = finish(logits)
                # the loss holds the logits it needs: without this name they are freed
                # in the backward, and not kept through the next micro-batch's forward
                del logits
                if loss_fn is not None:
                    self._scaled(result[0]).backward()
                    result = result[2]
                out.append(result)
            moe_replay.clear(self.module)
            return out[:real]
        # variable_seq_lengths: seq_length / micro_batch_size only bound the shapes
        S = max(mb.input_ids.shape[1] for mb in micro_batches)
        b = max(mb.input_ids.shape[0] for mb in micro_batches)
        try:
            with cuda_placements_on_cpu():
                out = get_forward_backward_func()(
                    forward_step_func=forward_step, data_iterator=iter(micro_batches),
                    model=[self.ddp], num_microbatches=len(micro_batches), seq_length=S,
                    micro_batch_size=b, forward_only=forward_only,
                    collect_non_loss_data=forward_only)
        finally:
            moe_replay.clear(self.module)
        return out[:real] if out else out

    def _aux_weights(self, micro_batches: list[MicroBatch]) -> Optional[Callable]:
        """With a load-balancing loss: a function that sets megatron-core's aux-loss
        gradient scale for a micro-batch (its tokens / the mini-batch's over DP; one
        scalar all-reduce here)."""
        if not self.aux_loss:
            return None
        from megatron.core import parallel_state as ps
        from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

        from .. import collectives

        local = sum(mb.input_ids.numel() for mb in micro_batches if not mb.is_filler)
        total = collectives.sum_values([local], group=ps.get_data_parallel_group())[0]

        def weigh(mb: MicroBatch) -> None:
            w = 0.0 if mb.is_filler else mb.input_ids.numel() / max(total, 1.0)
            MoEAuxLossAutoScaler.set_loss_scale(
                torch.tensor(w * self.loss_scale, device=self.device))
        return weigh

    def moe_metrics(self) -> dict:
        """The update's expert load (and load-balancing loss) since the last call
        (``models.moe_load``; collective: every rank calls it); {} for a dense model."""
        return self.expert_load.metrics() if self.expert_load is not None else {}

    def _lockstep(self, micro_batches: list[MicroBatch]) -> list[MicroBatch]:
        """At EP > 1, ``micro_batches`` and filler ones up to the EP group's largest
        count (one small all-reduce; the interrupt is off at EP > 1, so no rank stops
        early)."""
        if self.ep_group is None:
            return micro_batches
        from .. import collectives

        most = int(collectives.max_values([len(micro_batches)], group=self.ep_group)[0])
        return micro_batches + [MicroBatch.filler(self.seq_multiple, self.device)
                                for _ in range(most - len(micro_batches))]

    def _replay(self, mb: MicroBatch) -> None:
        """Route ``mb``'s tokens to its recorded experts (routing replay), or let the
        routers choose (no replay, or a micro-batch without routes)."""
        if not self.replay:
            return
        if not moe_replay.set_routes(
                self.module, mb.routes, self.arch.moe_layers,
                sequence_parallel=bool(self.module.config.sequence_parallel)):
            moe_replay.clear(self.module)

    def _scaled(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss`` times the float16 loss scale (unchanged without a scaler)."""
        if self.kind != "megatron" or not self.model_fp16:
            return loss
        return self.optimizer.scale_loss(loss).sum()  # the scale is a [1] tensor

    @property
    def model_fp16(self) -> bool:
        return bool(self.module.config.fp16)

    @property
    def loss_scale(self) -> float:
        if self.kind != "megatron" or not self.model_fp16:
            return 1.0
        return float(self.optimizer.get_loss_scale())

    @torch.no_grad()
    def loss_metrics(self, micro_batches: Sequence[MicroBatch], loss_fn: Callable
                     ) -> list[dict]:
        """``loss_fn``'s metrics of micro-batches that need no gradient (forward only,
        in training mode, PP = 1): the zero-advantage samples a step's update skips."""
        if self.pp_size != 1:
            raise ValueError("Policy.loss_metrics runs at pipeline-parallel size 1 only")
        self.ddp.train()
        out = []
        for mb in self._lockstep([mb.fitted(self.seq_multiple) for mb in micro_batches]):
            self._replay(mb)
            logits = self.ddp(mb.input_ids, mb.position_ids, attention_mask=None)
            if not mb.is_filler:
                out.append(loss_fn(mb, logits)[1])
        moe_replay.clear(self.module)
        return out

    @torch.no_grad()
    def logprobs(self, micro_batches: Sequence[MicroBatch], temperature: float = 1.0
                 ) -> Optional[list[torch.Tensor]]:
        """Per micro-batch [b, S] log p(target) at ``temperature`` (last pipeline stage;
        None elsewhere)."""
        self.ddp.eval()
        out = self._schedule(micro_batches, forward_only=True, loss_fn=None,
                             temperature=temperature)
        if not self.is_last_stage:
            return None
        return [_as_shape(lp, mb.input_ids.shape) for lp, mb in zip(out, micro_batches)]

    def train_step(self, micro_batches: Sequence[MicroBatch], loss_fn: Callable, *,
                   interrupt: Optional[Callable[[], bool]] = None,
                   before_step: Optional[Callable[[], None]] = None
                   ) -> tuple[StepResult, list[dict]]:
        """One optimizer step over ``micro_batches`` (gradient accumulation).

        ``loss_fn(mb, local_logits) -> (loss, metrics)`` returns the micro-batch's share
        of the mini-batch loss (global denominators). Returns the step result and, on
        the last stage, each micro-batch's metrics.

        ``interrupt`` (PP = 1) is polled between micro-batches and ends them early;
        ``before_step`` runs on every rank after the micro-batches and before the
        gradient reduction and the optimizer step, the last moment at which the weights
        and optimizer state are those of before the call (the RL trainer's stop
        agreement, which raises to abandon the step).
        """
        from megatron.core.distributed import finalize_model_grads

        self.ddp.train()
        self.ddp.zero_grad_buffer()
        self.optimizer.zero_grad()
        t0 = self.clock()
        metrics = self._schedule(micro_batches, forward_only=False, loss_fn=loss_fn,
                                 interrupt=interrupt if self.pp_size == 1 else None)
        compute = self.clock() - t0
        if before_step is not None:
            before_step()
        t0 = self.clock()
        with cuda_placements_on_cpu():
            finalize_model_grads([self.ddp], None)  # DP all-reduce, tied embeddings (PP)
            result = self._optimizer_step()
        result.compute_seconds, result.step_seconds = compute, self.clock() - t0
        return result, (list(metrics) if self.is_last_stage else [])

    def clock(self) -> float:
        """Seconds for timing the update's parts: on CUDA after the device finished
        what was queued (a few times per optimizer step, never in a decode loop)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    def _optimizer_step(self) -> StepResult:
        clip = self.cfg.clip_grad
        if self.kind == "megatron":
            found_inf = self.optimizer.prepare_grads()  # unscales; updates the scale
            if found_inf:
                self.scheduler.step(1)
                return StepResult(float("nan"), self.lr, False, self.loss_scale)
            grad_norm = float(self.optimizer.get_grad_norm())
            if not math.isfinite(grad_norm):
                self.scheduler.step(1)
                return StepResult(grad_norm, self.lr, False, self.loss_scale)
            if clip > 0 and grad_norm > clip:
                # (MoE: megatron-core chains a dense and an expert optimizer)
                parts = getattr(self.optimizer, "chained_optimizers", None) or [self.optimizer]
                grads = [p.grad for o in parts for p in o.get_parameters()
                         if p.grad is not None]
                torch._foreach_mul_(grads, clip / (grad_norm + 1e-6))
            lr = self.lr
            self.optimizer.step_with_ready_grads()
            self.scheduler.step(1)
            return StepResult(grad_norm, lr, True, self.loss_scale)
        params = [p for p in self.ddp.parameters() if p.requires_grad]
        for p in params:
            p.grad = p.main_grad
        grad_norm = _model_parallel_grad_norm(params)
        if not math.isfinite(grad_norm):
            self.scheduler.step()
            return StepResult(grad_norm, self.lr, False)
        if clip > 0 and grad_norm > clip:
            torch._foreach_mul_([p.grad for p in params], clip / (grad_norm + 1e-6))
        lr = self.lr
        self.optimizer.step()
        self.scheduler.step()
        return StepResult(grad_norm, lr, True)

    @property
    def lr(self) -> float:
        return float(self.optimizer.param_groups[0]["lr"])

    # ----------------------------------------------------------------- run state
    def state_dict(self) -> dict:
        return {"model": self.module.state_dict(),
                "optimizer": self.optimizer.state_dict(),
                "scheduler": self.scheduler.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.module.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])


def _as_shape(x: torch.Tensor, shape) -> torch.Tensor:
    """``x`` computed on a fitted micro-batch (``MicroBatch.fitted``) at the caller's
    [b, S]: positions it did not compute (filler rows, padding) are 0."""
    if tuple(x.shape) == tuple(shape):
        return x
    out = x.new_zeros(shape)
    rows, cols = min(shape[0], x.shape[0]), min(shape[1], x.shape[1])
    out[:rows, :cols] = x[:rows, :cols]
    return out


def _model_parallel_grad_norm(params) -> float:
    """Global L2 norm of the gradients over the model-parallel group, each parameter
    counted once (tied embeddings and TP-replicated norms are not double-counted)."""
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel
    from megatron.core.transformer.module import param_is_not_shared

    from .. import collectives

    group = ps.get_model_parallel_group()
    total = torch.zeros(1, dtype=torch.float64, device=collectives.device_of(group))
    for p in params:
        if p.grad is not None and param_is_not_shared(p) and \
                tensor_parallel.param_is_not_tensor_parallel_duplicate(p):
            total += p.grad.detach().double().pow(2).sum().to(total.device)
    collectives.all_reduce(total, group=group)
    return float(total.sqrt().item())


class _TorchSchedule:
    """Warm-up + constant/cosine for ``train.optimizer=torch`` (megatron-core's
    scheduler drives megatron-core's optimizer)."""

    def __init__(self, optimizer, cfg, total_steps: int):
        self.optimizer, self.cfg, self.total = optimizer, cfg, max(total_steps, 1)
        self.num_steps = 0
        self._apply()

    def _apply(self):
        c, n = self.cfg, self.num_steps
        if c.lr_warmup_steps and n < c.lr_warmup_steps:
            lr = c.lr * n / c.lr_warmup_steps
        elif c.lr_decay == "cosine":
            span = max(self.total - c.lr_warmup_steps, 1)
            frac = min((n - c.lr_warmup_steps) / span, 1.0)
            lr = c.min_lr + 0.5 * (c.lr - c.min_lr) * (1 + math.cos(math.pi * frac))
        else:
            lr = c.lr
        for g in self.optimizer.param_groups:
            g["lr"] = lr

    def step(self):
        self.num_steps += 1
        self._apply()

    def state_dict(self):
        return {"num_steps": self.num_steps}

    def load_state_dict(self, state):
        self.num_steps = int(state["num_steps"])
        self._apply()
