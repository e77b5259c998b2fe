"""Start-up cost of a process: two imports megatron-core makes eagerly, made lazy.

Every rank, every test worker and every tool imports megatron-core, and two of its
imports cost more CPU than the rest of the package together while doing nothing until
used (2-core Xeon, ``import megatron.core.models.gpt``: 8.7 CPU seconds, 5.6 with both
deferred; docs/testing.md "Start-up"):

- ``megatron.core.jit`` sets ``jit_fuser = torch.compile`` and its fusion modules
  decorate functions with it at import. ``torch.compile(fn)`` compiles nothing until
  ``fn`` is called, but it imports TorchDynamo and Inductor on the spot (~3 CPU s).
  ``install`` swaps in ``lazy_compile``: the same ``torch.compile(fn, ...)`` call, made
  at the first call of ``fn``. What runs, and when it compiles, do not change.
- ``wandb`` is imported by megatron-core's timers and inference context for optional
  metric hooks (~0.5 CPU s). ``install`` makes ``import wandb`` return a stand-in
  module that runs the real import at its first attribute read (or the first import of
  a ``wandb.`` submodule) and from then on is the real module's namespace, so
  ``tracking``'s run logging is unchanged and a run without wandb never loads it. (The
  standard library's ``LazyLoader`` would not do: Python 3.11's ``import`` statement
  reads ``__spec__``, which loads it at the second ``import wandb``.)

``install`` is called by the package's ``__init__`` before anything imports
megatron-core; a process that imports megatron-core first keeps the eager imports.
``MEGATRON_TLT_EAGER_IMPORTS=1`` turns both off.
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys
import types

__all__ = ["install", "installed", "lazy_compile"]

_JIT = "megatron.core.jit"
_LAZY_MODULES = ("wandb",)
_finder = None


def lazy_compile(fn=None, **options):
    """``torch.compile(fn, **options)`` made at ``fn``'s first call (also as
    ``@lazy_compile(**options)``)."""
    if fn is None:
        return functools.partial(lazy_compile, **options)
    compiled = None

    @functools.wraps(fn)
    def call(*args, **kwargs):
        nonlocal compiled
        if compiled is None:
            import torch

            compiled = torch.compile(fn, **options)
        return compiled(*args, **kwargs)

    call.lazy_compile_target = fn
    return call


_SHADOWED = ("__path__", "__file__")  # set to None until the load (import reads them)


class _Deferred(types.ModuleType):
    """A module's stand-in until an attribute it lacks is read: then the real module
    is executed and replaces it in ``sys.modules``, and every read or write through
    the stand-in goes to the real module."""

    def __getattr__(self, attr):
        return getattr(self._deferred_load(), attr)

    def __setattr__(self, attr, value):
        real = self.__dict__.get("_deferred_real")
        if real is None:
            super().__setattr__(attr, value)
        else:
            setattr(real, attr, value)

    def _deferred_load(self):
        real = self.__dict__.get("_deferred_real")
        if real is None:
            spec = self.__spec__.loader_state
            real = importlib.util.module_from_spec(spec)
            sys.modules[self.__name__] = real
            try:
                spec.loader.exec_module(real)
            except BaseException:
                sys.modules[self.__name__] = self
                raise
            for name in _SHADOWED:
                self.__dict__.pop(name, None)
            self.__dict__["_deferred_real"] = real
        return real


class _DeferredLoader(importlib.abc.Loader):
    def create_module(self, spec):
        module = _Deferred(spec.name)
        for name in _SHADOWED:
            module.__dict__[name] = None
        return module

    def exec_module(self, module):
        pass


class _Finder(importlib.abc.MetaPathFinder):
    """Runs ``megatron.core.jit`` as usual, then points its ``jit_fuser`` at
    ``lazy_compile`` if it chose ``torch.compile``; defers ``wandb``."""

    def find_spec(self, name, path, target=None):
        parent = sys.modules.get(name.partition(".")[0])
        if isinstance(parent, _Deferred):  # a submodule's import loads the package
            real = parent._deferred_load()
            return importlib.machinery.PathFinder.find_spec(name, real.__path__)
        if name != _JIT and name not in _LAZY_MODULES:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return spec
        if name in _LAZY_MODULES:
            return importlib.machinery.ModuleSpec(name, _DeferredLoader(), loader_state=spec)
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            import torch

            if getattr(module, "jit_fuser", None) is torch.compile:
                module.jit_fuser = lazy_compile

        spec.loader.exec_module = exec_module
        return spec


def install() -> bool:
    """Defer the two imports for the rest of this process (idempotent). False when
    ``MEGATRON_TLT_EAGER_IMPORTS=1`` or megatron-core was already imported."""
    global _finder
    if _finder is not None:
        return True
    if os.environ.get("MEGATRON_TLT_EAGER_IMPORTS", "") not in ("", "0"):
        return False
    if _JIT in sys.modules:
        return False
    _finder = _Finder()
    sys.meta_path.insert(0, _finder)
    return True


def installed() -> bool:
    return _finder is not None
