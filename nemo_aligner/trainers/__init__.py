"""The Python API's trainers (``SFTTrainer``, ``DPOTrainer``, ``GRPOTrainer``), loaded on first use."""

_EXPORTS = {"BaseTrainer": "base", "TrainingResult": "base", "SFTTrainer": "sft", "DPOTrainer": "dpo",
            "GRPOTrainer": "grpo"}


def __getattr__(name):
    if name in _EXPORTS:
        import importlib

        return getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = list(_EXPORTS)
