"""Algorithm registry of the Python API: ``list_algorithms()``, ``get_algorithm(name)``,
``create_trainer(name, model=..., **kwargs)``, ``register_algorithm(name, "module:Class")``."""

from __future__ import annotations

import importlib
from typing import Dict, List, Type, Union

from nemo_aligner.utils.errors import ConfigError

_REGISTRY: Dict[str, Union[str, Type]] = {}


def register_algorithm(name: str, trainer: Union[str, Type]) -> None:
    """Register a trainer class (or its ``"module:Class"`` path, imported on first use) under ``name``."""
    _REGISTRY[name.lower()] = trainer


def list_algorithms() -> List[str]:
    return sorted(_REGISTRY)


def get_algorithm(name: str) -> Type:
    key = str(name).lower()
    if key not in _REGISTRY:
        raise ConfigError(f"unknown algorithm {name!r}; registered: {list_algorithms()}")
    target = _REGISTRY[key]
    if isinstance(target, str):
        module, _, attr = target.partition(":")
        target = getattr(importlib.import_module(module), attr)
        _REGISTRY[key] = target
    return target


def create_trainer(name: str, model: str, **kwargs):
    """``get_algorithm(name).from_pretrained(model, **kwargs)``."""
    return get_algorithm(name).from_pretrained(model, **kwargs)


register_algorithm("sft", "nemo_aligner.trainers.sft:SFTTrainer")
register_algorithm("dpo", "nemo_aligner.trainers.dpo:DPOTrainer")
register_algorithm("grpo", "nemo_aligner.trainers.grpo:GRPOTrainer")
