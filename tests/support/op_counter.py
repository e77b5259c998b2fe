"""A ``TorchFunctionMode`` counting torch calls: tests that a step's device work does
not grow with its rows (no Python loop over rows launching per-row operations)."""

from __future__ import annotations

from torch.overrides import TorchFunctionMode


class OpCounter(TorchFunctionMode):
    """Counts torch function and tensor method calls (the outermost ones)."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.count += 1
        return func(*args, **(kwargs or {}))
