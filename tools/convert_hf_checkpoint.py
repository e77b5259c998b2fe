#!/usr/bin/env python
"""Convert Hugging Face <-> megatron-core checkpoints; export trained runs to Hugging Face.

The direction follows the source named by model.hf_path:

    # an HF folder -> a megatron checkpoint sharded for the configured TP, PP (and EP:
    # parallel.expert_model_parallel_size, mixture-of-experts models)
    python tools/convert_hf_checkpoint.py --out CKPT_DIR model.hf_path=HF_DIR \
        parallel.tensor_model_parallel_size=2 parallel.pipeline_model_parallel_size=2
    # a megatron checkpoint (any TP/PP/EP) -> an HF folder that transformers loads
    python tools/convert_hf_checkpoint.py --out HF_DIR model.hf_path=CKPT_DIR
    # a run's checkpoint.save folder (any TP/PP; the newest step, or --step N) -> an HF
    # folder, with the run's drafter in HF_DIR/drafter when it had one
    python tools/convert_hf_checkpoint.py --out HF_DIR model.hf_path=RUN_SAVE_DIR [--step N]

Same configuration convention as every entry point (--config FILE, section.field=value).
No process group is needed: shards are computed from the tensors directly. Tensors keep
their dtype unless model.dtype names one (auto keeps it), so a round trip is bit-exact.
"""

from __future__ import annotations

import sys
import time

from megatron_tlt.assets import AssetError
from megatron_tlt.config import build_parser, config_from_args
from megatron_tlt.checkpoint.export import ExportError, export_run_checkpoint
from megatron_tlt.models import resolve_source
from megatron_tlt.models.gpt import DTYPES, ModelArch
from megatron_tlt.models.hf import (HFWeights, expected_hf_keys, hf_to_megatron,
                                    megatron_to_hf, save_hf_folder)
from megatron_tlt.run_files import is_run_checkpoint
from megatron_tlt.validation import validate
from megatron_tlt.models.megatron_weights import (is_megatron_checkpoint,
                                                  load_megatron_shards,
                                                  save_megatron_checkpoint, tokenizer_folder)

def _cast(state: dict, dtype: str) -> dict:
    if dtype == "auto":
        return state
    return {k: v.to(DTYPES[dtype]) if v.is_floating_point() else v for k, v in state.items()}


def to_megatron(cfg, src, out: str) -> None:
    tp = cfg.parallel.tensor_model_parallel_size
    pp = cfg.parallel.pipeline_model_parallel_size
    ep = cfg.parallel.expert_model_parallel_size
    arch = ModelArch.from_hf_folder(src)
    validate(cfg, arch, world_size=tp * pp * ep)
    hf = HFWeights(src)
    missing = [k for k in expected_hf_keys(arch) if k not in hf]
    if missing:
        raise ValueError(f"{src} lacks {len(missing)} expected tensors, e.g. {missing[:3]}")
    start = time.perf_counter()
    shards = {}
    for p in range(pp):
        for t in range(tp):
            for e in range(ep):
                key = (t, p) if ep == 1 else (t, p, e)
                shards[key] = _cast(hf_to_megatron(hf, arch, tp_size=tp, tp_rank=t, pp_size=pp,
                                                   pp_rank=p, ep_size=ep, ep_rank=e),
                                    cfg.model.dtype)
                print(f"  shard tp={t} pp={p}{f' ep={e}' if ep > 1 else ''}: "
                      f"{len(shards[key])} tensors", flush=True)
    save_megatron_checkpoint(out, shards, arch, tp_size=tp, pp_size=pp, tokenizer_dir=src,
                             ep_size=ep)
    print(f"wrote megatron checkpoint {out} (TP={tp}, PP={pp}{f', EP={ep}' if ep > 1 else ''})"
          f" from {src} in {time.perf_counter() - start:.1f} s")


def to_hf(cfg, src, out: str) -> None:
    start = time.perf_counter()
    shards, arch, meta = load_megatron_shards(src)
    hf = _cast(megatron_to_hf(shards, arch, tp_size=meta["tensor_model_parallel_size"],
                              pp_size=meta["pipeline_model_parallel_size"],
                              ep_size=meta.get("expert_model_parallel_size", 1)),
               cfg.model.dtype)
    tok_dir = tokenizer_folder(src)
    save_hf_folder(hf, arch.hf_config, out, tokenizer_dir=tok_dir if tok_dir.is_dir() else None)
    print(f"wrote Hugging Face folder {out} ({len(hf)} tensors) from {src} "
          f"in {time.perf_counter() - start:.1f} s")


def main(argv=None) -> int:
    parser = build_parser(__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="output folder (must not exist or be empty)")
    parser.add_argument("--step", type=int, default=None,
                        help="run checkpoint: the step to export (default: the newest)")
    parser.add_argument("--tokenizer", default=None, metavar="DIR",
                        help="run checkpoint: copy the tokenizer from DIR instead of the "
                             "run's model.hf_path")
    args = parser.parse_args(argv)
    try:
        cfg = config_from_args(args)
        src = resolve_source(cfg.model.hf_path)
        if is_run_checkpoint(src):
            start = time.perf_counter()
            out = export_run_checkpoint(src, args.out, step=args.step,
                                        tokenizer_dir=args.tokenizer, dtype=cfg.model.dtype)
            drafter = " (drafter in drafter/)" if (out / "drafter").is_dir() else ""
            print(f"wrote Hugging Face folder {out}{drafter} from run checkpoint {src} in "
                  f"{time.perf_counter() - start:.1f} s")
        elif args.step is not None:
            raise ValueError(f"--step applies to run checkpoints (checkpoint.save folders); "
                             f"{src} is not one")
        elif is_megatron_checkpoint(src):
            to_hf(cfg, src, args.out)
        else:
            to_megatron(cfg, src, args.out)
    except (ValueError, FileNotFoundError, FileExistsError, AssetError, ExportError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
