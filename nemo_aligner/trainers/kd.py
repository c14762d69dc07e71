"""KnowledgeDistillationTrainer for Python: a student trained towards a teacher's top-k logits."""

from __future__ import annotations

from typing import Any, Dict

from nemo_aligner.trainers.base import BaseTrainer
from nemo_aligner.trainers.datasets import resolve_dataset

_EXTRA = ("micro_batch_size", "seed", "output_dir", "precision", "val_check_interval", "overrides", "use_wandb",
          "tensor_parallel_size", "pipeline_parallel_size", "max_sequence_length", "kd_loss", "kd_loss_weight",
          "sft_loss_weight", "top_k", "target_logits_scale", "logits_scale")


class KnowledgeDistillationTrainer(BaseTrainer):
    """``KnowledgeDistillationTrainer.from_pretrained(student, batch_size=32, learning_rate=3e-5,
    kd_loss="fwd_kl")`` then ``fit(dataset)`` with the records ``compute_topk_logits.py`` writes (a
    jsonl path or a list of ``{"tokens", "labels", "loss_mask", "topk_logits", "topk_token_ids"}``)."""

    algorithm = "kd"
    config_name = "gpt_knowledge_distillation"
    section_rules = {"kd_loss": ("str", None), "kd_loss_weight": ("float", (0.0, False)),
                     "sft_loss_weight": ("float", (0.0, False)), "top_k": ("int", (1, False)),
                     "target_logits_scale": ("float", (0.0, True)), "logits_scale": ("float", (0.0, True))}

    @classmethod
    def from_pretrained(cls, model_name_or_path: str, batch_size: int = 32, learning_rate: float = 3e-5,
                        kd_loss: str = "fwd_kl", **kwargs) -> "KnowledgeDistillationTrainer":
        return cls._pretrained(model_name_or_path, learning_rate, 512, {"batch_size": batch_size, "kd_loss": kd_loss},
                               kwargs, _EXTRA)

    def _values(self, dataset, run_dir: str, max_steps=None, max_epochs=None, val_dataset=None) -> Dict[str, Any]:
        policy, kd = self._config["policy"], dict(self._config.get("kd") or {})
        train, val = resolve_dataset(dataset, val_dataset)
        batch = int(kd.get("batch_size", 32))
        values = {
            "pretrained_checkpoint.restore_from_path": self.model_path,
            "model.data.data_prefix": {"train": [self._write(run_dir, "train", train)],
                                       "validation": [self._write(run_dir, "validation", val or train)]},
            "model.global_batch_size": batch,
            "model.micro_batch_size": int(kd.get("micro_batch_size", min(batch, 8))),
            "model.encoder_seq_length": int(policy.get("max_total_sequence_length", 512)),
            "model.optim.lr": float(policy.get("learning_rate", 3e-5)),
            "model.knowledge_distillation.kd_loss": str(kd.get("kd_loss", "fwd_kl")),
            "model.knowledge_distillation.kd_loss_weight": float(kd.get("kd_loss_weight", 1.0)),
            "model.knowledge_distillation.sft_loss_weight": float(kd.get("sft_loss_weight", 0.0)),
            "model.knowledge_distillation.target_logits_scale": float(kd.get("target_logits_scale", 1.0)),
            "model.knowledge_distillation.logits_scale": float(kd.get("logits_scale", 1.0)),
            "model.data.top_k": kd.get("top_k"),
            "model.tensor_model_parallel_size": int(kd.get("tensor_parallel_size", 1)),
            "model.pipeline_model_parallel_size": int(kd.get("pipeline_parallel_size", 1)),
            "model.seed": int(kd.get("seed", 1234)),
            "trainer.knowledge_distillation.max_steps": int(max_steps) if max_steps is not None else -1,
            "trainer.knowledge_distillation.max_epochs": int(max_epochs) if max_epochs is not None else
            (1000000 if max_steps else 1),
            "trainer.knowledge_distillation.val_check_interval": kd.get("val_check_interval", 1.0),
            "exp_manager.checkpoint_callback_params.save_nemo_on_train_end": True,
        }
        return values

    def _run(self, cfg, hooks, **_) -> Dict[str, Any]:
        from nemo_aligner.recipes.knowledge_distillation import run_knowledge_distillation

        return run_knowledge_distillation(cfg, callbacks=hooks)
