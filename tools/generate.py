#!/usr/bin/env python
"""Generate a chat completion with a megatron-core model through megatron_tlt.

    python tools/generate.py model.hf_path=smollm2 generate.prompt="What is 2+3?"
    torchrun --nproc_per_node 2 tools/generate.py --config examples/rl/smollm2_cpu.yaml \
        parallel.tensor_model_parallel_size=2

Greedy, one prompt, through the rollout engine (KV cache, megatron_tlt.rollout) at any
tensor and pipeline parallelism.
"""

from __future__ import annotations

import sys
import time

from megatron_tlt.assets import AssetError
from megatron_tlt.config import ConfigError, parse_args
from megatron_tlt.models.gpt import UnsupportedModelError


def main(argv=None) -> int:
    cfg = parse_args(argv, description=__doc__.splitlines()[1])
    from megatron_tlt.runtime_env import silence_expected_warnings

    silence_expected_warnings()
    from megatron_tlt.launch import setup, shutdown
    from megatron_tlt.rollout import RolloutEngine, SamplingParams
    from megatron_tlt.tasks import build_messages, chat_token_ids

    session = setup(cfg)
    tok = session.tokenizer
    prompt_ids = chat_token_ids(tok, build_messages(cfg.generate.prompt))
    engine = RolloutEngine(session.model, tok, cfg.rollout, arch=session.arch)
    t0 = time.perf_counter()
    out = engine.generate([prompt_ids], SamplingParams(
        temperature=0.0, max_new_tokens=cfg.generate.max_new_tokens))[0]
    seconds = time.perf_counter() - t0
    token_ids, how = out.token_ids, "rollout engine, KV cache"
    if session.platform.rank == 0:
        text = tok.decode(token_ids, skip_special_tokens=True)
        p = session.platform
        print(f"model      : {session.source} ({session.arch.model_type}, "
              f"{session.arch.num_parameters / 1e6:.1f}M params, megatron-core GPTModel)")
        print(f"platform   : {p.device.type}/{p.backend}, world {p.world_size}, "
              f"TP={session.layout.tp_size} PP={session.layout.pp_size}")
        print(f"prompt     : {cfg.generate.prompt}")
        print(f"completion : {text.strip()}")
        print(f"speed      : {len(token_ids)} tokens in {seconds:.2f} s = "
              f"{len(token_ids) / max(seconds, 1e-9):.1f} tokens/s (greedy, {how})")
    shutdown()
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except (ConfigError, FileNotFoundError, AssetError, UnsupportedModelError) as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
