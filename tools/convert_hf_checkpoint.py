#!/usr/bin/env python
"""Convert Hugging Face Llama/Qwen2 checkpoints to megatron-core checkpoints and back.

    # HF folder -> megatron checkpoint sharded for TP=2, PP=2
    python tools/convert_hf_checkpoint.py to-megatron --hf-path HF_DIR --out CKPT_DIR \
        --tensor-model-parallel-size 2 --pipeline-model-parallel-size 2
    # megatron checkpoint (any TP/PP) -> HF folder that transformers loads
    python tools/convert_hf_checkpoint.py to-hf --load CKPT_DIR --out HF_DIR

No process group is needed: shards are computed from the tensors directly. Tensors keep
their dtype unless --dtype is given, so a round trip is bit-exact.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from megatron_tlt.config import validate_for_run, Config  # noqa: E402
from megatron_tlt.models import resolve_source  # noqa: E402
from megatron_tlt.models.checkpoint import (load_megatron_shards,  # noqa: E402
                                            save_megatron_checkpoint)
from megatron_tlt.models.gpt import ModelArch  # noqa: E402
from megatron_tlt.models.hf import (HFWeights, expected_hf_keys, hf_to_megatron,  # noqa: E402
                                    megatron_to_hf, save_hf_folder)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _cast(state: dict, dtype: str | None) -> dict:
    if dtype is None:
        return state
    return {k: v.to(DTYPES[dtype]) if v.is_floating_point() else v for k, v in state.items()}


def to_megatron(hf_path: str, out: str, tp: int, pp: int, dtype: str | None) -> None:
    src = resolve_source(hf_path)
    arch = ModelArch.from_hf_folder(src)
    cfg = Config()
    cfg.parallel.tensor_model_parallel_size, cfg.parallel.pipeline_model_parallel_size = tp, pp
    validate_for_run(cfg, arch, world_size=tp * pp)
    hf = HFWeights(src)
    missing = [k for k in expected_hf_keys(arch) if k not in hf]
    if missing:
        raise SystemExit(f"error: {src} lacks {len(missing)} expected tensors, e.g. {missing[:3]}")
    start = time.perf_counter()
    shards = {}
    for p in range(pp):
        for t in range(tp):
            shards[(t, p)] = _cast(hf_to_megatron(hf, arch, tp_size=tp, tp_rank=t,
                                                  pp_size=pp, pp_rank=p), dtype)
            print(f"  shard tp={t} pp={p}: {len(shards[(t, p)])} tensors", flush=True)
    save_megatron_checkpoint(out, shards, arch, tp_size=tp, pp_size=pp, tokenizer_dir=src)
    print(f"wrote megatron checkpoint {out} (TP={tp}, PP={pp}) from {src} "
          f"in {time.perf_counter() - start:.1f} s")


def to_hf(load: str, out: str, dtype: str | None) -> None:
    start = time.perf_counter()
    shards, arch, meta = load_megatron_shards(load)
    hf = _cast(megatron_to_hf(shards, arch, tp_size=meta["tensor_model_parallel_size"],
                              pp_size=meta["pipeline_model_parallel_size"]), dtype)
    tok_dir = os.path.join(load, "hf")
    save_hf_folder(hf, arch.hf_config, out, tokenizer_dir=tok_dir if os.path.isdir(tok_dir) else None)
    print(f"wrote Hugging Face folder {out} ({len(hf)} tensors) from {load} "
          f"in {time.perf_counter() - start:.1f} s")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="direction", required=True)
    a = sub.add_parser("to-megatron", help="HF folder -> megatron checkpoint")
    a.add_argument("--hf-path", required=True, help="HF folder, or 'smollm2'")
    a.add_argument("--out", required=True, help="new output folder")
    a.add_argument("--tensor-model-parallel-size", type=int, default=1)
    a.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    a.add_argument("--dtype", choices=sorted(DTYPES), default=None,
                   help="cast weights (default: keep the source dtype)")
    b = sub.add_parser("to-hf", help="megatron checkpoint -> HF folder")
    b.add_argument("--load", required=True, help="checkpoint folder from to-megatron")
    b.add_argument("--out", required=True, help="output HF folder")
    b.add_argument("--dtype", choices=sorted(DTYPES), default=None)
    args = parser.parse_args(argv)
    try:
        if args.direction == "to-megatron":
            to_megatron(args.hf_path, args.out, args.tensor_model_parallel_size,
                        args.pipeline_model_parallel_size, args.dtype)
        else:
            to_hf(args.load, args.out, args.dtype)
    except (ValueError, FileNotFoundError, FileExistsError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
