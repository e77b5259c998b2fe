"""Tasks: where prompts, reference answers and verifiers come from.

* ``chat``: ``Prompt`` (the one prompt type), ``build_messages``, ``chat_token_ids``;
* ``answers``: ``extract`` (the one answer extractor) and the normalisations the
  verifiers compare with;
* ``reasoning_gym``: reasoning-gym dataset creation with presets and seed striding,
  chat-templated prompts, and scoring by a task's own verifier.

The RL data pipeline (``rl.data``), the verifiers (``rl.rewards``), the drafter
warm-up and the tools import these public names from here.
"""

from .answers import EXTRACTION_MODES, extract, normalize_exact, normalize_number
from .chat import Prompt, ScoreFn, build_messages, chat_token_ids
from .reasoning_gym import (
    DEFAULT_INSTRUCTION,
    DEFAULT_TASK,
    SEED_STRIDE,
    TASK_PRESETS,
    TaskError,
    available_tasks,
    make_dataset,
    reasoning_gym_prompts,
    score,
    task_config,
    task_scorer,
)

__all__ = ["Prompt", "ScoreFn", "build_messages", "chat_token_ids", "EXTRACTION_MODES",
           "extract", "normalize_exact", "normalize_number", "TaskError", "DEFAULT_TASK",
           "DEFAULT_INSTRUCTION", "TASK_PRESETS", "SEED_STRIDE", "available_tasks",
           "task_config", "make_dataset", "task_scorer", "reasoning_gym_prompts", "score"]
