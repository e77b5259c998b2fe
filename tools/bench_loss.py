"""The loss's vocabulary work: chunked (``rl.token_stats``, what the trainer runs) against
the whole-micro-batch path it replaced (a boolean-indexed copy of the response rows,
megatron-core's vocab-parallel cross-entropy, the entropy metric on the whole copy).

Times one forward + backward of the log-probs (and the entropy metric) of a micro-batch
of random logits, interleaved (old, new, old, ...) after a warm-up, with the old path
run twice per round as an A/A control; reports the median new / old ratio. Values are
checked equal (a speed result with different log-probs is not a result). One process,
TP = 1.

    python tools/bench_loss.py [--quick] [--json docs/results/bench_loss_cpu.json]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from datetime import date
from pathlib import Path

import torch


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--vocab", type=int, default=49152, help="SmolLM2's vocabulary")
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--response-from", type=int, default=64,
                    help="positions before this one are prompt (no loss)")
    ap.add_argument("--chunk", type=int, default=1024, help="train.loss_chunk_tokens")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--quick", action="store_true", help="4 rows, 3 rounds")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    if args.quick:
        args.rows, args.rounds = 4, 3
    return args


class Paths:
    """A micro-batch of random logits (seeded) and the two ways of taking its response
    rows' log-probs, entropy metric and backward."""

    def __init__(self, args):
        from megatron_tlt.models.gpt import ModelArch

        self.V, self.chunk = args.vocab, args.chunk
        self.arch = ModelArch("llama", self.V, 8, 8, 1, 1, 1, 8, 1e-5, 1e4, 64, True, False)
        gen = torch.Generator().manual_seed(0)
        self.logits = torch.randn(args.rows, args.seq, self.V, generator=gen)
        self.targets = torch.randint(0, self.V, (args.rows, args.seq), generator=gen)
        self.mask = torch.zeros(args.rows, args.seq)
        self.mask[:, args.response_from:] = 1

    def old(self):
        """The whole-micro-batch path: a boolean-indexed copy of the response rows."""
        from megatron_tlt.models.inference import token_logprobs
        from megatron_tlt.rl.grpo import vocab_parallel_entropy

        x = self.logits.clone().requires_grad_()
        sel = self.mask > 0
        rows = x[sel].unsqueeze(0)
        lp = token_logprobs(rows, self.targets[sel].unsqueeze(0), self.arch, 1.0)[0]
        with torch.no_grad():
            vocab_parallel_entropy(rows.detach(), vocab_size=self.V)
        lp.sum().backward()
        return lp.detach()

    def new(self):
        """The chunked path the trainer runs (``rl.token_stats``)."""
        from megatron_tlt.rl.token_stats import token_stats

        x = self.logits.clone().requires_grad_()
        lp, _ = token_stats(x, self.targets, self.mask, vocab_size=self.V,
                            chunk_tokens=self.chunk)
        lp.sum().backward()
        return lp.detach()[self.mask > 0]


def timed(f) -> float:
    t0 = time.perf_counter()
    f()
    return time.perf_counter() - t0


def main(argv=None) -> None:
    args = parse_args(argv)
    from megatron_tlt.parallel import initialize_model_parallel
    from megatron_tlt.rollout.cpu_kernels import cpu_info, detect_isa
    from megatron_tlt.runtime_env import init_distributed

    init_distributed()
    initialize_model_parallel(1, 1, seed=0)
    torch.set_num_threads(args.threads)
    paths = Paths(args)
    V, mask = paths.V, paths.mask
    diff = float((paths.old() - paths.new()).abs().max())
    if diff > 1e-4:
        raise SystemExit(f"the two paths disagree: max |logp difference| {diff:.3g}")
    ratio, aa, t_old, t_new = [], [], [], []
    for _ in range(args.rounds):
        a, b, a2 = timed(paths.old), timed(paths.new), timed(paths.old)
        ratio.append(b / a)
        aa.append(a2 / a)
        t_old.append(a)
        t_new.append(b)
    model, flags = cpu_info()
    out = {
        "benchmark": "bench_loss",
        "date": date.today().isoformat(),
        "config": dict(vocab=V, rows=args.rows, seq=args.seq, loss_tokens=int(mask.sum()),
                       chunk=args.chunk, threads=args.threads, rounds=args.rounds,
                       torch=torch.__version__, cpu=model, arch=platform.machine(),
                       cpu_isa=detect_isa(),
                       avx512="avx512f" in flags, avx2="avx2" in flags),
        "results": [dict(old_s=o, new_s=n, ratio=r, aa=c)
                    for o, n, r, c in zip(t_old, t_new, ratio, aa)],
        "max_logp_difference": diff,
        "new_vs_old": statistics.median(ratio),
        "new_vs_old_min": min(ratio), "new_vs_old_max": max(ratio),
        "aa_control": statistics.median(aa),
    }
    print(f"loss vocabulary work, {int(mask.sum())} loss tokens x {V} vocabulary, "
          f"{args.threads} thread(s), {model}")
    print(f"  whole micro-batch (old) {statistics.median(t_old):7.3f} s   chunks of "
          f"{args.chunk} (new) {statistics.median(t_new):7.3f} s")
    print(f"  new / old {out['new_vs_old']:.3f} (min {out['new_vs_old_min']:.3f}, max "
          f"{out['new_vs_old_max']:.3f})   A/A control {out['aa_control']:.3f}   "
          f"max |logp diff| {diff:.2g}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
