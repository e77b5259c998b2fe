"""parallel.initialize_model_parallel asked again for the same layout keeps megatron-core's
groups: a process that sets up several times (a pytest-xdist worker, the GPU check's
parts) would otherwise keep every earlier set of gloo groups alive in torch.distributed,
each with its threads, whose polling costs CPU for the rest of the process."""

from __future__ import annotations

import os


def _threads() -> int:
    return len(os.listdir(f"/proc/{os.getpid()}/task"))


def test_the_same_layout_again_keeps_the_groups_and_reseeds(single_process_parallel):
    import torch
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    from megatron_tlt.parallel import initialize_model_parallel

    initialize_model_parallel(1, 1, seed=7)
    groups, threads = ps.get_data_parallel_group(), _threads()
    with get_cuda_rng_tracker().fork():
        first = torch.rand(4)
    for _ in range(3):
        layout = initialize_model_parallel(1, 1, seed=7)
    assert ps.get_data_parallel_group() is groups
    assert _threads() == threads
    assert (layout.tp_size, layout.pp_size, layout.dp_size) == (1, 1, 1)
    with get_cuda_rng_tracker().fork():  # reseeded: the model-parallel stream restarts
        assert torch.equal(torch.rand(4), first)
    # another timeout is another set of groups
    initialize_model_parallel(1, 1, seed=7, timeout_s=60.0)
    assert ps.get_data_parallel_group() is not groups
    initialize_model_parallel(1, 1, seed=1234)  # as the session fixture made them
