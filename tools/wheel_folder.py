#!/usr/bin/env python
"""The wheel folder for the one-GPU machine (``make gpu-wheels``): every package its image
lacks, as CPython 3.12 wheels, plus SmolLM2's shape files when this machine has the
prepared asset (megatron_tlt/gpu_check/wheels.py says what and why).

    PYTHONPATH=$PWD python3 tools/wheel_folder.py [--dest gpu_wheels]

Needs only pip and the network: no CPU environment. Without the prepared asset
(``make assets``) the folder has no ``smollm2_shape/`` and the GPU check's SmolLM2 parts
fail with that reason; everything else runs.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

try:  # (standard library and pip only: no environment needed)
    from megatron_tlt.gpu_check.wheels import MAX_WHEELS_MIB, default_shape_source, make_wheels
except ImportError as e:
    sys.exit(f"error: {e}. Run from the repository root as "
             "`PYTHONPATH=$PWD python3 tools/wheel_folder.py` (what `make gpu-wheels` does)")

REPO = Path(__file__).resolve().parents[1]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dest", default=str(REPO / "gpu_wheels"), help="the wheel folder")
    args = ap.parse_args(argv)
    shape = default_shape_source()
    m = make_wheels(Path(args.dest), shape)
    for name, size in m["files"].items():
        print(f"{size / 2 ** 20:8.2f} MiB  {name}")
    print(f"total {m['total_mib']} MiB in {args.dest} (limit {MAX_WHEELS_MIB} MiB); "
          f"unmet requirements: {m['unmet_requirements'] or 'none'}")
    if not m["smollm2_shape"]:
        print("no smollm2_shape/: this machine has no prepared SmolLM2 asset. The GPU check's "
              "SmolLM2 parts (assets, grpo, first_step, drafter, benches and the SmolLM2 "
              "tests of tests_gpu) need it: `make assets` (the CPU environment), then "
              "`make gpu-wheels` again")
    return 0 if m["fits"] and not m["unmet_requirements"] else 1


if __name__ == "__main__":
    sys.exit(main())
