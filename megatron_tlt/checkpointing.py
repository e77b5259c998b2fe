"""The run-checkpoint API under its earlier module name (see ``megatron_tlt.checkpoint``)."""

from .checkpoint import *  # noqa: F401,F403
from .checkpoint import __all__  # noqa: F401
