"""Set-up shared by the drafter-group torchrun workers (tests/support/mp_drafter_group*_worker.py).

    env = tiny_engine(model_dir, tp=1, pp=1)   # init gloo + megatron-core groups, load,
    env.responses(step)                        # the rollout's responses as buffer records

``tiny_engine`` starts torch.distributed (gloo, CPU) and megatron-core's groups, loads the
tiny model (float32), makes a fresh EAGLE drafter (``env.init_state``: its unsharded
state, a copy), attaches it to a rollout engine that always speculates (fixed 2_1_2
strategy) and generates 4 prompts with hidden states. ``make_group`` builds a
``DrafterGroup`` on it over megatron-core's groups at the ``RECIPE`` sampling.
``loss_and_grad`` is the group's loss and clipped gradient on one batch (full and pruned
draft vocabulary), and ``runner_at_mp1`` the same model at TP = PP = 1, for comparing
model-parallel layouts with it. ``everywhere`` / ``identical_everywhere`` gather a
value from every rank; ``write_result`` ends a worker.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.distributed as dist

# the recipe's rollout sampling: the group's loss and canary run at these settings (and
# ``loss_and_grad`` at the same temperature, top-k and top-p)
RECIPE_SAMPLING = dict(temperature=0.7, top_k=20, top_p=0.9, max_new_tokens=12)


def tiny_engine(model_dir, *, tp: int = 1, pp: int = 1) -> SimpleNamespace:
    from megatron_tlt.config import RolloutConfig, SpeculativeConfig
    from megatron_tlt.drafter_training.buffer import BufferedResponse
    from megatron_tlt.models import load_model
    from megatron_tlt.models.drafter import DrafterConfig, EagleDrafter
    from megatron_tlt.parallel import initialize_model_parallel
    from megatron_tlt.rollout import RolloutEngine, SamplingParams
    from megatron_tlt.runtime_env import init_distributed, silence_expected_warnings

    silence_expected_warnings()
    init_distributed(device="cpu", backend="gloo")
    layout = initialize_model_parallel(tp, pp, seed=1234)
    torch.manual_seed(0)
    model, arch = load_model(model_dir, device=torch.device("cpu"), dtype="float32",
                             impl="local")
    drafter = EagleDrafter(DrafterConfig.for_target(arch), arch)
    # one unsharded drafter, the same on every rank (a copy: own_state returns the
    # replicated tensors themselves)
    init_state = {k: v.clone() for k, v in drafter.own_state().items()}
    sc = SpeculativeConfig(policy="fixed", strategy="2_1_2", threshold=1 << 20)
    engine = RolloutEngine(model, None, RolloutConfig(speculative=sc), arch=arch,
                           eos_token_ids=[], drafter=drafter)
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(0, arch.vocab_size, (n,), generator=g).tolist()
               for n in (3, 6, 4, 8)]
    outs = engine.generate(prompts, SamplingParams(temperature=1.0, max_new_tokens=12, seed=3,
                                                   return_hidden_states=True))

    def responses(step):
        return [BufferedResponse.from_output(o, step) for o in outs]

    return SimpleNamespace(layout=layout, model=model, arch=arch, drafter=drafter,
                           init_state=init_state, engine=engine, prompts=prompts,
                           outs=outs, responses=responses)


def loss_and_grad(drafter, target, batch, init_state, loss_preset: str, vocab) -> dict:
    """The loss (at T = 0.7, top-k 20, top-p 0.9), its alpha and its gradient clipped
    to norm 0.05 (unsharded like the weights) on ``batch``, from ``init_state``, with
    the full and with the pruned (``vocab``) draft vocabulary."""
    from megatron_tlt.drafter_training.losses import LossConfig
    from megatron_tlt.drafter_training.trainer import DrafterTrainer

    out = {}
    for name, ids in (("full", None), ("pruned", vocab)):
        drafter.set_draft_vocabulary(None)
        drafter.load_own_state(init_state)
        drafter.set_draft_vocabulary(ids)
        tr = DrafterTrainer(drafter, target, grad_clip=0.05,
                            loss=LossConfig.for_sampling(loss_preset, 0.7, 20, 0.9))
        with target.whole_vocab():
            loss, parts = tr.loss(batch)
        loss.backward()
        tr._clip_grads()
        keep = [(p, p.data.clone()) for p in tr.params]
        for p in tr.params:
            p.data.copy_(p.grad)
        grad = torch.cat([v.reshape(-1).double() for k, v in drafter.own_state().items()
                          if k != "d2t"])
        for p, w in keep:
            p.data.copy_(w)
        out[name] = {"loss": parts["loss"], "alpha": parts["alpha"], "grad": grad.tolist()}
    drafter.set_draft_vocabulary(None)
    return out


def make_group(env, cfg, store, drafter=None, **kw):
    """A ``DrafterGroup`` of ``drafter`` (default: the engine's) on ``env``'s runner over
    megatron-core's data-, model- and pipeline-parallel groups, at the recipe's
    sampling (``kw`` overrides any argument)."""
    from megatron.core import parallel_state as ps

    from megatron_tlt.drafter_training.group import DrafterGroup
    from megatron_tlt.rollout import SamplingParams

    args = dict(dp_group=ps.get_data_parallel_group(), mp_group=ps.get_model_parallel_group(),
                pp_group=ps.get_pipeline_model_parallel_group(), store=store,
                total_steps=10_000, seed=1, sampling=SamplingParams(**RECIPE_SAMPLING))
    return DrafterGroup(drafter if drafter is not None else env.engine.spec.drafter.model,
                        env.engine.runner, cfg, **{**args, **kw})


def runner_at_mp1(model_dir, arch):
    """Model parallelism re-initialised at TP = PP = 1 and the same tiny model loaded
    whole: (model, its ``ModelRunner``)."""
    from megatron_tlt.models import load_model
    from megatron_tlt.parallel import initialize_model_parallel
    from megatron_tlt.rollout.forward import ModelRunner

    initialize_model_parallel(1, 1, seed=1234)
    model, _ = load_model(model_dir, device=torch.device("cpu"), dtype="float32",
                          impl="local")
    return model, ModelRunner(model, arch)


def everywhere(obj) -> list:
    """``obj`` of every rank, by rank (a collective)."""
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def identical_everywhere(flat: torch.Tensor) -> bool:
    """Whether every rank holds the same ``flat`` (a collective)."""
    every = [torch.empty_like(flat) for _ in range(dist.get_world_size())]
    dist.all_gather(every, flat)
    return all(torch.equal(f, every[0]) for f in every)


def write_result(out, res: dict) -> None:
    """``res`` as ``out/rank{R}.json``; then the process group ends (every rank)."""
    (Path(out) / f"rank{dist.get_rank()}.json").write_text(json.dumps(res))
    dist.barrier()
    dist.destroy_process_group()
