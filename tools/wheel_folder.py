#!/usr/bin/env python
"""The wheel folder for the one-GPU machine (``make gpu-wheels``): every package its image
lacks, as CPython 3.12 wheels, plus SmolLM2's shape files from this machine's prepared
asset (megatron_tlt/gpu_check/wheels.py says what and why).

    PYTHONPATH=$PWD python3 tools/wheel_folder.py [--dest gpu_wheels]

Needs pip, the network and the prepared SmolLM2 asset (``make assets``). Without the
asset it stops at once with exit status 1 and says so (the GPU check's SmolLM2 parts
cannot run without the shape files); it also fails when the finished folder lacks
anything the check needs (``folder_problems``: each missing piece and how to make it).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

try:  # (standard library and pip only: no environment needed)
    from megatron_tlt.gpu_check.wheels import (MAX_WHEELS_MIB, WheelFolderError,
                                               default_shape_source, folder_problems,
                                               make_wheels)
except ImportError as e:
    sys.exit(f"error: {e}. Run from the repository root as "
             "`PYTHONPATH=$PWD python3 tools/wheel_folder.py` (what `make gpu-wheels` does)")

REPO = Path(__file__).resolve().parents[1]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dest", default=str(REPO / "gpu_wheels"), help="the wheel folder")
    args = ap.parse_args(argv)
    try:
        m = make_wheels(Path(args.dest), default_shape_source())
    except WheelFolderError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    for name, size in m["files"].items():
        print(f"{size / 2 ** 20:8.2f} MiB  {name}")
    print(f"total {m['total_mib']} MiB in {args.dest} (limit {MAX_WHEELS_MIB} MiB); "
          f"unmet requirements: {m['unmet_requirements'] or 'none'}")
    problems = folder_problems(Path(args.dest))
    for p in problems:
        print(f"error: {p}", file=sys.stderr)
    if not problems:
        print(f"{args.dest}: complete (every pinned wheel, SmolLM2's shape files)")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
