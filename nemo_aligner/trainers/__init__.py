"""The Python API's trainers (``SFTTrainer``, ``DPOTrainer``, ``GRPOTrainer``), loaded on first use."""

# The one list of the API's trainers: algorithm name -> (class, module of this package). The
# registry (``nemo_aligner.api``) and ``from nemo_aligner import SFTTrainer`` both read it.
ALGORITHMS = {"sft": ("SFTTrainer", "sft"), "dpo": ("DPOTrainer", "dpo"), "grpo": ("GRPOTrainer", "grpo"),
              "rs": ("RejectionSamplingTrainer", "rs"), "spin": ("SelfPlayTrainer", "spin"),
              "kd": ("KnowledgeDistillationTrainer", "kd"), "steerlm2": ("SteerLM2Trainer", "steerlm2")}
_EXPORTS = {"BaseTrainer": "base", "TrainingResult": "base", **dict(ALGORITHMS.values())}


def __getattr__(name):
    if name in _EXPORTS:
        import importlib

        return getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = list(_EXPORTS)
