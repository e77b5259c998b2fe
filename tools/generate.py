#!/usr/bin/env python
"""Generate a chat completion with a megatron-core model through megatron_tlt.

    python tools/generate.py model.hf_path=smollm2 generate.prompt="What is 2+3?"
    torchrun --nproc_per_node 2 tools/generate.py --config examples/rl/smollm2_cpu.yaml \
        parallel.tensor_model_parallel_size=2

Greedy, one prompt, through the rollout engine (KV cache, megatron_tlt.rollout) at any
tensor and pipeline parallelism.
"""

from __future__ import annotations

import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_tlt.assets import AssetError  # noqa: E402
from megatron_tlt.config import ConfigError, parse_args  # noqa: E402
from megatron_tlt.models.gpt import UnsupportedModelError  # noqa: E402


def main(argv=None) -> int:
    cfg = parse_args(argv, description=__doc__.splitlines()[1])
    from megatron_tlt.platform import silence_expected_warnings

    silence_expected_warnings()
    from megatron_tlt.launch import setup, shutdown
    from megatron_tlt.rollout import RolloutEngine, SamplingParams

    session = setup(cfg)
    tok = session.tokenizer
    messages = [{"role": "user", "content": cfg.generate.prompt}]
    prompt_ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    if not isinstance(prompt_ids, list):  # transformers 5 returns a BatchEncoding
        prompt_ids = list(prompt_ids["input_ids"])
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
