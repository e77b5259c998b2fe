#!/usr/bin/env python
"""Measure the response-length distribution of a reasoning-gym workload on SmolLM2.

    python tools/workload_lengths.py --n 16 --max-new-tokens 256
    python tools/workload_lengths.py --task chain_sum --no-preset --task-arg max_terms=3 \
        --json /tmp/chain_sum.json

Greedy decoding with Hugging Face transformers (``AutoModelForCausalLM.generate``,
float32, left padding, stop at the tokenizer's EOS ``<|im_end|>``), prompts from
``megatron_tlt.tasks.reasoning_gym_prompts``. A response's length is the
number of tokens generated before EOS, so a length equal to ``--max-new-tokens``
means the response was truncated. Prints the length summary and the accuracy by
the task's verifier; ``--json`` also saves every response.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any, Sequence

from megatron_tlt.assets import AssetError, require_smollm2
from megatron_tlt.bench.workload import WorkloadError, format_length_stats, length_stats
from megatron_tlt.tasks import (
    DEFAULT_INSTRUCTION,
    DEFAULT_TASK,
    TaskError,
    extract,
    reasoning_gym_prompts,
    score,
)


def parse_task_arg(text: str) -> tuple[str, Any]:
    """``key=value`` with the value read as JSON when possible (``3`` -> 3, ``[1]``), else a string."""
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    try:
        return key, json.loads(value)
    except json.JSONDecodeError:
        return key, value


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--n", type=int, default=16, help="number of prompts (default 16)")
    p.add_argument("--max-new-tokens", type=int, default=256, help="length cap (default 256)")
    p.add_argument("--task", default=DEFAULT_TASK, help=f"reasoning-gym task (default {DEFAULT_TASK})")
    p.add_argument("--seed", type=int, default=0, help="dataset seed (default 0)")
    p.add_argument("--task-arg", type=parse_task_arg, action="append", default=[], metavar="KEY=VALUE",
                   help="task parameter, overrides the preset (repeatable)")
    p.add_argument("--no-preset", action="store_true", help="use reasoning-gym's task defaults")
    p.add_argument("--instruction", default=DEFAULT_INSTRUCTION,
                   help="suffix appended to each question ('' for none)")
    p.add_argument("--batch-size", type=int, default=0, help="prompts per generate call (default: all)")
    p.add_argument("--model", type=Path, default=None, help="HF folder (default: prepared SmolLM2)")
    p.add_argument("--threads", type=int, default=0, help="torch threads (default: torch's choice)")
    p.add_argument("--json", type=Path, default=None, metavar="PATH", help="write results as JSON")
    return p


def trim_at_stop(token_ids: Sequence[int], stop_ids: set[int]) -> tuple[list[int], bool]:
    """Tokens before the first stop token, and whether a stop token was found."""
    for i, tok in enumerate(token_ids):
        if tok in stop_ids:
            return list(token_ids[:i]), True
    return list(token_ids), False


def generate_greedy(model, tokenizer, prompts: list[list[int]], max_new_tokens: int,
                    stop_ids: set[int]) -> list[tuple[list[int], bool]]:
    """Greedy completions of a batch of prompt ids (left padded), trimmed at EOS."""
    import torch

    width = max(len(p) for p in prompts)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else min(stop_ids)
    input_ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    attention_mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    with torch.inference_mode():
        out = model.generate(
            input_ids=input_ids,
            attention_mask=attention_mask,
            max_new_tokens=max_new_tokens,
            do_sample=False,
            eos_token_id=sorted(stop_ids),
            pad_token_id=pad,
        )
    return [trim_at_stop(row[width:].tolist(), stop_ids) for row in out]


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.max_new_tokens < 1 or args.batch_size < 0:
        raise WorkloadError("--max-new-tokens must be >= 1 and --batch-size >= 0")

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if args.threads:
        torch.set_num_threads(args.threads)
    model_dir = args.model if args.model is not None else require_smollm2()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    prompts = reasoning_gym_prompts(
        tokenizer, args.task, n=args.n, seed=args.seed, instruction=args.instruction or None,
        use_preset=not args.no_preset, **dict(args.task_arg),
    )
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    stop_ids = {tokenizer.eos_token_id}

    batch = args.batch_size or len(prompts)
    start = time.monotonic()
    completions: list[tuple[list[int], bool]] = []
    for i in range(0, len(prompts), batch):
        chunk = prompts[i:i + batch]
        completions += generate_greedy(model, tokenizer, [p.token_ids for p in chunk],
                                       args.max_new_tokens, stop_ids)
        print(f"[workload] {len(completions)}/{len(prompts)} done "
              f"({time.monotonic() - start:.0f} s)", file=sys.stderr)
    seconds = time.monotonic() - start

    records = []
    for prompt, (ids, finished) in zip(prompts, completions):
        text = tokenizer.decode(ids, skip_special_tokens=True)
        records.append({
            "question": prompt.question, "answer": prompt.answer, "length": len(ids),
            "finished": finished, "extracted": extract(text),
            "score": score(prompt, text), "response": text,
        })
    lengths = [r["length"] for r in records]
    stats = length_stats(lengths, cap=args.max_new_tokens)
    correct = sum(r["score"] == 1.0 for r in records)

    print(f"task {args.task}  params {prompts[0].entry['metadata'].get('difficulty', {})}  "
          f"seed {args.seed}  instruction {args.instruction!r}")
    print(f"lengths (sorted): {sorted(lengths)}")
    print(format_length_stats(stats, cap=args.max_new_tokens))
    print(f"accuracy {correct}/{len(records)} ({correct / len(records):.0%})  "
          f"generation {seconds:.0f} s, {sum(lengths) / seconds:.1f} tok/s")
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({
            "task": args.task, "seed": args.seed, "n": args.n, "instruction": args.instruction,
            "preset": not args.no_preset, "task_args": dict(args.task_arg),
            "max_new_tokens": args.max_new_tokens, "model": str(model_dir),
            "stats": stats, "accuracy": correct / len(records), "seconds": seconds,
            "records": records,
        }, indent=2) + "\n")
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except (WorkloadError, TaskError, AssetError) as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
