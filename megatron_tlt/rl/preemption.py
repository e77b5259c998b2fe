"""Stopping a run on request: SIGTERM / SIGUSR1 or a stop file, checkpoint, requeue.

A stop request comes from either

* a signal to a rank: SIGTERM (what ``kill`` and most schedulers send) or SIGUSR1
  (what SLURM's ``--signal=USR1@T`` sends), or
* the stop file ``{checkpoint.save}/STOP``: the SLURM scripts' trap creates it when the
  batch shell gets ``--signal=B:TERM@120``. A signal that reaches ``torchrun`` makes it
  SIGTERM its ranks and SIGKILL them 30 s later, too soon for a checkpoint of a large
  model, so the scripts do not send the signal through torchrun; every rank looks for
  the file once a second.

The handler only records the request (``pending``, rank-local, read without any
collective). Given the launch's rendezvous store, each rank's once-a-second poll also
publishes its own request there and picks up another rank's, so a signal that reached
one rank only reaches the others within about a second. The step in progress then
ends early where that is safe, and every rank calls ``agreed()``, an all-reduce (MAX)
of the flag over all ranks, at the same agreement points, so all of them stop at the
same point and none waits in a collective for a rank that left:

* after the rollout (at the step barrier): a replica at TP = PP = 1 stops decoding at
  its next decode step (``RolloutEngine.interrupt``) and drops its partial responses;
* before the step's first optimizer step: at PP = 1 the remaining micro-batches of the
  first mini-batch are skipped (the policy's weights and optimizer are untouched until
  the optimizer step);
* at the end of the step (after the update and its metrics).

At the first two the step is abandoned (``rl.safe_point.abandon_if_agreed``): what it
had changed (RNG streams, the sampler's position, counters, the tuner, the drafter with
its optimizer and data buffer) is restored from the copy taken when it began, so the
run is exactly at the end of the last completed step; a resume redoes the abandoned
step. The run then writes a checkpoint of that state (unless that step's regular save
already wrote it), rank 0 consumes the stop file and writes
``{checkpoint.save}/requeue`` (JSON: step, reason, checkpoint), and each rank exits
with ``REQUEUE_EXIT_CODE`` (75).

The time to exit is bounded: at most the rest of the phase that cannot be cut (the
old/reference log-prob pass; at TP or PP > 1 the rollout; updates after the step's
first optimizer step) plus one checkpoint save (and the rest of an asynchronous save
still being written). If that takes longer than
``checkpoint.stop_deadline_s`` after the request, or a second signal arrives, the rank
exits at once with ``FORCED_EXIT_CODE`` (76) without writing: the newest complete
checkpoint under ``latest`` stays what a resume loads.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Optional

from .. import collectives
from ..fileio import write_text_atomic

REQUEUE_EXIT_CODE = 75   # stopped with a checkpoint written: requeue
FORCED_EXIT_CODE = 76    # stopped mid-step without writing (deadline or second signal)
STOP_FILE = "STOP"
REQUEUE_FILE = "requeue"
SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


class Stopped(Exception):
    """Raised out of the step loop once every rank has agreed to stop."""

    def __init__(self, step: int, reason: str, checkpoint: Optional[Path], seconds: float,
                 abandoned: bool = False):
        self.step, self.reason, self.checkpoint, self.seconds = step, reason, checkpoint, seconds
        self.abandoned = abandoned
        where = f"checkpoint {checkpoint}" if checkpoint else "no checkpoint (checkpoint.save " \
                                                              "is empty)"
        cut = f" (step {step + 1} abandoned, a resume redoes it)" if abandoned else ""
        super().__init__(f"stop requested ({reason}): stopped after step {step}{cut}, "
                         f"{where}, {seconds:.1f} s after the request")

    @property
    def exit_code(self) -> int:
        return REQUEUE_EXIT_CODE if self.checkpoint is not None else FORCED_EXIT_CODE


class StopRequest:
    """One per rank: records stop requests and agrees on them at safe points."""

    def __init__(self, save_folder: str = "", deadline_s: float = 90.0,
                 poll_seconds: float = 1.0, store=None):
        self.folder = Path(save_folder) if save_folder else None
        self.store = store  # shared with the other ranks (heartbeat.rendezvous_store)
        # one key per launch attempt (torchrun restarts reuse the store)
        self.shared_key = f"request/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"
        self._shared = False
        self.deadline_s = float(deadline_s)
        self.poll_seconds = poll_seconds
        self.reason: Optional[str] = None
        self.requested_at: Optional[float] = None
        self._previous: dict = {}
        self._timer: Optional[threading.Timer] = None
        # request() (signal handler, stop-file poll) against uninstall(): a deadline is
        # armed only while installed, so none can outlive uninstall() and end the
        # process later (reentrant: the signal handler runs on the main thread)
        self._lock = threading.RLock()
        self._poller: Optional[threading.Thread] = None
        self._done = threading.Event()
        self._exit_code: Optional[int] = None  # once stopped, a later signal exits with it

    @property
    def stop_file(self) -> Optional[Path]:
        return self.folder / STOP_FILE if self.folder is not None else None

    # ------------------------------------------------------------------ requests
    def install(self) -> "StopRequest":
        """Install the signal handlers (main thread) and start the stop-file poll."""
        for sig in SIGNALS:
            self._previous[sig] = signal.signal(sig, self._on_signal)
        if self.stop_file is not None or self.store is not None:
            self._poller = threading.Thread(target=self._poll, name="stop-file-poll",
                                            daemon=True)
            self._poller.start()
        return self

    def uninstall(self) -> None:
        with self._lock:
            self._done.set()
            if self._timer is not None:
                self._timer.cancel()
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}

    def _on_signal(self, signum, _frame) -> None:
        name = signal.Signals(signum).name
        if self._exit_code is not None:  # checkpoint written: torchrun stopping the rest
            os._exit(self._exit_code)
        if self.requested_at is not None:
            self._force(f"second stop request ({name})")
        self.request(name)

    def _poll(self) -> None:
        while not self._done.wait(self.poll_seconds):
            if self.requested_at is None and self.stop_file is not None \
                    and self.stop_file.exists():
                self.request(f"stop file {self.stop_file}")
            if self.store is None:
                continue
            try:
                if self.requested_at is not None and not self._shared:
                    self.store.set(self.shared_key, self.reason or "request")
                    self._shared = True
                elif self.requested_at is None and self.store.check([self.shared_key]):
                    self.request("a request on another rank")
                    self._shared = True
            except Exception:  # noqa: BLE001 - the store's host may be gone at the end
                pass

    def request(self, reason: str) -> None:
        """Record a request (idempotent) and arm the deadline."""
        with self._lock:
            if self.requested_at is not None:
                return
            self.reason, self.requested_at = reason, time.monotonic()
            print(f"stop requested ({reason}): ending the step in progress, then "
                  f"checkpoint and exit (at most {self.deadline_s:.0f} s, "
                  f"checkpoint.stop_deadline_s)", file=sys.stderr, flush=True)
            if self.deadline_s > 0 and not self._done.is_set():
                self._timer = threading.Timer(
                    self.deadline_s, self._force,
                    args=(f"checkpoint.stop_deadline_s={self.deadline_s:g} passed",))
                self._timer.daemon = True
                self._timer.start()

    def _force(self, why: str) -> None:
        print(f"error: {why}: exiting now without a checkpoint (exit code "
              f"{FORCED_EXIT_CODE}); the newest complete checkpoint stays the one a "
              f"resume loads", file=sys.stderr, flush=True)
        os._exit(FORCED_EXIT_CODE)

    # ------------------------------------------------------------------ the safe points
    def pending(self) -> bool:
        """Whether this rank has a request (no collective: cheap to poll in loops)."""
        return self.requested_at is not None

    def agreed(self) -> bool:
        """Whether any rank has a request; every rank must call it at the same point."""
        flag = collectives.max_values([1.0 if self.requested_at is not None else 0.0])[0]
        if flag and self.requested_at is None:  # another rank's request
            self.reason, self.requested_at = "a request on another rank", time.monotonic()
        return flag > 0

    def stop(self, step: int, checkpoint: Optional[Path], abandoned: bool = False) -> Stopped:
        """After the checkpoint: consume the stop file, write the requeue marker (rank
        0) and return the exception the loop raises."""
        seconds = time.monotonic() - (self.requested_at or time.monotonic())
        if collectives.rank() == 0 and self.folder is not None and checkpoint is not None:
            self.stop_file.unlink(missing_ok=True)
            write_text_atomic(self.folder / REQUEUE_FILE, json.dumps(
                {"step": step, "reason": self.reason, "checkpoint": str(checkpoint),
                 "exit_code": REQUEUE_EXIT_CODE}) + "\n")
        collectives.barrier()  # no rank exits (and has torchrun stop the others) before this
        self._done.set()
        if self._timer is not None:
            self._timer.cancel()
        stopped = Stopped(step, self.reason or "request", checkpoint, seconds, abandoned)
        self._exit_code = stopped.exit_code
        return stopped
