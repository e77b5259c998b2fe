"""megatron_tlt: a megatron-core RL trainer with TLT rollouts (docs/architecture.md)."""

from . import import_costs as _import_costs

_import_costs.install()  # before anything imports megatron-core (import_costs.py)
