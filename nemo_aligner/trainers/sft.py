"""SFTTrainer: supervised fine-tuning from Python."""

from __future__ import annotations

from typing import Any, Dict

from nemo_aligner.trainers.base import BaseTrainer
from nemo_aligner.trainers.datasets import resolve_dataset, sft_records

_EXTRA = ("micro_batch_size", "seed", "output_dir", "precision", "val_check_interval", "overrides", "use_wandb",
          "tensor_parallel_size", "pipeline_parallel_size", "answer_only_loss")


class SFTTrainer(BaseTrainer):
    """``SFTTrainer.from_pretrained(path, batch_size=32, learning_rate=2e-5)`` then ``fit(dataset)``;
    a dataset of ``{"input", "output"}`` (or ``{"prompt", "completion"}``) pairs, or whole texts."""

    algorithm = "sft"
    config_name = "gpt_sft"
    section_rules = {"answer_only_loss": ("bool", None)}

    @classmethod
    def from_pretrained(cls, model_name_or_path: str, batch_size: int = 32, learning_rate: float = 2e-5,
                        max_sequence_length: int = 512, **kwargs) -> "SFTTrainer":
        return cls._pretrained(model_name_or_path, learning_rate, max_sequence_length, {"batch_size": batch_size},
                               kwargs, _EXTRA)

    def _values(self, dataset, run_dir: str, max_steps=None, max_epochs=None, val_dataset=None) -> Dict[str, Any]:
        policy, sft = self._config["policy"], dict(self._config.get("sft") or {})
        train, val = resolve_dataset(dataset, val_dataset)
        train, whole = sft_records(train)
        val = sft_records(val, "val_dataset")[0] if val else train
        batch = int(sft.get("batch_size", 32))
        values = {
            "model.restore_from_path": self.model_path,
            "model.data.train_ds.file_path": self._write(run_dir, "train", train),
            "model.data.validation_ds.file_path": self._write(run_dir, "validation", val),
            "model.data.train_ds.global_batch_size": batch,
            "model.data.train_ds.micro_batch_size": int(sft.get("micro_batch_size", min(batch, 8))),
            "model.data.validation_ds.global_batch_size": batch,
            "model.data.validation_ds.micro_batch_size": int(sft.get("micro_batch_size", min(batch, 8))),
            "model.encoder_seq_length": int(policy.get("max_total_sequence_length", 512)),
            "model.optim.lr": float(policy.get("learning_rate", 2e-5)),
            "model.tensor_model_parallel_size": int(sft.get("tensor_parallel_size", 1)),
            "model.pipeline_model_parallel_size": int(sft.get("pipeline_parallel_size", 1)),
            "model.answer_only_loss": bool(sft.get("answer_only_loss", not whole)),
            "model.seed": int(sft.get("seed", 1234)),
            "trainer.sft.max_steps": int(max_steps) if max_steps is not None else -1,
            "trainer.sft.max_epochs": int(max_epochs) if max_epochs is not None else (1000000 if max_steps else 1),
            "trainer.sft.val_check_interval": sft.get("val_check_interval", 1.0),
            "exp_manager.create_checkpoint_callback": True,
        }
        if whole:
            values["model.data.train_ds.prompt_template"] = "{input}{output}"
            values["model.data.validation_ds.prompt_template"] = "{input}{output}"
        return values

    def _run(self, cfg, hooks, **_) -> Dict[str, Any]:
        from nemo_aligner.recipes.sft import run_sft

        return run_sft(cfg, callbacks=hooks)
