"""Worker for tests/rl/test_faults.py: two ranks in a loop of all-reduces, with heartbeats.

    RANK=r WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=p python mp_heartbeat_worker.py T

Prints "ready" once the group and the heartbeat run; the test then stops or kills
rank 1 and waits for rank 0 to exit.
"""

from __future__ import annotations

import datetime
import sys

import torch
import torch.distributed as dist

from megatron_tlt.heartbeat import Heartbeat

if __name__ == "__main__":
    dist.init_process_group("gloo", timeout=datetime.timedelta(minutes=30))
    hb = Heartbeat.from_environment(float(sys.argv[1]), interval=0.2).start()
    t = torch.ones(1)
    dist.all_reduce(t)
    print("ready", flush=True)
    while True:  # a collective that waits forever on a frozen peer (30 min timeout)
        dist.all_reduce(t)
