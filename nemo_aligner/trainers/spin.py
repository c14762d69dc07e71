"""SPINTrainer for Python: self-play fine-tuning on SFT data."""

from __future__ import annotations

from typing import Any, Dict

from nemo_aligner.trainers.base import BaseTrainer
from nemo_aligner.trainers.datasets import resolve_dataset, sft_records
from nemo_aligner.utils.errors import DataError

_EXTRA = ("micro_batch_size", "seed", "output_dir", "precision", "val_check_interval", "overrides", "use_wandb",
          "tensor_parallel_size", "pipeline_parallel_size", "max_sequence_length", "max_new_tokens",
          "iterations", "epochs_per_iteration", "temperature", "rollout_micro_batch_size")


class SelfPlayTrainer(BaseTrainer):
    """``SelfPlayTrainer.from_pretrained(path, batch_size=32, learning_rate=1e-5, beta=0.1, iterations=3)``
    then ``fit(dataset)`` with ``{"input", "output"}`` (or ``{"prompt", "completion"}``) records: each
    iteration the previous iterate answers the prompts and the policy learns to prefer the data's
    answers (``beta``: one value, or a list with one per iteration)."""

    algorithm = "spin"
    config_name = "gpt_spin"
    section_rules = {"beta": ("floats", (0.0, True)), "iterations": ("int", (1, False)), "epochs_per_iteration": ("int", (1, False)),
                     "temperature": ("float", (0.0, False)), "max_new_tokens": ("int", (1, False)),
                     "rollout_micro_batch_size": ("int", (1, False))}

    @classmethod
    def from_pretrained(cls, model_name_or_path: str, batch_size: int = 32, learning_rate: float = 1e-5,
                        beta=0.1, **kwargs) -> "SelfPlayTrainer":
        return cls._pretrained(model_name_or_path, learning_rate, 512, {"batch_size": batch_size, "beta": beta}, kwargs,
                               _EXTRA)

    def _values(self, dataset, run_dir: str, max_steps=None, max_epochs=None, val_dataset=None) -> Dict[str, Any]:
        policy, spin = self._config["policy"], dict(self._config.get("spin") or {})
        train, val = resolve_dataset(dataset, val_dataset)
        train, whole = sft_records(train)
        if whole:
            raise DataError("dataset: SPIN needs prompt/answer records ({'input', 'output'} or "
                            "{'prompt', 'completion'}): the policy answers each prompt")
        val = sft_records(val, "val_dataset")[0] if val else train
        batch = int(spin.get("batch_size", 32))
        beta = spin.get("beta", 0.1)
        return {
            "pretrained_checkpoint.restore_from_path": self.model_path,
            "model.data.train_ds.file_path": self._write(run_dir, "train", train),
            "model.data.validation_ds.file_path": self._write(run_dir, "validation", val),
            "model.data.chat": False,
            "model.data.validation_ds.drop_last": False,
            "model.global_batch_size": batch,
            "model.micro_batch_size": int(spin.get("micro_batch_size", min(batch, 8))),
            "model.encoder_seq_length": int(policy.get("max_total_sequence_length", 512)),
            "model.optim.lr": float(policy.get("learning_rate", 1e-5)),
            "model.spin.ref_policy_kl_penalty": list(beta) if isinstance(beta, (list, tuple)) else beta,
            "model.spin.rollout_micro_batch_size": int(spin.get("rollout_micro_batch_size", batch)),
            "model.spin.length_params.max_length": int(spin.get("max_new_tokens", 128)),
            "model.spin.sampling_params.temperature": float(spin.get("temperature", 1.0)),
            "model.tensor_model_parallel_size": int(spin.get("tensor_parallel_size", 1)),
            "model.pipeline_model_parallel_size": int(spin.get("pipeline_parallel_size", 1)),
            "model.seed": int(spin.get("seed", 1234)),
            "trainer.spin.max_iterations": int(spin.get("iterations", 3)),
            "trainer.spin.max_epochs": int(spin.get("epochs_per_iteration", 1)),
            "trainer.spin.max_steps": int(max_steps) if max_steps is not None else -1,
            "trainer.spin.val_check_interval": spin.get("val_check_interval", 1.0),
        }

    def _run(self, cfg, hooks, **_) -> Dict[str, Any]:
        from nemo_aligner.recipes.spin import run_spin

        return run_spin(cfg, callbacks=hooks)
