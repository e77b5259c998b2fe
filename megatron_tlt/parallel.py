"""Model-parallel groups: the only module that creates process groups.

Thin wrappers over megatron-core's ``parallel_state`` so callers ask one place for
ranks and sizes; later the dynamic drafter group lives here too.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist


@dataclass(frozen=True)
class ParallelLayout:
    """This rank's place in the (TP, PP, DP) grid, and in its expert-parallel group
    (EP: ranks of the same TP and PP position, consecutive DP ranks; ``ep_size`` divides
    ``dp_size``; each holds 1/EP of every mixture-of-experts layer's experts)."""

    tp_size: int
    pp_size: int
    dp_size: int
    tp_rank: int
    pp_rank: int
    dp_rank: int
    ep_size: int = 1
    ep_rank: int = 0

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1


def initialize_model_parallel(tp: int = 1, pp: int = 1, seed: int = 1234,
                              timeout_s: float = 1800.0, ep: int = 1) -> ParallelLayout:
    """Create megatron-core's TP/PP/DP groups (and its expert groups: EP, the expert
    TP size = TP, expert data parallel = DP / EP) and seed its model-parallel RNG streams.

    torch.distributed must already be initialised (``runtime_env.init_distributed``).
    ``timeout_s``: the groups' collective timeout (``parallel.collective_timeout_s``, as
    the default group's; megatron-core's own default is 30 minutes).
    """
    from megatron.core import parallel_state, tensor_parallel

    world = dist.get_world_size()
    if world % (tp * pp) != 0:
        raise ValueError(
            f"world size {world} is not divisible by tensor_model_parallel_size {tp} x "
            f"pipeline_model_parallel_size {pp}; launch a multiple of {tp * pp} processes"
        )
    if (world // (tp * pp)) % ep:
        raise ValueError(
            f"expert_model_parallel_size {ep} does not divide the data-parallel size "
            f"{world // (tp * pp)} (world {world} / (TP {tp} x PP {pp})); launch a "
            f"multiple of {tp * pp * ep} processes")
    global _made
    made = (dist.group.WORLD, world, tp, pp, ep, timeout_s)
    if parallel_state.model_parallel_is_initialized():
        if _made is not None and all(a is b or a == b for a, b in zip(_made, made)):
            # the same groups again (a process that sets up several times: tests, the
            # GPU check's parts): keep them. megatron-core's destroy_model_parallel
            # forgets its groups but torch.distributed keeps them alive, each gloo group
            # with its threads, whose polling costs CPU for the rest of the process
            tensor_parallel.model_parallel_cuda_manual_seed(seed)
            return layout()
        parallel_state.destroy_model_parallel()
    _made = None
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
        expert_model_parallel_size=ep,
        distributed_timeout_minutes=timeout_s / 60,  # (a float is fine: a timedelta)
    )
    _made = made
    tensor_parallel.model_parallel_cuda_manual_seed(seed)
    return layout()


# (default group, world size, TP, PP, EP, timeout) of the groups megatron-core holds
_made: tuple | None = None


def layout() -> ParallelLayout:
    from megatron.core import parallel_state as ps

    return ParallelLayout(
        tp_size=ps.get_tensor_model_parallel_world_size(),
        pp_size=ps.get_pipeline_model_parallel_world_size(),
        dp_size=ps.get_data_parallel_world_size(),
        tp_rank=ps.get_tensor_model_parallel_rank(),
        pp_rank=ps.get_pipeline_model_parallel_rank(),
        dp_rank=ps.get_data_parallel_rank(),
        ep_size=ps.get_expert_model_parallel_world_size(),
        ep_rank=ps.get_expert_model_parallel_rank(),
    )


def expert_group():
    """The expert-parallel process group (None at EP = 1)."""
    from megatron.core import parallel_state as ps

    if ps.get_expert_model_parallel_world_size() == 1:
        return None
    return ps.get_expert_model_parallel_group()


def destroy_model_parallel() -> None:
    from megatron.core import parallel_state

    global _made
    _made = None
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
