"""Worker for tests/rl/test_checkpoint.py: one rank saving through megatron-core
``dist_checkpointing`` as ``checkpoint.sharded.save_policy`` does (MODE ``sync``, or
``async``: the request scheduled on ``checkpoint.background.BackgroundSaves`` while the
rank goes on), whose forked file writer hangs mid-write after writing to PIDFILE the
pids of every process the rank has started (itself first), so the test can SIGKILL the
rank mid-save:

    python mp_checkpoint_writer_worker.py FOLDER PIDFILE [MODE]
"""

from __future__ import annotations

import os
import sys
import time

import psutil
import torch

from megatron_tlt.checkpoint.background import BackgroundSaves
from megatron_tlt.checkpoint.sharded import ResultsFile, writers_die_with_rank
from megatron_tlt.runtime_env import init_distributed

RANK = os.getpid()

if __name__ == "__main__":
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.mapping import ShardedTensor
    from megatron.core.dist_checkpointing.strategies.filesystem_async import (
        FileSystemWriterAsync)

    init_distributed(device="cpu")
    folder, pidfile = sys.argv[1], sys.argv[2]
    mode = sys.argv[3] if len(sys.argv) > 3 else "sync"

    def hang(*_a, **_k):
        others = [p.pid for p in psutil.Process(RANK).children(recursive=True)
                  if p.pid != os.getpid()]
        with open(pidfile + ".tmp", "w") as f:
            f.write(" ".join(map(str, [os.getpid(), *others])))
        os.replace(pidfile + ".tmp", pidfile)
        time.sleep(600)

    FileSystemWriterAsync.write_preloaded_data = staticmethod(hang)
    sd = {"w": ShardedTensor.from_rank_offsets("w", torch.arange(8.0))}
    if mode == "sync":
        with writers_die_with_rank():
            dist_checkpointing.save(sd, folder)
    else:
        background = BackgroundSaves()
        with writers_die_with_rank(ResultsFile()):
            background.schedule(dist_checkpointing.save(sd, folder, async_sharded_save=True))
        time.sleep(600)  # the rank trains on while its background writer writes
