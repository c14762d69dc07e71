"""Faster start-up: what megatron-core does while it imports, deferred until it is used.

megatron-core 0.16 decorates ~20 small fusion kernels with ``torch.compile`` (``megatron.core.jit``)
while it imports. The decorator itself imports ``torch._dynamo`` and inductor: 2-3 s of every
process's start on a CPU, spent even though the local layer spec and our config never call most of
those kernels. While ``megatron.core`` imports, ``torch.compile(fn)`` on a plain function returns a
thin wrapper that calls the real ``torch.compile`` the first time it runs. torch compiles lazily
anyway (on the first call), so what runs is unchanged; only the import of the compiler waits until
a kernel is used. ``torch.compile`` is restored as soon as the import ends.

megatron-core 0.16's inference context also imports ``wandb`` (~0.5 s) only to note that it is
installed. While ``megatron.core`` imports, ``import wandb`` finds a stand-in module that imports the
real one on its first attribute read; once the import ends the stand-in leaves ``sys.modules``, so
any later ``import wandb`` gets the real module.

``install()`` (called by ``nemo_aligner/__init__.py``) adds a one-shot import hook for
``megatron.core``; it does nothing if megatron-core was imported first.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.abc
import importlib.machinery
import importlib.util
import inspect
import sys
import types


def compile_on_first_call(real_compile):
    """A stand-in for ``torch.compile``: plain functions are compiled by ``real_compile`` on their
    first call; anything else (modules, callables) goes to ``real_compile`` at once."""

    def deferred(model=None, **options):
        if model is None:  # used as @torch.compile(**options)
            return lambda fn: deferred(fn, **options)
        if not inspect.isfunction(model):
            return real_compile(model, **options)
        compiled = None

        @functools.wraps(model)
        def call(*args, **kwargs):
            nonlocal compiled
            import torch

            if torch.compiler.is_compiling():  # inside a compiled caller: let it trace the function
                return model(*args, **kwargs)
            if compiled is None:
                compiled = real_compile(model, **options)
            return compiled(*args, **kwargs)

        call.__wrapped_uncompiled__ = model
        return call

    return deferred


@contextlib.contextmanager
def deferred_torch_compile():
    """Within the block, ``torch.compile`` decorates plain functions without importing the compiler."""
    import torch

    real = torch.compile
    torch.compile = compile_on_first_call(real)
    try:
        yield
    finally:
        torch.compile = real


class ModuleOnFirstUse(types.ModuleType):
    """Stands in for a module not imported yet: the first attribute it lacks imports the real module
    (taking the stand-in out of ``sys.modules`` first) and is read from there. ``__file__`` and
    ``__spec__`` are its own, so scans of ``sys.modules`` (``inspect.getmodule``) import nothing."""

    def __init__(self, spec):
        super().__init__(spec.name)
        self.__spec__, self.__loader__, self.__file__ = spec, spec.loader, spec.origin

    def __getattr__(self, attr):
        name = self.__spec__.name
        if sys.modules.get(name) is self:
            del sys.modules[name]
        return getattr(importlib.import_module(name), attr)


@contextlib.contextmanager
def deferred_modules(*names):
    """Within the block, ``import name`` of a module not imported yet gives a ``ModuleOnFirstUse``;
    stand-ins still unused when the block ends leave ``sys.modules``. A module that is not installed
    stays unimportable (its ``ImportError`` is what importers test for)."""
    placed = {}
    for name in names:
        spec = None if name in sys.modules else importlib.util.find_spec(name)
        if spec is not None:
            placed[name] = sys.modules[name] = ModuleOnFirstUse(spec)
    try:
        yield
    finally:
        for name, stand_in in placed.items():
            if sys.modules.get(name) is stand_in:
                del sys.modules[name]


@contextlib.contextmanager
def megatron_import_deferrals():
    """What an import of megatron-core modules defers: ``torch.compile``'s compiler and ``wandb``.
    Also for megatron-core modules imported after ``megatron.core`` itself (the CPU patches import
    its inference modules, whose dynamic engine imports ``wandb``)."""
    with deferred_torch_compile(), deferred_modules("wandb"):
        yield


class _DeferCompileLoader(importlib.abc.Loader):
    """Runs the wrapped loader's ``exec_module`` under ``megatron_import_deferrals``."""

    def __init__(self, loader):
        self._loader = loader

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module):
        module.__loader__ = self._loader
        if module.__spec__ is not None:
            module.__spec__.loader = self._loader
        with megatron_import_deferrals():
            self._loader.exec_module(module)

    def __getattr__(self, name):
        return getattr(self._loader, name)


class _MegatronCoreHook(importlib.abc.MetaPathFinder):
    """Finds ``megatron.core`` once, with the loader wrapped; then takes itself off ``sys.meta_path``."""

    def find_spec(self, name, path=None, target=None):
        if name != "megatron.core":
            return None
        with contextlib.suppress(ValueError):
            sys.meta_path.remove(self)
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is not None and spec.loader is not None:
            spec.loader = _DeferCompileLoader(spec.loader)
        return spec


def install() -> None:
    """Defer megatron-core's import-time ``torch.compile`` and ``wandb`` (see the module docstring)."""
    if "megatron.core" in sys.modules or any(isinstance(f, _MegatronCoreHook) for f in sys.meta_path):
        return
    sys.meta_path.insert(0, _MegatronCoreHook())
