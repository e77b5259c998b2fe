"""A tiny random policy with SmolLM2's real tokenizer and chat template, for RL tests.

Real prompts (reasoning-gym through the chat template) need a real tokenizer; a tiny
Llama with SmolLM2's 49,152-token vocabulary keeps every forward cheap.
"""

from __future__ import annotations

import shutil
from pathlib import Path

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "chat_template.jinja", "generation_config.json")


def save_tiny_policy(folder: Path, smollm2_dir: Path, seed: int = 0, layers: int = 2) -> Path:
    from tiny_models import save_tiny_hf

    folder = Path(folder)
    save_tiny_hf("llama_tied", folder, seed=seed, vocab_size=49152, num_hidden_layers=layers,
                 max_position_embeddings=2048, bos_token_id=1, eos_token_id=2)
    for name in TOKENIZER_FILES:
        src = Path(smollm2_dir) / name
        if src.exists():
            shutil.copy(src, folder / name)
    return folder
