"""The planner's inputs: per-step cost tables, response lengths, acceptance, hardware.

Everything here is data with its provenance (``source``): a table measured by one of
the project's benchmarks, or a roofline model marked ``modelled``. The measured tables
travel with the package (``planner/data/``, their one copy); ``use_calibration`` puts a
folder of one's own first. The simulator (``sim.py``) only asks the questions below.

- ``StepCost``: seconds of one decode step of one rollout engine at a running batch
  ``b`` with ``ctx`` resident KV tokens, and of a speculative step of depth ``k``
  (draft + verify) relative to it; prefill seconds per prompt token.
- ``LengthModel``: response lengths, drawn with a seeded generator.
- ``Acceptance``: the drafter's per-depth acceptance (alpha_j, conditional: the j-th
  draft token is accepted given the ones before it were), as a function of the
  tokens the drafter was trained on.
- ``Hardware`` and ``RooflineCost``: bandwidth, FLOPs and a launch floor; for a
  mixture-of-experts model the weights a forward streams are the dense part and the
  experts its tokens touch (``ModelShape.streamed``, ``distinct_experts``).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, replace
from importlib import resources
from pathlib import Path
from typing import Optional, Sequence

import numpy as np

from .experts import distinct_experts, moe_fields

_calibration: Optional[Path] = None  # use_calibration's folder, read before the shipped one
NOISY_STEP_OVER_FLOOR = 2.0  # a bench_rollout row whose median step is > 2x its floor
# (the step's own lower bound, measured beside it) was taken on a busy machine: dropped


def _interp_log(x: float, xs: Sequence[float], ys: Sequence[float]) -> float:
    """Piecewise-linear in log(x) through (xs, ys), linear in x past the last point
    (one point: constant)."""
    xs, ys = list(xs), list(ys)
    if len(xs) == 1 or x <= xs[0]:
        return ys[0]
    if x >= xs[-1]:  # beyond the table: extend the last segment's slope in x
        slope = (ys[-1] - ys[-2]) / (xs[-1] - xs[-2])
        return ys[-1] + max(slope, 0.0) * (x - xs[-1])
    return float(np.interp(math.log(x), np.log(xs), ys))


# ---------------------------------------------------------------------- step costs
@dataclass
class StepCost:
    """A rollout engine's step times from measured points.

    plain(b, ctx) = table(b) + kv_seconds_per_token x (ctx - b x ref_ctx), where
    table(b) is the measured plain step at ``batches`` (interpolated in log b) with
    each row holding ``ref_ctx`` resident tokens; spec(b, k, ctx) = plain(b, ctx) x
    relative(b, k), relative = 1 + k x slope(b) from measured speculative steps
    (bench_spec: relative = accept_len / speedup, drafting included)."""

    batches: tuple
    seconds: tuple
    ref_ctx: float = 128.0
    kv_seconds_per_token: float = 0.0
    spec_batches: tuple = (1,)
    spec_slope: tuple = (0.15,)  # relative cost added per draft token
    prefill_seconds_per_token: float = 0.0
    scale: float = 1.0  # bandwidth sensitivity: 1 / (1 +- 0.15) on the whole step
    source: str = ""
    modelled: bool = False

    def plain(self, b: int, ctx: float) -> float:
        base = _interp_log(b, self.batches, self.seconds)
        kv = self.kv_seconds_per_token * max(ctx - b * self.ref_ctx, -0.5 * b * self.ref_ctx)
        return self.scale * max(base + kv, 0.5 * base)

    def relative(self, b: int, k: int) -> float:
        if k <= 0:
            return 1.0
        return 1.0 + k * _interp_log(b, self.spec_batches, self.spec_slope)

    def spec(self, b: int, k: int, ctx: float) -> float:
        return self.plain(b, ctx) * self.relative(b, k)

    def prefill(self, tokens: float) -> float:
        return self.scale * self.prefill_seconds_per_token * tokens

    def scaled(self, factor: float) -> "StepCost":
        return replace(self, scale=self.scale * factor)


@dataclass(frozen=True)
class Hardware:
    """One accelerator, for the roofline (``modelled``: datasheet figures with an
    achievable fraction, not a measurement of ours)."""

    name: str
    hbm_bytes_per_s: float
    bf16_flops: float
    link_bytes_per_s: float  # NVLink per direction, for TP all-reduces
    launch_floor_s: float  # per decode forward (CUDA graphs), fixed
    per_layer_floor_s: float  # per layer and forward (kernel launches, syncs)
    bw_efficiency: float = 0.8
    mfu_decode: float = 0.6  # large-batch decode / verify compute efficiency
    mfu_train: float = 0.35  # training and log-prob forwards (modelled)
    allreduce_latency_s: float = 10e-6
    memory_gib: float = 80.0


HARDWARE = {
    # SXM datasheets: H100 3.35 TB/s HBM3, 989 TFLOPS dense bf16, NVLink4 450 GB/s per
    # direction; H200 4.8 TB/s HBM3e, same compute. Floors: a decode forward replayed
    # as a CUDA graph (~10 us per layer of launch gaps and small kernels) plus ~0.3 ms
    # of sampling and host work per step; both modelled.
    "h100": Hardware("H100 SXM (modelled)", 3.35e12, 989e12, 450e9, 3e-4, 1.0e-5),
    "h200": Hardware("H200 SXM (modelled)", 4.8e12, 989e12, 450e9, 3e-4, 1.0e-5,
                     memory_gib=141.0),
}


@dataclass(frozen=True)
class ModelShape:
    """What the roofline needs of a model. A mixture-of-experts model also gives its
    ``experts`` per MoE layer, ``topk`` chosen per token and ``expert_params`` (one
    expert's parameters summed over the MoE layers); ``params`` counts every expert,
    ``draft_layer`` the one-layer drafter's decoder layer (0: params / layers, a dense
    target's layer)."""

    params: float
    layers: int
    hidden: int
    kv_dim: int  # kv heads x head dim
    vocab: int
    bytes_per_param: float = 2.0
    experts: int = 0
    topk: int = 0
    expert_params: float = 0.0
    draft_layer: float = 0.0

    @property
    def kv_bytes_per_token(self) -> float:
        return 2 * self.layers * self.kv_dim * self.bytes_per_param

    @property
    def dense_params(self) -> float:
        """Parameters every token multiplies by (all but the experts)."""
        return self.params - self.experts * self.expert_params

    @property
    def active_params(self) -> float:
        """Parameters one token's forward multiplies by: the dense part and its top-k
        experts (all of a dense model's)."""
        return self.dense_params + self.topk * self.expert_params

    def streamed(self, tokens: float, ep: int = 1) -> float:
        """Parameters one rank of an expert-parallel group of ``ep`` reads in a forward
        over ``tokens`` tokens of the group: the dense part, and its share of the
        experts they touch (``distinct_experts``; every expert of a dense model)."""
        if not self.experts:
            return self.params
        touched = distinct_experts(self.experts, self.topk, tokens)
        return self.dense_params + touched / max(ep, 1) * self.expert_params

    @classmethod
    def from_arch(cls, arch, bytes_per_param: float = 2.0) -> "ModelShape":
        return cls(float(arch.num_parameters), arch.num_layers, arch.hidden_size,
                   arch.num_query_groups * arch.kv_channels, arch.vocab_size,
                   bytes_per_param, **moe_fields(arch))


@dataclass
class RooflineCost(StepCost):
    """Step times of a TP group from the roofline: a forward over ``rows`` x ``t`` new
    tokens streams the weights once and the resident KV cache, computes
    2 x params FLOPs per token, and pays a launch floor and 2 all-reduces per layer at
    TP > 1. A depth-k speculative step is one verify forward over k+1 tokens per row
    plus k drafter forwards (``draft_fraction`` of the target's weights and a
    one-layer floor each).

    Mixture of experts (docs/planning.md): the forward streams the dense part and the
    experts its tokens touch (``ModelShape.streamed``) and computes 2 x active
    parameters per token. At expert parallelism ``ep`` a rank's ``rows`` stand for
    ep x rows rows of the EP group, which decodes together: every rank runs their dense
    part and KV cache, and its own 1/ep of the experts, all-reduced over TP x EP."""

    hw: Optional[Hardware] = None
    model: Optional[ModelShape] = None
    tp: int = 1
    draft_fraction: float = 0.05  # drafter weights (one layer + fc + LM head) / target
    ep: int = 1
    draft_layers: int = 1  # the drafter's layers (the self-drafter: all, its own cache)

    def forward(self, rows: int, t: int, ctx: float, weights_frac: float = 1.0,
                layers: Optional[int] = None, floor: Optional[float] = None) -> float:
        """A forward of ``rows`` x ``t`` tokens over ``ctx`` resident KV tokens: the
        target's (``weights_frac`` 1) or a drafter's (a dense fraction of the target's
        parameters, ``layers`` layers)."""
        hw, m, tp = self.hw, self.model, self.tp
        layers = m.layers if layers is None else layers
        target = weights_frac == 1.0 and m.experts > 0
        g = self.ep if target else 1  # rows of the EP group per rank's row
        tokens = rows * t * g
        if target:
            weights = m.streamed(tokens, self.ep)
            flops_w = 2 * (m.dense_params * tokens + m.topk * m.expert_params * rows * t)
        else:
            weights = weights_frac * m.params
            flops_w = 2 * weights * rows * t
        bytes_ = (weights * m.bytes_per_param
                  + g * ctx * m.kv_bytes_per_token * (layers / m.layers)) / tp
        flops = flops_w / tp + 4 * layers * m.hidden * g * ctx * t / tp
        mem = bytes_ / (hw.hbm_bytes_per_s * hw.bw_efficiency)
        comp = flops / (hw.bf16_flops * hw.mfu_decode)
        comm = 0.0
        group = tp * g
        if group > 1:
            msg = tokens * m.hidden * 2
            ring = lambda n: 0.0 if n <= 1 else (hw.allreduce_latency_s  # noqa: E731
                                                 + msg * 2 * (n - 1) / n / hw.link_bytes_per_s)
            comm = layers * (ring(tp) + ring(group))
        floor = hw.launch_floor_s if floor is None else floor
        return self.scale * (max(mem, comp) + comm) + floor + layers * hw.per_layer_floor_s

    def plain(self, b: int, ctx: float) -> float:
        return self.forward(b, 1, ctx)

    def spec(self, b: int, k: int, ctx: float) -> float:
        if k <= 0:
            return self.plain(b, ctx)
        # drafter forwards: one layer, its own small KV cache, no sampling floor
        dl = self.draft_layers
        draft = k * self.forward(b, 1, ctx if dl > 1 else 0.0, self.draft_fraction,
                                 layers=dl, floor=3e-5)
        return self.forward(b, k + 1, ctx) + draft

    def relative(self, b: int, k: int) -> float:
        ctx = b * self.ref_ctx
        return self.spec(b, k, ctx) / self.plain(b, ctx)

    def prefill(self, tokens: float) -> float:
        m, hw = self.model, self.hw
        return self.scale * 2 * m.active_params * tokens / self.tp / (hw.bf16_flops
                                                                      * hw.mfu_train)

    def train_seconds_per_token(self, gpus: int, passes: float = 3.0) -> float:
        """A forward (passes=1) or forward + backward (3) per token over ``gpus`` (an
        MoE model's active parameters)."""
        return passes * 2 * self.model.active_params / (gpus * self.hw.bf16_flops
                                                        * self.hw.mfu_train)


def roofline(hw: str, model: ModelShape, tp: int, *, ref_ctx: float = 1024.0,
             draft_fraction: Optional[float] = None, ep: int = 1) -> RooflineCost:
    h = HARDWARE[hw]
    if draft_fraction is None:  # one decoder layer + fc (2H x H) + the LM head
        layer = model.draft_layer or model.params / max(model.layers, 1)
        draft_fraction = min(1.0, (layer + 2 * model.hidden ** 2
                                   + model.vocab * model.hidden) / model.params)
    where = f"TP {tp}" + (f" x EP {ep}" if ep > 1 else "")
    moe = (f", {model.experts} experts top-{model.topk}: {model.active_params / 1e9:.2f}B "
           "active, the experts touched streamed" if model.experts else "")
    return RooflineCost(batches=(1,), seconds=(0.0,), ref_ctx=ref_ctx, hw=h, model=model,
                        tp=tp, draft_fraction=draft_fraction, ep=ep, modelled=True,
                        source=f"roofline: {h.name}, {where}{moe} (modelled)")


# ---------------------------------------------------------------------- measured tables
def shipped_tables() -> list[str]:
    """The names of the measured tables shipped in ``megatron_tlt/planner/data/``."""
    folder = resources.files(__package__).joinpath("data")
    return sorted(p.name for p in folder.iterdir() if p.name.endswith(".json"))


def use_calibration(folder: Optional[str | Path]) -> list[str]:
    """Read the measured tables from ``folder`` before the shipped ones (the same file
    names, e.g. the benchmarks re-run on one's own machine); None: the shipped tables
    only. Returns the table names ``folder`` provides; a folder that does not exist or
    holds none of them is refused (a wrong path would otherwise change nothing)."""
    global _calibration
    if folder is None:
        _calibration = None
        return []
    path = Path(folder).expanduser()
    if not path.is_dir():
        raise ValueError(f"calibration folder {path}: not a directory (give a folder "
                         "holding measured tables named as in megatron_tlt/planner/data/)")
    names = [n for n in shipped_tables() if (path / n).is_file()]
    if not names:
        raise ValueError(f"calibration folder {path}: none of the planner's tables in it; "
                         f"it reads {', '.join(shipped_tables())} (a table the folder "
                         "lacks is taken from the shipped ones)")
    _calibration = path
    return names


def calibration_file(name: str):
    """A measured table by name: ``use_calibration``'s folder first, then the package's
    shipped copy (``megatron_tlt/planner/data/``)."""
    if _calibration is not None and (_calibration / name).is_file():
        return _calibration / name
    shipped = resources.files(__package__).joinpath("data", name)
    if shipped.is_file():
        return shipped
    raise FileNotFoundError(
        f"planner table {name}: not in megatron_tlt/planner/data/"
        + (f" nor in the calibration folder {_calibration}" if _calibration else "")
        + " (reinstall megatron_tlt with its package data, or give a folder that holds "
        "it with tools/plan_tlt.py --calibration DIR)")


def has_calibration(name: str) -> bool:
    try:
        calibration_file(name)
    except FileNotFoundError:
        return False
    return True


def results_file(name: str, results: Path):
    """A measured run the validation predicts: in the folder ``results`` (plan_tlt.py
    --validate --results), else the package's shipped copy (``planner/data/``)."""
    path = Path(results).expanduser() / name
    if path.is_file():
        return path
    shipped = resources.files(__package__).joinpath("data", name)
    if shipped.is_file():
        return shipped
    raise FileNotFoundError(
        f"{path}: not found. The validation (tools/plan_tlt.py --validate) predicts the "
        "repository's measured runs in docs/results/, which an installed package does "
        "not carry: run it from a clone, or give their folder with --results DIR")


def load_table(name: str) -> dict:
    """The measured table ``name`` (``calibration_file``), parsed."""
    return json.loads(calibration_file(name).read_text())


def load_json(name: str | Path) -> dict:
    """A JSON file given by the user: ``name`` as a path where one exists, else the
    measured table of that name."""
    path = Path(name)
    if path.is_file():
        return json.loads(path.read_text())
    if path.is_absolute() or len(path.parts) > 1:
        raise FileNotFoundError(f"{path}: no such file")
    return load_table(path.name)


def cpu_of(doc: dict) -> str:
    c = doc.get("config", {})
    return f"{c.get('cpu', '?')} ({c.get('cpu_best_isa', '?')}, kernels {c.get('kernel_isa', '-')})"


def table_from_bench_rollout(doc: dict, *, thread_factor: Sequence[float] = (1.0,),
                             spec_doc: Optional[dict] = None, kv_seconds_per_token: float = 0.0,
                             prefill_seconds_per_token: float = 0.0,
                             note: str = "") -> StepCost:
    """A ``StepCost`` from a ``tools/bench_rollout.py`` JSON (``results[].batch`` /
    ``engine_step_ms``, each row ``config.new_tokens`` long) and, optionally, the
    speculative step costs of a ``tools/bench_spec.py`` JSON. ``thread_factor`` (one
    value, or one per batch) converts the table's thread count to the engine's."""
    rows = sorted((r for r in doc["results"]
                   if r.get("step_over_floor", 1.0) <= NOISY_STEP_OVER_FLOOR),
                  key=lambda r: r["batch"])
    factors = list(thread_factor) * (len(rows) if len(thread_factor) == 1 else 1)
    secs = tuple(r["engine_step_ms"] / 1000 * f for r, f in zip(rows, factors))
    sb, ss = spec_slopes(spec_doc) if spec_doc else ((1,), (0.3,))
    ctx = float(doc["config"].get("new_tokens", 128)) / 2 + 32  # mean resident context
    src = (f"bench_rollout {doc.get('date', '')} on {cpu_of(doc)}, "
           f"{doc['config'].get('threads', '?')} threads")
    if spec_doc:  # step costs only: a timing-only (random-weight) run serves as well
        src += (f"; speculative costs from bench_spec on {cpu_of(spec_doc)}"
                + (" (timing only: its acceptance unused)" if spec_doc.get("timing_only")
                   else ""))
    return StepCost(tuple(r["batch"] for r in rows), secs, ref_ctx=ctx,
                    kv_seconds_per_token=kv_seconds_per_token, spec_batches=sb,
                    spec_slope=ss, prefill_seconds_per_token=prefill_seconds_per_token,
                    source=src + (f"; {note}" if note else ""))


def spec_slopes(doc: dict) -> tuple[tuple, tuple]:
    """Per batch size, the relative cost a draft token adds to a step: from each fixed-
    strategy row of a bench_spec JSON, (accept_len / speedup - 1) / depth."""
    out: dict[int, list[float]] = {}
    for r in doc["results"]:
        k = int(str(r["strategy"]).split("_")[0])
        if r.get("speedup") and r.get("accept_len") and k > 0:
            rel = r["accept_len"] / r["speedup"]
            out.setdefault(int(r["batch"]), []).append(max(rel - 1.0, 0.0) / k)
    bs = sorted(out)
    return tuple(bs), tuple(float(np.median(out[b])) for b in bs)


# ---------------------------------------------------------------------- lengths
@dataclass
class LengthModel:
    """Response lengths: an empirical sample (drawn with replacement) or a log-normal
    (median, sigma) with ``cap_fraction`` of responses at the cap."""

    cap: int
    median: float = 0.0
    sigma: float = 1.0
    cap_fraction: float = 0.0
    sample: tuple = ()
    source: str = ""

    def draw(self, n: int, rng: np.random.Generator) -> np.ndarray:
        if self.sample:
            out = rng.choice(np.asarray(self.sample, dtype=float), size=n, replace=True)
        else:
            out = self.median * np.exp(self.sigma * rng.standard_normal(n))
            out[rng.random(n) < self.cap_fraction] = self.cap
        return np.clip(np.round(out), 1, self.cap)

    @classmethod
    def from_summary(cls, *, mean: float, p50: float, cap: int, truncated: float = 0.0,
                     source: str = "") -> "LengthModel":
        """A log-normal whose median is ``p50`` and whose mean (with the capped share
        at ``cap``) is ``mean``: sigma solved on a grid."""
        p50 = max(p50, 1.0)
        best, best_err = 0.5, float("inf")
        z = np.random.default_rng(0).standard_normal(4096)
        for s in np.linspace(0.05, 2.5, 50):
            body = np.minimum(p50 * np.exp(s * z), cap).mean()
            err = abs(truncated * cap + (1 - truncated) * body - mean)
            if err < best_err:
                best, best_err = float(s), err
        return cls(cap=cap, median=p50, sigma=best, cap_fraction=truncated, source=source)


def lengths_from_metrics(path: str | Path, steps: Optional[Sequence[int]] = None,
                         cap: Optional[int] = None) -> LengthModel:
    """Pool the per-step length summaries of a run's metrics.jsonl (median of p50,
    mean, truncated fraction) into one ``LengthModel``."""
    rows = [json.loads(x) for x in Path(path).read_text().splitlines() if x.strip()]
    rows = [r for r in rows if "response_length/mean" in r
            and (steps is None or r["step"] in steps)]
    if not rows:
        raise ValueError(f"{path}: no response_length/* metrics")
    cap = cap or max(int(r["response_length/max"]) for r in rows)
    return LengthModel.from_summary(
        mean=float(np.mean([r["response_length/mean"] for r in rows])),
        p50=float(np.median([r["response_length/p50"] for r in rows])), cap=cap,
        truncated=float(np.mean([r.get("truncated_fraction", 0.0) for r in rows])),
        source=f"{Path(path).name}: {len(rows)} steps' length summaries")


def lengths_from_workload(path: str | Path) -> LengthModel:
    """An empirical ``LengthModel`` from ``tools/workload_lengths.py --json``."""
    doc = json.loads(Path(path).read_text())
    lens = [int(r["length"]) for r in doc.get("records", []) if "length" in r]
    if not lens:
        raise ValueError(f"{path}: no records[].length (tools/workload_lengths.py --json)")
    cap = int(doc.get("max_new_tokens", max(lens)))
    return LengthModel(cap=cap, sample=tuple(lens), source=f"{Path(path).name}")


# ---------------------------------------------------------------------- acceptance
def accept_length(alpha: Sequence[float], depth: int) -> float:
    """Expected tokens per sequence of a depth-``depth`` chain step: 1 + sum over j of
    the chance the first j drafts are all accepted (alpha_j conditional per depth;
    positions past the profile take its last value)."""
    total, reach = 1.0, 1.0
    for j in range(depth):
        a = alpha[min(j, len(alpha) - 1)] if alpha else 0.0
        reach *= min(max(a, 0.0), 1.0)
        total += reach
    return total


@dataclass
class Acceptance:
    """alpha_j against the tokens the drafter was trained on (``tokens``, ascending,
    each with a per-depth ``alphas`` vector), interpolated in log(tokens). With a
    drift run's data (``drift_online`` / ``drift_frozen``: per step, the arm's
    acceptance relative to its first step; ``drift_from_json``), each arm follows its
    measured multipliers instead and the curve is not walked."""

    tokens: tuple
    alphas: tuple  # tuple of tuples
    scale: float = 1.0  # sensitivity: +-20 %
    drift_online: tuple = ()
    drift_frozen: tuple = ()
    bucket_factors: tuple = ()  # ((upper batch bound, factor on every alpha), ...)
    source: str = ""

    def for_batch(self, alpha: list, b: int) -> list:
        """``alpha`` at running batch ``b``: times the factor of b's bucket (none: 1)."""
        for bound, f in self.bucket_factors:
            if b <= bound:
                return [min(0.99, a * f) for a in alpha]
        return alpha

    def at(self, trained: float, step: int = 0, frozen: bool = False) -> list[float]:
        if len(self.tokens) == 1 or trained <= self.tokens[0]:
            base = list(self.alphas[0])
        elif trained >= self.tokens[-1]:
            base = list(self.alphas[-1])
        else:
            x = math.log(trained)
            xs = np.log(self.tokens)
            base = [float(np.interp(x, xs, [a[j] for a in self.alphas]))
                    for j in range(len(self.alphas[0]))]
        drift = self.drift_frozen if frozen else self.drift_online
        f = drift[min(step, len(drift) - 1)] if drift else 1.0
        return [min(0.99, a * self.scale * f) for a in base]

    def scaled(self, factor: float) -> "Acceptance":
        return replace(self, scale=self.scale * factor)

    @classmethod
    def constant(cls, alpha: Sequence[float], source: str = "") -> "Acceptance":
        return cls((1.0,), (tuple(alpha),), source=source)

    @classmethod
    def from_accept_length(cls, accept_len: float, depth: int, source: str = "") -> "Acceptance":
        """The constant per-token alpha whose depth-``depth`` chain gives ``accept_len``."""
        lo, hi = 0.0, 0.99
        for _ in range(60):
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if accept_length([mid], depth) < accept_len else (lo, mid)
        return cls.constant([lo], source or f"alpha {lo:.3f} from acceptance "
                             f"{accept_len} at depth {depth}")


def alpha_curve(doc_or_path="drafter_alpha_curves_t1_cpu.json", variant: str = "kl+tv"
                ) -> Acceptance:
    """The measured alpha-against-training-tokens curve of ``tools/compare_drafter_losses.py``
    (``rows[].variant.name`` / ``curve[].train_tokens`` / ``curve[].alpha``), made
    non-decreasing in tokens (a curve measured on 32 held-out responses wobbles)."""
    doc = doc_or_path if isinstance(doc_or_path, dict) else (
        load_table(doc_or_path) if "/" not in str(doc_or_path) else load_json(doc_or_path))
    for row in doc["rows"]:
        if row.get("variant", {}).get("name") == variant:
            pts = sorted((c["train_tokens"], tuple(c["alpha"])) for c in row["curve"])
            toks, alphas, best = [], [], None
            for t, a in pts:
                best = a if best is None else tuple(max(x, y) for x, y in zip(a, best))
                toks.append(float(t))
                alphas.append(best)
            return Acceptance(tuple(toks), tuple(alphas),
                              source=f"alpha curve '{variant}' ({doc.get('temperature', '?')}"
                              f" temperature, {doc.get('train_tokens', '?')} tokens)")
    raise ValueError(f"no variant {variant!r} in the alpha curves")


def bucket_factors_from_bench_spec(doc: dict) -> tuple:
    """Acceptance by batch size from a ``tools/bench_spec.py`` JSON: each fixed-strategy
    row's accept length at its depth gives a per-token alpha; the factors are relative
    to the smallest batch's (the rows measure the same drafter on the same prompts)."""
    got = {}
    for r in doc["results"]:
        k = int(str(r["strategy"]).split("_")[0])
        if k > 0 and r.get("accept_len"):
            got[int(r["batch"])] = Acceptance.from_accept_length(r["accept_len"], k).alphas[0][0]
    if not got:
        return ()
    bs = sorted(got)
    return tuple((b, got[b] / got[bs[0]]) for b in bs)


def drift_from_json(doc: dict) -> tuple[tuple, tuple]:
    """Per-step acceptance multipliers (step's accept length / the first step's) of the
    online and frozen arms of a ``tools/bench_drift.py`` JSON (``per_step``)."""
    out = []
    for arm in ("online", "frozen"):
        steps = doc.get("per_step", {}).get(arm) or []
        acc = [s.get("accept_len") for s in steps if s.get("accept_len")]
        out.append(tuple((a - 1) / (acc[0] - 1) if acc[0] > 1 else 1.0 for a in acc)
                   if acc else ())
    return out[0], out[1]


@dataclass
class TrainCost:
    """Per DP replica: seconds per token of the log-prob forwards (0 when fused into
    the update) and of the update (forward + backward), per attention cell of the
    update (a sequence of L tokens has L^2: attention's cost that grows with the
    length), a fixed part per optimizer step, and rewards per sample."""

    logprob_per_token: float = 0.0
    update_per_token: float = 0.0
    update_per_cell: float = 0.0
    update_fixed: float = 0.0
    reward_per_sample: float = 0.0
    first_step_extra: float = 0.0
    source: str = ""


@dataclass
class DrafterGroup:
    """Idle DP replicas train the drafter (``tokens_per_second`` each, at most
    ``max_tokens_per_window`` per step); alpha's axis is distinct tokens trained on."""

    enable: bool = True
    tokens_per_second: float = 0.0
    max_tokens_per_window: float = 32 * 512
    tokens_trained0: float = 0.0
    source: str = ""
