"""SteerLM2Trainer for Python: one SteerLM 2.0 iteration on sampled, scored responses."""

from __future__ import annotations

from typing import Any, Dict

from nemo_aligner.trainers.base import BaseTrainer
from nemo_aligner.trainers.datasets import resolve_dataset

_EXTRA = ("micro_batch_size", "forward_micro_batch_size", "seed", "output_dir", "precision", "val_check_interval",
          "overrides", "use_wandb", "tensor_parallel_size", "pipeline_parallel_size", "max_sequence_length")


class SteerLM2Trainer(BaseTrainer):
    """``SteerLM2Trainer.from_pretrained(steerlm_model, batch_size=16, learning_rate=1e-5)`` then
    ``fit(dataset)`` with the records ``generate_steerlm2_data.py`` writes (a jsonl path or a list of
    ``{"system", "prompt_turns", "label", "responses": [{"value", "log(P(a|x,y))", "log(P(y|x))",
    "log(Q(y|a,x))"}, ...]}``); ``batch_size`` counts records."""

    algorithm = "steerlm2"
    config_name = "gpt_sft"
    section_rules = {"forward_micro_batch_size": ("int", (1, False))}

    @classmethod
    def from_pretrained(cls, model_name_or_path: str, batch_size: int = 16, learning_rate: float = 1e-5,
                        **kwargs) -> "SteerLM2Trainer":
        return cls._pretrained(model_name_or_path, learning_rate, 512, {"batch_size": batch_size}, kwargs, _EXTRA)

    def _values(self, dataset, run_dir: str, max_steps=None, max_epochs=None, val_dataset=None) -> Dict[str, Any]:
        policy, s2 = self._config["policy"], dict(self._config.get("steerlm2") or {})
        train, val = resolve_dataset(dataset, val_dataset)
        batch = int(s2.get("batch_size", 16))
        rows = int(s2.get("micro_batch_size", 8))
        return {
            "model.restore_from_path": self.model_path,
            "model.data.chat": True,
            "model.data.train_ds.file_path": self._write(run_dir, "train", train),
            "model.data.validation_ds.file_path": self._write(run_dir, "validation", val or train),
            "model.data.train_ds.global_batch_size": batch,
            "model.data.train_ds.micro_batch_size": 1,
            "model.data.validation_ds.global_batch_size": batch,
            "model.data.validation_ds.micro_batch_size": 1,
            "model.steerlm2.micro_batch_size": rows,
            "model.steerlm2.forward_micro_batch_size": int(s2.get("forward_micro_batch_size", rows)),
            "model.encoder_seq_length": int(policy.get("max_total_sequence_length", 512)),
            "model.optim.lr": float(policy.get("learning_rate", 1e-5)),
            "model.tensor_model_parallel_size": int(s2.get("tensor_parallel_size", 1)),
            "model.pipeline_model_parallel_size": int(s2.get("pipeline_parallel_size", 1)),
            "model.seed": int(s2.get("seed", 1234)),
            "trainer.sft.max_steps": int(max_steps) if max_steps is not None else -1,
            "trainer.sft.max_epochs": int(max_epochs) if max_epochs is not None else (1000000 if max_steps else 1),
            "trainer.sft.val_check_interval": s2.get("val_check_interval", 1.0),
            "exp_manager.create_checkpoint_callback": True,
        }

    def _run(self, cfg, hooks, **_) -> Dict[str, Any]:
        from nemo_aligner.recipes.steerlm2 import run_steerlm2

        return run_steerlm2(cfg, callbacks=hooks)
