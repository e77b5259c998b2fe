"""Arrivals through the rendezvous store: who has reached a point, waited for off the
collectives.

A rank that enters a collective its peers reach only much later waits inside it, and
the process group's timeout (``parallel.collective_timeout_s``; NCCL's watchdog, gloo's
own timeout) aborts the job when the wait is longer. The rollout's tail is such a wait:
the replica that finished first reaches the step barrier while the last one still
decodes, which at the 32B recipe's lengths can take longer than the timeout. So a rank
that has finished first *arrives* on the torch.distributed store (one ``add`` on a
counter), polls the counter until every rank has arrived, and only then enters the
collective, which then completes at once.

- ``Arrivals``: counters on the store under a namespace of their own. ``arrive(key)``
  counts the caller, ``count(key)`` reads, ``wait(key, n)`` polls until ``n`` have
  arrived (every ``POLL_MIN_S`` at first, backing off to ``poll_max_s``), ``forget(key)``
  deletes. The namespace holds the launch attempt (``TORCHELASTIC_RESTART_COUNT``: an
  elastic restart reuses the store) and the instance's index in this process (every
  rank makes its instances in the same order, as it makes process groups), so keys of
  an earlier attempt, or of another trainer or drafter group in the same process, never
  satisfy a wait.
- ``StepPoints``: the trainer's points, every rank of the world counted. Each point's
  key carries a sequence number (every rank passes the same points in the same order)
  and the step, so a point never reuses a key; the keys of the point before last are
  deleted when a rank arrives at a new one (every rank has left that wait by then).

The wait is bounded. A peer that died or froze is the heartbeat's to find
(``heartbeat.py``: by default it ends the process; the wait also stops with
``PeerLost`` when a running heartbeat reports a lost peer). A peer that is alive but
never arrives (a logic error, a rank stuck elsewhere) ends the wait after ``bound_s``
(the trainer: ``BOUND_FACTOR`` x ``parallel.collective_timeout_s``, 4 h at the default)
with ``ArrivalTimeout`` naming the ranks missing.

Cost: per point and rank one ``add`` and one ``set`` on arrival, then one ``add`` per
poll (at most ``1 / poll_max_s`` per second and rank while waiting) on the store's
host; a rank that arrives last reads the complete count at once.
"""

from __future__ import annotations

import contextlib
import os
import time
from typing import Optional

from . import heartbeat

POLL_MIN_S = 0.001      # the first poll's wait; doubled after each until poll_max_s
POLL_MAX_S = 0.25
BOUND_FACTOR = 8        # the trainer's bound: this many collective timeouts
DEFAULT_BOUND_S = BOUND_FACTOR * 1800.0

_made: dict[str, int] = {}  # Arrivals made in this process, per prefix


class ArrivalTimeout(RuntimeError):
    """Some rank did not arrive within the wait's bound."""


class PeerLost(RuntimeError):
    """The heartbeat found a dead or frozen peer while this rank waited."""


def default_store():
    """The store torch.distributed rendezvoused through (shared by every rank); None
    without a process group."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return None
    from torch.distributed import distributed_c10d

    return distributed_c10d._get_default_store()


class Arrivals:
    """Arrival counters on ``store`` (see the module docstring). ``who`` in ``arrive``
    names the caller (a rank, a replica) so a wait that gives up can name who is
    missing."""

    def __init__(self, store, prefix: str = "megatron_tlt/arrival", *,
                 bound_s: float = DEFAULT_BOUND_S, poll_max_s: float = POLL_MAX_S):
        import torch.distributed as dist

        index = _made[prefix] = _made.get(prefix, -1) + 1
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        self.namespace = f"{prefix}/{attempt}/{index}/"
        self.store = dist.PrefixStore(self.namespace, store)
        self.bound_s = float(bound_s)
        self.poll_max_s = float(poll_max_s)

    def arrive(self, key: str, who: Optional[int] = None) -> int:
        """Count the caller as arrived at ``key``; returns how many have arrived."""
        if who is not None:
            self.store.set(f"{key}/who/{who}", b"")
        return int(self.store.add(key, 1))

    def count(self, key: str) -> int:
        return int(self.store.add(key, 0))

    def wait(self, key: str, n: int, *, who: Optional[range] = None,
             what: str = "") -> float:
        """Poll until ``n`` have arrived at ``key``; returns the seconds waited. Raises
        ``PeerLost`` when the heartbeat reports a lost peer, ``ArrivalTimeout`` after
        ``bound_s`` (``who``: the callers expected, named in the message when they did
        not arrive)."""
        t0 = time.monotonic()
        pause = POLL_MIN_S
        while True:
            got = self.count(key)
            if got >= n:
                return time.monotonic() - t0
            lost = heartbeat.lost_peer()
            if lost is not None:
                raise PeerLost(f"{lost} (while waiting at {what or key})")
            waited = time.monotonic() - t0
            if waited > self.bound_s:
                missing = [] if who is None else [
                    r for r in who if not self.store.check([f"{key}/who/{r}"])]
                raise ArrivalTimeout(
                    f"waited {waited:.0f} s at {what or key} for the others to arrive: "
                    f"{got} of {n} did" + (f"; missing: {missing}" if missing else "") +
                    f". A peer that is alive but never arrives (the heartbeat finds dead "
                    f"ones) ends the wait after {self.bound_s:.0f} s (the trainer: "
                    f"{BOUND_FACTOR} x parallel.collective_timeout_s)")
            time.sleep(min(pause, self.bound_s - waited + 0.01))
            pause = min(pause * 2, self.poll_max_s)

    def forget(self, key: str, who: Optional[int] = None) -> None:
        """Delete ``key`` (and the caller's name under it): only once nobody waits on
        it any more."""
        with contextlib.suppress(Exception):  # stores without delete keep a few bytes
            self.store.delete_key(key)
            if who is not None:
                self.store.delete_key(f"{key}/who/{who}")


class StepPoints:
    """The trainer's arrival points: every rank of the world arrives, a wait ends when
    all ``world`` have. Without a process group (one process, no store) every call
    returns at once."""

    def __init__(self, world: int, rank: int, *, store=None,
                 bound_s: float = DEFAULT_BOUND_S, prefix: str = "megatron_tlt/steps"):
        store = store if store is not None else default_store()
        self.arrivals = Arrivals(store, prefix, bound_s=bound_s) if store is not None \
            else None
        self.world, self.rank = world, rank
        self._seq = 0
        self._keys: list[str] = []  # this rank's keys not deleted yet, oldest first

    def arrive(self, step: int, name: str) -> str:
        """Count this rank at point ``name`` of ``step``; returns the point's key for
        ``wait``. Every rank passes the same points in the same order."""
        key = f"{self._seq}/step{step}/{name}"
        self._seq += 1
        if self.arrivals is None:
            return key
        while len(self._keys) >= 2:  # the point before last: every rank has left it
            self.arrivals.forget(self._keys.pop(0), self.rank)
        self._keys.append(key)
        self.arrivals.arrive(key, self.rank)
        return key

    def wait(self, key: str) -> float:
        """Wait on the store until every rank has arrived at ``key``; seconds waited."""
        if self.arrivals is None:
            return 0.0
        return self.arrivals.wait(key, self.world, who=range(self.world),
                                  what=f"the step point {key!r}")

    def meet(self, step: int, name: str) -> float:
        """``arrive`` then ``wait``: call just before a collective every rank reaches
        at the end of work of uneven length."""
        return self.wait(self.arrive(step, name))
