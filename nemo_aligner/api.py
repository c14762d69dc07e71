"""Algorithm registry of the Python API: ``list_algorithms()``, ``get_algorithm(name)``,
``create_trainer(name, model=..., **kwargs)``, ``register_algorithm(name, "module:Class")``."""

from __future__ import annotations

import importlib
from typing import Dict, List, Type, Union

from nemo_aligner.utils.errors import ConfigError

_REGISTRY: Dict[str, Union[str, Type]] = {}


def register_algorithm(name: str, trainer: Union[str, Type], replace: bool = False) -> None:
    """Register a trainer class (or its ``"module:Class"`` path, imported on first use) under ``name``;
    ``replace=True`` to take over a name already registered (a built-in one included)."""
    key = str(name).lower()
    if key in _REGISTRY and not replace:
        raise ConfigError(f"algorithm {name!r} is already registered ({_REGISTRY[key]!r}); pass replace=True to "
                          "replace it")
    if isinstance(trainer, str) and ":" not in trainer:
        raise ConfigError(f"register_algorithm({name!r}, {trainer!r}): expected 'package.module:Class'")
    _REGISTRY[key] = trainer


def list_algorithms() -> List[str]:
    return sorted(_REGISTRY)


def get_algorithm(name: str) -> Type:
    key = str(name).lower()
    if key not in _REGISTRY:
        raise ConfigError(f"unknown algorithm {name!r}; registered: {list_algorithms()}")
    target = _REGISTRY[key]
    if isinstance(target, str):
        module, _, attr = target.partition(":")
        try:
            target = getattr(importlib.import_module(module), attr)
        except ImportError as err:
            raise ConfigError(f"algorithm {name!r}: cannot import {module!r} ({err})") from None
        except AttributeError:
            raise ConfigError(f"algorithm {name!r}: module {module!r} has no {attr!r}") from None
        _REGISTRY[key] = target
    if not callable(getattr(target, "from_pretrained", None)):
        raise ConfigError(f"algorithm {name!r}: {target!r} is not a trainer class (it has no from_pretrained)")
    return target


def create_trainer(name: str, model: str, **kwargs):
    """``get_algorithm(name).from_pretrained(model, **kwargs)``."""
    return get_algorithm(name).from_pretrained(model, **kwargs)


def _register_builtin() -> None:
    from nemo_aligner.trainers import ALGORITHMS

    for name, (cls, module) in ALGORITHMS.items():
        register_algorithm(name, f"nemo_aligner.trainers.{module}:{cls}")


_register_builtin()
