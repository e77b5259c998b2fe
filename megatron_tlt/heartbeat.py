"""Heartbeats through the torch.distributed store: a dead or frozen rank stops the job.

A collective whose peer died errors out (gloo: the connection closes) or, when the peer
hangs instead (a frozen node, a process stopped or stuck in a kernel), waits until the
process group's timeout (``parallel.collective_timeout_s``). The heartbeat bounds the
second case by ``parallel.heartbeat_timeout_s`` and names the rank.

Each rank runs one daemon thread that, every ``interval`` seconds, adds 1 to its
counter ``megatron_tlt/heartbeat/{rank}`` in the rendezvous store (its own client
connection to the ``MASTER_ADDR:MASTER_PORT`` store that torchrun set up) and reads its
peers' counters. A peer whose counter has not moved for ``timeout`` seconds, or a store
that cannot be reached for that long, makes this rank print which rank (and host)
stopped and exit with ``PEER_LOST_EXIT_CODE``; torchrun / srun then stop the rest of
the job. A rank that finishes normally marks itself done, so it is never reported.
The thread needs the GIL only for a moment per beat: long torch kernels release it.

``lost_peer()`` tells waits off the collectives (``arrival.py``: a replica waiting on
the store for the tail) what the running heartbeat found, so such a wait stops with
the same message when ``on_lost`` does not end the process.
"""

from __future__ import annotations

import datetime
import os
import socket
import sys
import threading
import time
from typing import Callable, Optional

PEER_LOST_EXIT_CODE = 71
PREFIX = "megatron_tlt/heartbeat"


def rendezvous_store(prefix: str, timeout: float):
    """A client connection of this rank's own to the launch's rendezvous store
    (``MASTER_ADDR:MASTER_PORT``, torchrun / srun), its keys under ``prefix``; None
    outside a multi-rank launch."""
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1 or "MASTER_ADDR" not in os.environ:
        return None
    import torch.distributed as dist

    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                          is_master=False, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=max(timeout, 1.0)))
    return dist.PrefixStore(prefix, store)


_running: Optional["Heartbeat"] = None  # the one started in this process


def lost_peer() -> Optional[str]:
    """The running heartbeat's message about a dead or frozen peer (or an unreachable
    store); None while every peer beats, or without a running heartbeat."""
    return _running.lost if _running is not None else None


def _exit(message: str) -> None:
    print(message, file=sys.stderr, flush=True)
    os._exit(PEER_LOST_EXIT_CODE)


class Heartbeat:
    """Beats for this rank and watches every other rank (see the module docstring)."""

    def __init__(self, rank: int, world_size: int, timeout: float, *,
                 interval: Optional[float] = None, store=None,
                 on_lost: Callable[[str], None] = _exit):
        self.rank, self.world_size, self.timeout = rank, world_size, float(timeout)
        self.interval = interval if interval is not None else min(5.0, self.timeout / 10)
        self.on_lost = on_lost
        self.lost: Optional[str] = None  # set when a peer (or the store) is lost
        self._store = store
        self._stop = threading.Event()
        self._lock = threading.Lock()  # one store connection, used by two threads
        self._thread: Optional[threading.Thread] = None

    @classmethod
    def from_environment(cls, timeout: float, **kw) -> Optional["Heartbeat"]:
        """For a torchrun / srun launch (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT);
        None for a one-process run or a timeout of 0 (off)."""
        world = int(os.environ.get("WORLD_SIZE", "1"))
        if timeout <= 0 or world <= 1 or "MASTER_ADDR" not in os.environ:
            return None
        return cls(int(os.environ["RANK"]), world, timeout, **kw)

    def _connect(self):
        return rendezvous_store(PREFIX, self.timeout)

    def start(self) -> "Heartbeat":
        global _running
        if self._store is None:
            self._store = self._connect()
        self._store.set(f"host/{self.rank}", socket.gethostname())
        self._store.add(str(self.rank), 1)
        self._thread = threading.Thread(target=self._run, name="heartbeat", daemon=True)
        self._thread.start()
        _running = self
        return self

    def stop(self) -> None:
        """This rank is done: peers no longer expect its beats."""
        global _running
        self._stop.set()  # the daemon thread ends at its next wake-up; no join needed
        if _running is self:
            _running = None
        try:
            with self._lock:
                self._store.add(f"done/{self.rank}", 1)
        except Exception:  # noqa: BLE001 - the store may be gone at the end of a job
            pass

    def _host(self, rank: int) -> str:
        try:
            return self._store.get(f"host/{rank}").decode()
        except Exception:  # noqa: BLE001 - the name is only for the message
            return "?"

    def _lose(self, message: str) -> None:
        self.lost = message
        self.on_lost(message)

    def _run(self) -> None:
        peers = [r for r in range(self.world_size) if r != self.rank]
        seen = {r: (-1, time.monotonic()) for r in peers}
        store_ok = time.monotonic()
        while not self._stop.wait(self.interval):
            now = time.monotonic()
            try:
                with self._lock:
                    if self._stop.is_set():
                        return
                    self._store.add(str(self.rank), 1)
                    counts = {r: self._store.add(str(r), 0) for r in peers}
                    done = {r for r in peers if self._store.add(f"done/{r}", 0)}
                store_ok = now
            except Exception as e:  # noqa: BLE001 - the store's host may be the dead one
                if now - store_ok > self.timeout:
                    self._lose(
                        f"error: rank {self.rank}: the rendezvous store at "
                        f"{os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')} "
                        f"has not answered for {now - store_ok:.0f} s ({e}); the node of "
                        f"rank 0 is likely down. Stopping this rank "
                        f"(parallel.heartbeat_timeout_s={self.timeout:g})")
                    return
                continue
            for r in peers:
                if r in done:
                    continue
                last, since = seen[r]
                if counts[r] != last:
                    seen[r] = (counts[r], now)
                elif now - since > self.timeout:
                    self._lose(
                        f"error: rank {self.rank}: rank {r} (host {self._host(r)}) sent no "
                        f"heartbeat for {now - since:.0f} s: it died or hangs. Stopping "
                        f"this rank so the job fails instead of waiting in a collective "
                        f"(parallel.heartbeat_timeout_s={self.timeout:g})")
                    return
