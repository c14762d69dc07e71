"""DPOTrainer: DPO (and IPO/RPO via ``loss``) from Python."""

from __future__ import annotations

from typing import Any, Dict

from nemo_aligner.trainers.base import BaseTrainer
from nemo_aligner.trainers.datasets import preference_records, resolve_dataset

_EXTRA = ("micro_batch_size", "seed", "output_dir", "precision", "val_check_interval", "overrides", "use_wandb",
          "tensor_parallel_size", "pipeline_parallel_size", "loss", "sft_loss_weight", "max_sequence_length")


class DPOTrainer(BaseTrainer):
    """``DPOTrainer.from_pretrained(path, batch_size=32, learning_rate=1e-6, beta=0.1)`` then
    ``fit(dataset)`` with ``{"prompt", "chosen_response"|"chosen", "rejected_response"|"rejected"}``."""

    algorithm = "dpo"
    config_name = "gpt_dpo"
    section_rules = {"beta": ("float", (0.0, True)), "loss": ("str", None), "sft_loss_weight": ("float", (0.0, False))}

    @classmethod
    def from_pretrained(cls, model_name_or_path: str, batch_size: int = 32, learning_rate: float = 1e-6,
                        beta: float = 0.1, **kwargs) -> "DPOTrainer":
        return cls._pretrained(model_name_or_path, learning_rate, 512, {"batch_size": batch_size, "beta": beta}, kwargs,
                               _EXTRA)

    def _values(self, dataset, run_dir: str, max_steps=None, max_epochs=None, val_dataset=None) -> Dict[str, Any]:
        policy, dpo = self._config["policy"], dict(self._config.get("dpo") or {})
        train, val = resolve_dataset(dataset, val_dataset)
        train = preference_records(train)
        val = preference_records(val, "val_dataset") if val else train
        batch = int(dpo.get("batch_size", 32))
        return {
            "pretrained_checkpoint.restore_from_path": self.model_path,
            "model.data.data_prefix": {"train": [self._write(run_dir, "train", train)],
                                       "validation": [self._write(run_dir, "validation", val)]},
            "model.global_batch_size": batch,
            "model.micro_batch_size": int(dpo.get("micro_batch_size", min(batch, 4))),
            "model.encoder_seq_length": int(policy.get("max_total_sequence_length", 512)),
            "model.optim.lr": float(policy.get("learning_rate", 1e-6)),
            "model.dpo.ref_policy_kl_penalty": float(dpo.get("beta", 0.1)),
            "model.dpo.preference_loss": str(dpo.get("loss", "dpo")),
            "model.dpo.sft_loss_weight": float(dpo.get("sft_loss_weight", 0.0)),
            "model.tensor_model_parallel_size": int(dpo.get("tensor_parallel_size", 1)),
            "model.pipeline_model_parallel_size": int(dpo.get("pipeline_parallel_size", 1)),
            "model.seed": int(dpo.get("seed", 1234)),
            "trainer.dpo.max_steps": int(max_steps) if max_steps is not None else -1,
            "trainer.dpo.max_epochs": int(max_epochs) if max_epochs is not None else (1000000 if max_steps else 1),
            "trainer.dpo.val_check_interval": dpo.get("val_check_interval", 1.0),
        }

    def _run(self, cfg, hooks, **_) -> Dict[str, Any]:
        from nemo_aligner.recipes.dpo import run_dpo

        return run_dpo(cfg, callbacks=hooks)
