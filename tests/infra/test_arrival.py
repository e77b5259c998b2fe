"""Arrivals on the store (megatron_tlt/arrival.py), in one process with an in-memory
store: a wait ends when the last one arrives, keys never carry over between instances
or points, a peer the heartbeat lost or one that never arrives ends the wait with a
message naming it."""

from __future__ import annotations

import threading
import time

import pytest
import torch.distributed as dist

from megatron_tlt import arrival, heartbeat
from megatron_tlt.arrival import Arrivals, ArrivalTimeout, PeerLost, StepPoints


def test_a_wait_ends_when_the_last_rank_arrives():
    store = dist.HashStore()
    points = []
    for rank in range(2):  # two "processes", each making its first instance
        arrival._made.clear()
        points.append(StepPoints(2, rank, store=store))
    a, b = points
    assert a.arrivals.namespace == b.arrivals.namespace
    key = a.arrive(0, "barrier")
    assert a.arrivals.count(key) == 1
    done = []
    waiter = threading.Thread(target=lambda: done.append(a.wait(key)))
    waiter.start()
    time.sleep(0.2)
    assert not done  # rank 1 has not arrived: rank 0 still waits
    assert b.arrive(0, "barrier") == key  # the same points give the same key
    waiter.join(timeout=10)
    assert done and done[0] >= 0.2
    assert b.wait(key) < 1.0  # the last one to arrive does not wait


def test_keys_never_carry_over():
    store = dist.HashStore()
    old = StepPoints(1, 0, store=store)
    key = old.arrive(0, "barrier")
    fresh = Arrivals(store, "megatron_tlt/steps")  # another trainer in the same process
    assert fresh.count(key) == 0 and old.arrivals.count(key) == 1
    # the same step again (a resumed step) is a new point: its count starts at 0
    again = old.arrive(0, "barrier")
    assert again != key and old.arrivals.count(again) == 1
    third = old.arrive(1, "barrier")  # the point before last is deleted now
    assert old.arrivals.count(key) == 0 and old.arrivals.count(again) == 1
    assert old.arrivals.count(third) == 1


def test_a_wait_gives_up_naming_the_missing_or_the_lost():
    store = dist.HashStore()
    arr = Arrivals(store, "test/bound", bound_s=0.3)
    arr.arrive("k", who=0)
    arr.arrive("k", who=2)
    with pytest.raises(ArrivalTimeout, match=r"2 of 3 did; missing: \[1\]"):
        arr.wait("k", 3, who=range(3))
    lost = []
    hb = heartbeat.Heartbeat(0, 2, 60.0, store=store, on_lost=lost.append)
    try:
        hb.start()
        hb._lose("rank 1 sent no heartbeat")
        with pytest.raises(PeerLost, match="rank 1 sent no heartbeat"):
            Arrivals(store, "test/lost").wait("k", 2)
    finally:
        hb.stop()
    assert lost == ["rank 1 sent no heartbeat"] and heartbeat.lost_peer() is None
