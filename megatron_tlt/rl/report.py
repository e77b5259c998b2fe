"""What a finished run shows: a per-step summary table and PNG plots of its JSONL.

``write_plots`` is also ``tools/plot_run.py``: reward / accuracy / length curves, the
speculative acceptance per batch-size and response-position bucket (and per drafter
kind with several), and the per-step replica timeline (rollout, with bands for the
drafter kind that speculated or the declined steps; tail idle with the drafter group's
training in it; update).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Optional, Sequence

from ..fileio import atomic_write
from ..rollout.speculative.drafters import kind_named
from ..tracking import read_metrics


def summary_table(history: Sequence[dict]):
    """The per-step rich table. With several drafter kinds (``rollout.speculative
    .kinds.self.also``) two more columns: per kind the share of decode steps it speculated and
    its acceptance length, and per batch-size bucket the drafter (kind and arm) the
    bucket chose most often in the step ("plain": its chosen kind's gate declined)."""
    from rich.table import Table

    table = Table(title="GRPO with TLT rollouts: per step")
    online = any("drafter/steps" in h for h in history)  # the drafter group trained
    kinds = step_kinds(history)
    by_kind = len(kinds) > 1
    cols = ["step", "reward", "accuracy", "resp len", "rollout s", "tail s", "update s",
            "step s", "accept len", "SD on"]
    if by_kind:
        cols += ["SD on / accept by kind", "drafter by bucket"]
    if online:
        cols += ["drafter steps", "alpha", "idle used"]
    for col in cols + ["held-out acc (95% CI)"]:
        table.add_column(col, justify="left" if col.endswith("kind") or
                         col.endswith("bucket") else "right")
    for h in history:
        if "reward/mean" not in h:
            if "eval/accuracy" in h:  # the evaluation before the first step
                table.add_row(str(h["step"]), *["-"] * (len(cols) - 1), _eval_cell(h))
            continue
        t = h.get("timing", {})
        spec = h.get("spec", {})
        per_kind = [kind_cell(spec, kinds), bucket_cell(spec)] if by_kind else []
        drafter = [str(h.get("drafter/steps", "-")),
                   f"{h['drafter/alpha']:.3f}" if "drafter/alpha" in h else "-",
                   f"{h.get('drafter/idle_used_fraction', 0):.0%}"] if online else []
        table.add_row(
            str(h["step"]), f"{h['reward/mean']:.3f}", f"{h['accuracy']:.2f}",
            f"{h['response_length/mean']:.0f}", f"{t.get('rollout', 0):.1f}",
            f"{t.get('tail', 0):.1f}", f"{t.get('update', 0):.1f}", f"{t.get('step', 0):.1f}",
            f"{spec.get('accept_len', 0):.2f}" if spec else "-",
            f"{spec.get('on_fraction', 0):.0%}" if spec else "-", *per_kind, *drafter,
            _eval_cell(h))
    return table


def step_kinds(history: Sequence[dict]) -> list[str]:
    """The drafter kinds the steps' ``spec/kinds`` name, in first-seen order."""
    return list(dict.fromkeys(k for h in history for k in h.get("spec", {}).get("kinds", [])))


def kind_cell(spec: dict, kinds: Sequence[str]) -> str:
    """One line per kind: its share of the step's decode steps and acceptance length
    ("self 12% x4.31"; "-" where it never speculated), and where kinds proposed per
    row (free kinds), the tokens of the rows it proposed for, their share of the
    speculative steps' tokens and their acceptance length ("group 0% - | 420 tok 35%
    x2.10")."""
    lines = []
    for k in kinds:
        m = spec.get(k) or {}
        acc = f"x{m['accept_len']:.2f}" if m.get("steps") else "-"
        line = f"{k} {m.get('on_fraction', 0.0):.0%} {acc}"
        if m.get("proposed_rows", m.get("rows", 0)) != m.get("rows", 0):
            line += (f" | {m['proposed_emitted']} tok {m.get('proposed_share', 0.0):.0%} "
                     f"x{m['proposed_accept_len']:.2f}")
        lines.append(line)
    return "\n".join(lines) if lines else "-"


def bucket_cell(spec: dict) -> str:
    """One line per batch-size bucket, smallest first: what it chose most often and
    the share of its tuned steps each kind speculated and declined ("1: self 4_1_4 |
    self 90% plain 10%")."""
    choice = spec.get("bucket_choice") or {}
    lines = []
    for b in sorted(choice, key=bucket_key):
        per = (spec.get("chosen") or {}).get(b) or {}
        total = sum(per.values())
        shares = " ".join(f"{k} {n / total:.0%}" for k, n in per.items() if n) if total else ""
        lines.append(f"{b}: {choice[b]}" + (f" | {shares}" if shares else ""))
    return "\n".join(lines) or "-"


def bucket_key(label) -> int:
    """Sort key of a bucket label ("1", "3-4", "33+")."""
    m = re.match(r"\d+", str(label))
    return int(m.group()) if m else 0


def print_summary(history: Sequence[dict], *, run_dir: Path, metrics: Path,
                  wandb_dir: Optional[str], plots: Sequence[Path], seconds: float,
                  exported: Optional[Path] = None) -> None:
    from rich.console import Console

    table = summary_table(history)
    online = any("drafter/steps" in h for h in history)
    console = Console()
    width = (164 if online else 132) + (72 if len(step_kinds(history)) > 1 else 0)
    if console.width < width:  # a pipe or a narrow terminal: keep the columns readable
        console = Console(width=width)
    console.print(table)
    evals = [h for h in history if "eval/accuracy" in h]
    if evals:
        first, last = evals[0], evals[-1]
        console.print(f"held-out   : accuracy {_eval_cell(first)} at step {first['step']} -> "
                      f"{_eval_cell(last)} at step {last['step']} "
                      f"({last.get('eval/prompts', 0)} prompts, Wilson 95% intervals)")
    for line in reading(history):
        console.print(line)
    console.print(f"run folder : {run_dir}")
    console.print(f"metrics    : {metrics}")
    if wandb_dir:
        console.print(f"W&B run    : {wandb_dir}  (offline: `wandb sync {wandb_dir}`)")
    for p in plots:
        console.print(f"plot       : {p}")
    if exported is not None:
        console.print(f"HF export  : {exported}  (transformers: "
                      f"AutoModelForCausalLM.from_pretrained('{exported}'))")
    console.print(f"wall time  : {seconds / 60:.1f} min")


def reading(history: Sequence[dict]) -> list[str]:
    """What the run can and cannot show, in plain words: whether held-out accuracy
    moved beyond its first interval, what TLT did in the steps' rollouts, and (the
    paged KV cache) the rows in flight and the preemptions."""
    lines = []
    evals = [h for h in history if "eval/accuracy_lo" in h]
    steps = [h for h in history if "reward/mean" in h]
    if len(evals) >= 2:
        first, last = evals[0], evals[-1]
        n_steps = last["step"] - first["step"]
        if last["eval/accuracy_lo"] > first["eval/accuracy_hi"]:
            verdict = f"rose beyond the step-{first['step']} 95% interval"
        elif last["eval/accuracy_hi"] < first["eval/accuracy_lo"]:
            verdict = f"fell below the step-{first['step']} 95% interval"
        else:
            verdict = (f"shows no measurable change: the intervals overlap; {n_steps} steps "
                       f"on {last.get('eval/prompts', 0)} prompts are too few to move "
                       f"held-out accuracy (a learning run needs tens of steps: "
                       f"docs/learning.md, python tools/learn.py)")
        lines.append(f"reading    : held-out accuracy {verdict}")
    spec = [h.get("spec") or {} for h in steps]
    if steps and any(spec):
        t = [h.get("timing", {}) for h in steps]
        rollout = sum(x.get("rollout", 0.0) for x in t) / len(t)
        tail = sum(x.get("tail", 0.0) for x in t) / len(t)
        on = sum(s.get("on_fraction", 0.0) for s in spec) / len(spec)
        per_kind = []
        for k in step_kinds(history):
            runs = [s[k] for s in spec if (s.get(k) or {}).get("steps")]
            if runs:
                per_kind.append(f"{k} x{sum(r['accept_len'] for r in runs) / len(runs):.2f}")
        lines.append(f"TLT        : rollout {rollout:.1f} s per step ({tail:.1f} s in the tail); "
                     f"speculation on {on:.0%} of decode steps"
                     + (f"; accepted length by kind: {', '.join(per_kind)}" if per_kind else ""))
    kv = kv_line(steps)
    if kv:
        lines.append(kv)
    return lines


def kv_line(steps: Sequence[dict]) -> Optional[str]:
    """The paged KV cache over the run (``rollout.kv_cache=paged``'s step metrics): the
    most rows a replica held in flight, a GPU's most KV bytes, and the rows preempted
    (blocks ran out; recomputed with the same output). None with fixed slots."""
    paged = [h for h in steps if "rollout/rows_peak" in h]
    if not paged:
        return None
    rows = max(h["rollout/rows_peak"] for h in paged)
    gib = max(h.get("rollout/kv_bytes_peak", 0) for h in paged) / 2**30
    pre = sum(h.get("rollout/preemptions", 0) for h in paged)
    hit = sum(1 for h in paged if h.get("rollout/preemptions", 0))
    return (f"KV cache   : paged; up to {rows:.0f} rows in flight per replica, "
            f"{gib:.3g} GiB of KV per GPU at the peak; {pre:.0f} rows preempted and "
            f"recomputed ({hit} of {len(paged)} steps)"
            + ("; raise rollout.kv_cache_gib to keep them" if pre else ""))


def _eval_cell(h: dict) -> str:
    if "eval/accuracy" not in h:
        return ""
    if "eval/accuracy_lo" not in h:
        return f"{h['eval/accuracy']:.2f}"
    return f"{h['eval/accuracy']:.2f} [{h['eval/accuracy_lo']:.2f}, {h['eval/accuracy_hi']:.2f}]"


def write_plots(metrics_path: str | Path, out_dir: str | Path) -> list[Path]:
    """PNG plots of a run's metrics.jsonl into ``out_dir``; returns their paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = read_metrics(metrics_path)
    train = [r for r in records if "reward/mean" in r]
    evals = [r for r in records if "eval/accuracy" in r]
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    if not train and not evals:
        return paths

    # 1. learning curves
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    steps = [r["step"] for r in train]
    ax = axes[0]
    ax.plot(steps, [r["reward/mean"] for r in train], marker="o", label="train reward")
    ax.plot(steps, [r["accuracy"] for r in train], marker=".", label="train accuracy")
    if evals:
        es = [r["step"] for r in evals]
        acc = [r["eval/accuracy"] for r in evals]
        err = [[a - r.get("eval/accuracy_lo", a) for a, r in zip(acc, evals)],
               [r.get("eval/accuracy_hi", a) - a for a, r in zip(acc, evals)]]
        n = evals[-1].get("eval/prompts", 0)
        ax.errorbar(es, acc, yerr=err, marker="s", capsize=3, linestyle="--",
                    label=f"held-out accuracy, {n} prompts (95% CI)")
    ax.set_xlabel("step")
    ax.set_title("reward and accuracy")
    ax.legend()
    ax = axes[1]
    ax.plot(steps, [r["response_length/mean"] for r in train], label="mean")
    ax.plot(steps, [r["response_length/p99"] for r in train], label="p99")
    ax.plot(steps, [r["response_length/max"] for r in train], label="max")
    ax.set_xlabel("step")
    ax.set_title("response length (tokens)")
    ax.legend()
    ax = axes[2]
    buckets = sorted({b for r in train for b in r.get("spec", {}).get("accept_len_by_bucket", {})},
                     key=bucket_key)
    for b in buckets:
        ax.plot(steps, [r.get("spec", {}).get("accept_len_by_bucket", {}).get(b, float("nan"))
                        for r in train], marker=".", label=f"batch {b}")
    positions = list(dict.fromkeys(
        k for r in train for k in r.get("spec", {}).get("accept_len_by_position", {})))
    for k in positions:  # response-position buckets, dashed
        ax.plot(steps, [r.get("spec", {}).get("accept_len_by_position", {}).get(
            k, float("nan")) for r in train], marker="x", linestyle="--",
            label=f"response tokens {k}")
    kinds = step_kinds(train)
    for k in kinds if len(kinds) > 1 else ():  # per drafter kind, dash-dotted
        ax.plot(steps, [r.get("spec", {}).get(k, {}).get("accept_len", float("nan"))
                        if r.get("spec", {}).get(k, {}).get("steps") else float("nan")
                        for r in train], marker="^", linestyle="-.", linewidth=2,
                label=f"drafter {k}")
    if buckets or positions:
        ax.legend(fontsize=7)
    else:
        ax.text(0.5, 0.5, "no speculative steps in this run", ha="center",
                transform=ax.transAxes)
    ax.set_xlabel("step")
    ax.set_title("acceptance length per batch / response-position bucket"
                 + (" / drafter kind" if len(kinds) > 1 else ""))
    fig.tight_layout()
    p = out / "curves.png"
    _save(fig, p)
    plt.close(fig)
    paths.append(p)

    # 2. replica timeline: per step, each replica's rollout, tail idle, update
    if train and "timeline" in train[0]:
        n_rep = len(train[0]["timeline"]["replica_finish"])
        fig, ax = plt.subplots(figsize=(12, 1.0 + 0.45 * n_rep * min(len(train), 8)))
        shown = train[-8:]
        y = 0
        labels = []
        for r in shown:
            fin = r["timeline"]["replica_finish"]
            last = max(fin)
            t = r["timing"]
            upd_start = t["step"] - t["update"]
            spans = r["timeline"].get("drafter_train") or [None] * len(fin)
            bands = r["timeline"].get("replica_kinds") or [[]] * len(fin)
            tokens = r["timeline"].get("replica_kind_tokens") or [[]] * len(fin)
            for k, f in enumerate(fin):
                ax.barh(y, f, color="tab:blue")
                ax.barh(y, last - f, left=f, color="tab:red", alpha=0.6)
                if spans[k] is not None:  # drafter training inside the idle window
                    ax.barh(y, spans[k][1] - spans[k][0], left=spans[k][0],
                            color="tab:purple", height=0.5)
                for a, b, what in bands[k]:  # which drafter decoded when (thin bands)
                    ax.barh(y + 0.3, max(b - a, 1e-3), left=a, height=0.25,
                            color=kind_color(what))
                for a, b, by_kind in tokens[k]:  # tokens by proposing kind: the span
                    left, total = a, sum(by_kind.values())  # split by their shares
                    for kind, n in sorted(by_kind.items()):
                        w = max(b - a, 1e-3) * n / total if total else 0.0
                        ax.barh(y + 0.1, w, left=left, height=0.12, color=kind_color(kind))
                        left += w
                ax.barh(y, upd_start - last, left=last, color="tab:gray", alpha=0.4)
                ax.barh(y, t["update"], left=upd_start, color="tab:green")
                labels.append(f"step {r['step']} replica {k}")
                y += 1
        ax.set_yticks(range(len(labels)))
        ax.set_yticklabels(labels, fontsize=7)
        ax.invert_yaxis()
        ax.set_xlabel("seconds since step start")
        title = ("replica timeline: rollout (blue), tail idle (red), drafter training "
                 "(purple), log-probs (grey), update (green)")
        kinds = sorted(({w for r in shown for segs in r["timeline"].get("replica_kinds") or []
                         for _, _, w in segs}
                        | {k for r in shown
                           for segs in r["timeline"].get("replica_kind_tokens") or []
                           for _, _, t in segs for k in t}) - {"plain"})
        if kinds:
            title += ("\nbands under the rollout: steps speculated by " + " or ".join(
                f"{kind_label(k)} ({kind_color(k).removeprefix('tab:')})"
                for k in kinds) + ", declined (black); below them the tokens by the "
                "kind that proposed each row")
        ax.set_title(title, fontsize=9)
        fig.tight_layout()
        p = out / "timeline.png"
        _save(fig, p)
        plt.close(fig)
        paths.append(p)
    return paths


def kind_color(what: str) -> str:
    """A timeline band's color: its drafter kind's, black where the chosen kind's gate
    declined ("plain") or the kind is unknown here."""
    try:
        return kind_named(what).color
    except KeyError:
        return "black"


def kind_label(name: str) -> str:
    try:
        return kind_named(name).label
    except KeyError:
        return name


def _save(fig, path: Path) -> None:
    """The PNG replaces an earlier one only once it is complete."""
    with atomic_write(path, "wb") as f:
        fig.savefig(f, format="png", dpi=90)
