"""Run checkpoints: the whole run state, saved safely and resumed exactly.

``RunState`` (``state``) gathers what a resumed run needs; ``save`` / ``load`` /
``latest`` (``store``) write and read ``step_N`` folders: the policy through
megatron-core ``dist_checkpointing`` (``sharded``: each shard once, resharded to
another TP/PP/DP size on load), everything else as JSON and safetensors
(``safe_files``: no checkpoint file can execute code). See ``store`` for the layout.
``Saver`` (``background``) runs a training loop's saves, synchronous or asynchronous
(the policy's shards written in the background, the checkpoint published later).
"""

from .background import Saver, async_enabled
from .safe_files import CheckpointError
from .state import RunState, rng_state, set_rng_state
from .store import choose, latest, load, prune, save, steps, verify

__all__ = ["CheckpointError", "RunState", "Saver", "async_enabled", "choose", "latest", "load",
           "prune", "rng_state", "save", "set_rng_state", "steps", "verify"]
