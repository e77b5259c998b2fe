"""What the fork server of ``zygote.py`` imports before it forks any run: the modules a
project process imports first, with megatron-core's expected import notices silenced as
every entry point silences them."""

from megatron_tlt.runtime_env import silence_expected_warnings

silence_expected_warnings()

import matplotlib  # noqa: E402,F401
import megatron.core  # noqa: E402,F401
import megatron.core.models.gpt  # noqa: E402,F401
import megatron.core.optimizer  # noqa: E402,F401
import numpy  # noqa: E402,F401
import omegaconf  # noqa: E402,F401
import psutil  # noqa: E402,F401
import reasoning_gym  # noqa: E402,F401
import rich  # noqa: E402,F401
import safetensors.torch  # noqa: E402,F401
import torch  # noqa: E402,F401
import tokenizers  # noqa: E402,F401
import torch._dynamo  # noqa: E402,F401  (transformers' model classes import it)
import torch.distributed  # noqa: E402,F401
import transformers  # noqa: E402,F401
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402,F401

import megatron_tlt.config  # noqa: E402,F401
import megatron_tlt.launch  # noqa: E402,F401
import megatron_tlt.models  # noqa: E402,F401
import megatron_tlt.rl.trainer  # noqa: E402,F401
