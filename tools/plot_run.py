#!/usr/bin/env python
"""Plot a run's metrics.jsonl (from pretrain_rl_tlt.py) as PNGs.

    python tools/plot_run.py runs/rl/demo/metrics.jsonl [--out runs/rl/demo]

Writes curves.png (reward, accuracy and held-out reward with its 95 % interval;
response lengths; speculative acceptance per batch-size bucket, response-position
bucket and, with several drafter kinds, per kind) and timeline.png (per step and
replica: rollout with bands for the drafter kind that speculated or the declined
steps, tail idle, log-probs, update).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[1])
    parser.add_argument("metrics", type=Path, help="metrics.jsonl of a run")
    parser.add_argument("--out", type=Path, default=None,
                        help="folder for the PNGs (default: the metrics file's folder)")
    args = parser.parse_args(argv)
    if not args.metrics.is_file():
        print(f"error: {args.metrics} does not exist", file=sys.stderr)
        return 2
    from megatron_tlt.rl.report import write_plots

    for p in write_plots(args.metrics, args.out or args.metrics.parent):
        print(p)
    return 0


if __name__ == "__main__":
    sys.exit(main())
