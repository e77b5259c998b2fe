"""Worker for tests/rl/test_checkpoint.py: one rank saving through megatron-core
``dist_checkpointing`` as ``checkpoint.sharded.save_policy`` does, whose forked file
writer hangs mid-write after writing "PID N" to PIDFILE (its pid and how many
processes the rank has started), so the test can SIGKILL the rank mid-save:

    python mp_checkpoint_writer_worker.py FOLDER PIDFILE
"""

from __future__ import annotations

import os
import sys
import time

import psutil
import torch

from megatron_tlt.checkpoint.sharded import writers_die_with_rank
from megatron_tlt.runtime_env import init_distributed

if __name__ == "__main__":
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.mapping import ShardedTensor
    from megatron.core.dist_checkpointing.strategies.filesystem_async import (
        FileSystemWriterAsync)

    init_distributed(device="cpu")
    pidfile = sys.argv[2]

    def hang(*_a, **_k):
        rank = psutil.Process(os.getppid())
        with open(pidfile + ".tmp", "w") as f:
            f.write(f"{os.getpid()} {len(rank.children(recursive=True))}")
        os.replace(pidfile + ".tmp", pidfile)
        time.sleep(600)

    FileSystemWriterAsync.write_preloaded_data = staticmethod(hang)
    sd = {"w": ShardedTensor.from_rank_offsets("w", torch.arange(8.0))}
    with writers_die_with_rank():
        dist_checkpointing.save(sd, sys.argv[1])
