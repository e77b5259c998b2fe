"""Where the fused CPU kernels pay: a per-build calibration and the policy it gives.

The kernels (``cpu_kernels``) were tuned on one kind of CPU; on another they may be
slower than eager torch (an AVX2 CPU once ran them at 0.2-0.7x of eager ops). Nothing
slow may ship silently, so with ``rollout.cpu_kernels=auto`` (the default) the engine
uses a kernel family only at the batch sizes where it was measured faster on this
machine:

- the first time a build is used (per build folder and torch thread count), a short
  calibration (a few seconds) times each family against the eager torch path it
  replaces, at POINTS rows, on synthetic weights of SmolLM2-135M's layer shapes
  (enough layers that the weights stream from memory, as a real model's do):

  ``decode``  one decode step through ``ModelRunner.extend``: the fused decoder stack
              (``decode_layers``) against the eager layers;
  ``linear``  the LM head: the panel GEMM against torch's GEMM (also the general path's
              matrix products, e.g. tree verification);
  ``argmax``  greedy token choice: ``argmax_rows`` against ``torch.argmax``;

  each measurement is a pair (kernel and eager run back to back, the order alternating;
  a side is the fastest of enough calls to last ~4 ms), repeated in rounds over all
  cases (MIN_ROUNDS, then more up to REPEATS while under BUDGET_S seconds); a family
  wins at a point when eager time / kernel time, each the fastest over the rounds
  (other work on the machine only ever adds time, so the fastest run is the steadiest
  estimate of what the code costs), exceeds 1 + MARGIN: a near-tie goes to eager torch
  (the record keeps the median of the paired ratios too);
- the decision is stored as ``calibration-<threads>t.json`` next to the build and read
  back by every later engine (no re-measuring, so it is stable); delete the file, or
  run ``python -m megatron_tlt.rollout.kernel_policy --recalibrate``, to measure again.
  A calibration measured while other work loaded the machine (more than half of its
  cores busy in a 0.3 s sample of /proc/stat just before) is provisional: used, and
  replaced by the first engine that starts while the machine is not busy;
- a batch size between two calibrated points uses a kernel only when both points
  chose it; above the last point (MAX_FUSED_ROWS) eager ops always run.

``rollout.cpu_kernels=true`` uses the kernels at every size they support (no
calibration), ``false`` never. ``python -m megatron_tlt.rollout.kernel_policy``
prints (``--recalibrate``: re-measures) the stored decision of this machine's build.
"""

from __future__ import annotations

import json
import logging
import os
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import torch

from ..fileio import write_text_atomic
from .cpu_kernels import MAX_FUSED_ROWS

log = logging.getLogger(__name__)

FAMILIES = ("decode", "linear", "argmax")
POINTS = (1, 2, 4, 8, 16, 32, 64)  # rows calibrated (the last one is MAX_FUSED_ROWS)
REPEATS = 7
MIN_ROUNDS = 3  # rounds that always run, whatever the budget
MARGIN = 0.05
BUDGET_S = 8.0  # no round beyond MIN_ROUNDS starts after this many seconds
VERSION = 2  # of the calibration procedure: records of another version are re-measured
# SmolLM2-135M's shapes: hidden, KV groups, query heads per group, head dim, fc1 rows / 2,
# vocabulary (tied embedding and LM head: 113 MB); CAL_LAYERS layers (57 MB of weights:
# more than most CPUs' last-level cache slice) and a context of CAL_CONTEXT positions
SHAPES = dict(hidden=576, groups=3, heads_per_group=3, head_dim=64, ffn=1536, vocab=49152)
CAL_LAYERS = 4
CAL_CONTEXT = 128


@dataclass(frozen=True)
class KernelPolicy:
    """Per kernel family, whether the kernels run at each calibrated row count."""

    points: tuple[int, ...]
    use: dict = field(default_factory=dict)  # family -> tuple[bool, ...] (per point)
    source: str = ""

    def allows(self, family: str, rows: int) -> bool:
        """Kernels for ``rows`` rows of ``family``: at a calibrated point as measured,
        between two points only if both chose the kernels."""
        flags = self.use.get(family)
        if flags is None or rows < 1 or rows > self.points[-1]:
            return False
        for i, p in enumerate(self.points):
            if rows == p:
                return flags[i]
            if rows < p:
                return flags[i] and (i == 0 or flags[i - 1])
        return False

    def max_rows(self, family: str) -> int:
        """The largest r such that 1..r rows all use the kernels (0: none)."""
        flags = self.use.get(family)
        if not flags or not flags[0] or self.points[0] != 1:
            return 0
        best = self.points[0]
        for i in range(1, len(self.points)):
            if not flags[i]:
                break
            best = self.points[i]
        return best

    def any(self) -> bool:
        return any(any(f) for f in self.use.values())

    def ranges(self, family: str) -> list[tuple[int, int]]:
        """Row ranges (inclusive) where ``family`` uses the kernels."""
        out: list[tuple[int, int]] = []
        for rows in range(1, self.points[-1] + 1):
            if self.allows(family, rows):
                if out and out[-1][1] == rows - 1:
                    out[-1] = (out[-1][0], rows)
                else:
                    out.append((rows, rows))
        return out

    def describe(self) -> str:
        parts = []
        for fam in FAMILIES:
            rs = self.ranges(fam)
            txt = ", ".join(f"{a}" if a == b else f"{a}-{b}" for a, b in rs) or "none"
            parts.append(f"{fam} rows {txt}")
        return "; ".join(parts)

    @classmethod
    def from_json(cls, data: dict, source: str = "") -> "KernelPolicy":
        pts = tuple(int(p) for p in data["points"])
        use = {f: tuple(bool(u) for u in data["families"][f]["use"]) for f in FAMILIES}
        if any(len(u) != len(pts) for u in use.values()):
            raise ValueError("calibration: one decision per point expected")
        return cls(points=pts, use=use, source=source)


ALWAYS = KernelPolicy(points=(1, MAX_FUSED_ROWS), use={f: (True, True) for f in FAMILIES},
                      source="rollout.cpu_kernels=true")


class PolicyKernels:
    """A built kernel module with the policy saying where it pays (what the engine sets
    as ``ModelRunner.kernels``); attributes other than ``policy`` are the module's."""

    def __init__(self, module, policy: KernelPolicy):
        self.module = module
        self.policy = policy

    def __getattr__(self, name):
        return getattr(self.module, name)

    def __repr__(self) -> str:
        return f"PolicyKernels({getattr(self.module, 'ISA', '?')}: {self.policy.describe()})"


# ------------------------------------------------------------------------- calibration
def _synthetic_runner(layers: int, seed: int, s: dict):
    from .forward import ModelRunner, _Layer

    g = torch.Generator().manual_seed(seed)
    h, f = s["hidden"], s["ffn"]
    nqkv = s["groups"] * (s["heads_per_group"] + 2) * s["head_dim"]
    natt = s["groups"] * s["heads_per_group"] * s["head_dim"]

    def mat(n, k):
        return torch.randn(n, k, generator=g) * k ** -0.5

    ls = [_Layer(ln1=torch.ones(h), qkv_w=mat(nqkv, h), qkv_b=None, proj_w=mat(h, natt),
                 ln2=torch.ones(h), fc1_w=mat(2 * f, h), fc2_w=mat(h, f))
          for _ in range(layers)]
    embed = mat(s["vocab"], h)  # tied with the LM head, as in SmolLM2
    return ModelRunner.from_tensors(
        embed_w=embed, layers=ls, final_norm=torch.ones(h), output_w=embed,
        groups=s["groups"], heads_per_group=s["heads_per_group"])


def _timed(fn, calls: int) -> float:
    """Seconds of one call of ``fn``: the fastest of ``calls`` (a preemption by other
    work on the machine only ever adds time)."""
    best = float("inf")
    for _ in range(calls):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def _pair(run_kernel, run_eager, calls: int, kernel_first: bool) -> tuple[float, float]:
    """(kernel, eager) seconds measured back to back, in the given order."""
    if kernel_first:
        k = _timed(run_kernel, calls)
        return k, _timed(run_eager, calls)
    e = _timed(run_eager, calls)
    return _timed(run_kernel, calls), e


def _cpu_times() -> Optional[tuple[int, int]]:
    """(busy, total) CPU jiffies of the whole machine from /proc/stat (None elsewhere)."""
    try:
        with open("/proc/stat") as fh:
            vals = [int(v) for v in fh.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    idle = vals[3] + (vals[4] if len(vals) > 4 else 0)  # idle + iowait
    total = sum(vals[:8])  # guest time is counted in user already
    return total - idle, total


def _load(sample_s: float = 0.3) -> float:
    """How busy the machine is now, in cores: the CPU time other work used over a short
    sample while this process waits (1-minute load average where /proc/stat is
    missing)."""
    a = _cpu_times()
    if a is None:
        try:
            return os.getloadavg()[0]
        except (AttributeError, OSError):
            return 0.0
    time.sleep(sample_s)
    b = _cpu_times()
    if b is None or b[1] <= a[1]:
        return 0.0
    return (b[0] - a[0]) / (b[1] - a[1]) * (os.cpu_count() or 1)


def _busy(load: float) -> bool:
    """Other work competes for the cores (it kept more than half of them busy)."""
    return load > 0.5 * (os.cpu_count() or 1)


def calibrate(module, *, points=POINTS, repeats: int = REPEATS, margin: float = MARGIN,
              layers: int = CAL_LAYERS, context: int = CAL_CONTEXT, seed: int = 0,
              budget_s: float = BUDGET_S, shapes: Optional[dict] = None) -> dict:
    """Time each kernel family of ``module`` against the eager path (see the module
    docstring); returns the calibration record (JSON-able). Rounds over all cases
    repeat up to ``repeats`` times while less than ``budget_s`` seconds have passed."""
    from .cpu_kernels import cpu_model, openmp_runtimes
    from .forward import _linear
    from .kv_cache import KVCache

    t_start = time.perf_counter()
    load_before = _load()
    points = tuple(p for p in points if p <= MAX_FUSED_ROWS)
    s = dict(SHAPES if shapes is None else shapes)
    runner = _synthetic_runner(layers, seed, s)
    kern = PolicyKernels(module, ALWAYS)
    cache = KVCache(num_layers=layers, max_batch=max(points), kv_heads=s["groups"],
                    capacity=context + 1, head_dim=s["head_dim"], dtype=torch.float32,
                    device=torch.device("cpu"))
    g = torch.Generator().manual_seed(seed + 1)
    cache.k.normal_(generator=g)
    cache.v.normal_(generator=g)
    runner.kernels = kern
    runner.pack_weights()
    head = runner._panel(runner.output_w)
    vocab, hidden = s["vocab"], s["hidden"]

    def decode(b):
        tok = torch.randint(0, vocab, (b, 1), generator=g)
        start = torch.full((b,), context, dtype=torch.long)

        def fused():
            runner.kernels = kern
            runner.extend(cache, slice(0, b), tok, start)

        def eager():
            runner.kernels = None
            runner.extend(cache, slice(0, b), tok, start)
        return fused, eager

    def linear(b):
        x = torch.randn(b, hidden, generator=g)
        return (lambda: module.linear(x, head, vocab)), (lambda: _linear(x, runner.output_w))

    def argmax(b):
        x = torch.randn(b, vocab, generator=g)
        return (lambda: module.argmax_rows(x, vocab)), (lambda: torch.argmax(x, dim=-1))

    makers = {"decode": decode, "linear": linear, "argmax": argmax}
    cases = {(fam, b): makers[fam](b) for fam in FAMILIES for b in points}
    times = {key: ([], []) for key in cases}
    calls = {}
    with torch.no_grad():
        for key, (fn_k, fn_e) in cases.items():  # warm-up: first touches, lazy inits
            fn_k()
            fn_e()
            # cheap cases repeat within a measurement (~4 ms a side, the fastest call
            # counts): one preemption then cannot decide them
            calls[key] = max(1, min(20, int(4e-3 / max(1e-6, min(_timed(fn_k, 1),
                                                                 _timed(fn_e, 1))))))
        # rounds over every case, so slow drifts of the machine spread over all of them
        rounds = 0
        for r in range(repeats):
            if r >= MIN_ROUNDS and time.perf_counter() - t_start > budget_s:
                break
            rounds += 1
            for i, (key, (fn_k, fn_e)) in enumerate(cases.items()):
                kt, et = _pair(fn_k, fn_e, calls[key], (r + i) % 2 == 0)
                times[key][0].append(kt)
                times[key][1].append(et)
    runner.kernels = None
    families = {}
    for fam in FAMILIES:
        rec = {"kernel_ms": [], "eager_ms": [], "speedup": [], "median_speedup": [],
               "use": []}
        for b in points:
            kt, et = times[(fam, b)]
            ratio = min(et) / min(kt)
            rec["kernel_ms"].append(round(min(kt) * 1e3, 4))
            rec["eager_ms"].append(round(min(et) * 1e3, 4))
            rec["speedup"].append(round(ratio, 3))
            rec["median_speedup"].append(
                round(statistics.median(e / k for k, e in zip(kt, et)), 3))
            rec["use"].append(ratio > 1.0 + margin)
        families[fam] = rec
    load = load_before
    return dict(version=VERSION, isa=getattr(module, "ISA", "?"), cpu=cpu_model(),
                torch=torch.__version__, threads=torch.get_num_threads(),
                cpus=os.cpu_count(), load_average=round(load, 2), busy=_busy(load),
                openmp_runtimes=openmp_runtimes(), points=list(points), rounds=rounds,
                margin=margin, layers=layers, context=context, shapes=s,
                date=time.strftime("%Y-%m-%d %H:%M:%S"),
                seconds=round(time.perf_counter() - t_start, 2), families=families)


def calibration_path(module) -> Path:
    """Where ``module``'s calibration lives: next to its build, per torch thread count."""
    return Path(module.__file__).resolve().parent / \
        f"calibration-{torch.get_num_threads()}t.json"


_policies: dict[str, KernelPolicy] = {}  # calibration path -> policy (said once each)


def _read(path: Path) -> Optional[dict]:
    """A stored calibration, or None when there is none, it is malformed or of another
    version, or it was measured on a busy machine and this one is not busy now."""
    try:
        data = json.loads(path.read_text())
        if data.get("version") == VERSION:
            KernelPolicy.from_json(data)  # well-formed
            if data.get("busy") and not _busy(_load()):
                return None  # provisional: measure again now that the cores are free
            return data
    except (OSError, ValueError, KeyError, TypeError):
        pass
    return None


def measured_policy(module, *, recalibrate: bool = False) -> KernelPolicy:
    """The calibrated policy of ``module``'s build: read from its calibration file, or
    measured now (a few seconds, once per build and thread count; concurrent processes
    wait for the first one's file) and stored. The decision is logged once per
    process."""
    path = calibration_path(module)
    if not recalibrate and str(path) in _policies:
        return _policies[str(path)]
    data = None if recalibrate else _read(path)
    measured = False
    if data is None:
        lock = path.with_suffix(".lock")
        with open(lock, "w") as fh:
            try:
                import fcntl

                fcntl.flock(fh, fcntl.LOCK_EX)
            except (ImportError, OSError):
                pass
            data = None if recalibrate else _read(path)  # another process may have won
            if data is None:
                print(f"[kernels] calibrating the {getattr(module, 'ISA', '')} CPU kernels "
                      "against eager torch ops (once per build, a few seconds)",
                      file=sys.stderr, flush=True)
                data = calibrate(module)
                write_text_atomic(path, json.dumps(data, indent=1))
                measured = True
    policy = KernelPolicy.from_json(data, source=str(path))
    _policies[str(path)] = policy
    _say(policy, data, measured)
    return policy


def _say(policy: KernelPolicy, data: dict, measured: bool) -> None:
    where = "measured" if measured else "calibrated"
    speed = ", ".join(
        f"{fam} " + "/".join(f"{x:.2f}" for x in data["families"][fam]["speedup"])
        for fam in FAMILIES)
    busy = (f"; measured on a busy machine (load {data.get('load_average')}): "
            "provisional, re-measured when the cores are free" if data.get("busy") else "")
    msg = (f"[kernels] {data.get('isa')} CPU kernels ({where}, {data.get('cpu')}, "
           f"{data.get('threads')} threads): fused {policy.describe()}; eager torch "
           f"elsewhere. Speed-ups over eager at rows {'/'.join(map(str, data['points']))}: "
           f"{speed} ({policy.source}{busy})")
    log.info(msg)
    print(msg, file=sys.stderr, flush=True)


# A policy that ``auto`` uses instead of the calibration (the test suite pins one so
# that which code paths its tests take never depends on timings).
pinned: Optional[KernelPolicy] = None


def resolve(mode: str, module) -> Optional[PolicyKernels]:
    """What ``rollout.cpu_kernels=mode`` gives the engine for a built ``module``: the
    module with its policy, or None (eager torch ops everywhere)."""
    if module is None or mode == "false":
        return None
    if mode == "true":
        return PolicyKernels(module, ALWAYS)
    try:
        policy = pinned if pinned is not None else measured_policy(module)
    except Exception as e:  # a failed measurement must not stop the engine
        log.warning("CPU kernel calibration failed (%s); using eager torch ops", e)
        return None
    return PolicyKernels(module, policy) if policy.any() else None


def main(argv=None) -> None:
    import argparse

    from . import cpu_kernels

    ap = argparse.ArgumentParser(description="Show (or re-measure) where this machine's "
                                             "CPU kernel build beats eager torch ops.")
    ap.add_argument("--isa", default=None, help="avx512 | avx2 | portable (default: best)")
    ap.add_argument("--recalibrate", action="store_true")
    args = ap.parse_args(argv)
    module = cpu_kernels.get(args.isa)
    if module is None:
        raise SystemExit("the CPU kernels are not available here")
    measured_policy(module, recalibrate=args.recalibrate)
    print(calibration_path(module).read_text())


if __name__ == "__main__":
    main()
