"""RejectionSamplingTrainer: rejection sampling from Python with a reward function or an environment."""

from __future__ import annotations

from typing import Any, Dict

from nemo_aligner.trainers.base import BaseTrainer
from nemo_aligner.trainers.datasets import prompt_records, resolve_dataset
from nemo_aligner.trainers.grpo import GRPOTrainer, _tokenizer_of

_EXTRA = ("max_new_tokens", "temperature", "micro_batch_size", "global_batch_size", "seed", "output_dir",
          "precision", "val_period", "save_period", "num_val_prompts", "overrides", "use_wandb",
          "pipeline_parallel_size", "rollout_micro_batch_size")


class RejectionSamplingTrainer(BaseTrainer):
    """``RejectionSamplingTrainer.from_pretrained(path, num_prompts_per_step=32, num_rollouts_per_prompt=4,
    top_n_rollouts=1, learning_rate=1e-6)`` then ``fit(dataset, reward_fn=fn)`` (or ``environment=env``):
    each step samples ``num_rollouts_per_prompt`` responses per prompt and trains on the
    ``top_n_rollouts`` best with the SFT loss."""

    algorithm = "rs"
    config_name = "gpt_rs_actor"
    section_rules = {
        "num_prompts_per_step": ("int", (1, False)), "num_rollouts_per_prompt": ("int", (1, False)),
        "top_n_rollouts": ("int", (1, False)), "max_new_tokens": ("int", (1, False)),
        "temperature": ("float", (0.0, True)), "num_val_prompts": ("int", (1, False)),
        "rollout_micro_batch_size": ("int", (1, False)), "save_period": ("int", (0, False)),
    }
    _checked_fit_kwargs = GRPOTrainer._checked_fit_kwargs

    @classmethod
    def from_pretrained(cls, model_name_or_path: str, num_prompts_per_step: int = 32, num_rollouts_per_prompt: int = 4,
                        top_n_rollouts: int = 1, learning_rate: float = 1e-6, max_sequence_length: int = 512,
                        tensor_parallel_size: int = 1, **kwargs) -> "RejectionSamplingTrainer":
        cls._check_kwargs(kwargs, _EXTRA, "RejectionSamplingTrainer.from_pretrained")
        config = {
            "policy": {"model_name": str(model_name_or_path), "learning_rate": learning_rate,
                       "max_total_sequence_length": max_sequence_length,
                       "dtensor_cfg": {"tensor_parallel_size": tensor_parallel_size}},
            "rs": {"num_prompts_per_step": num_prompts_per_step, "num_rollouts_per_prompt": num_rollouts_per_prompt,
                   "top_n_rollouts": top_n_rollouts},
        }
        for key in ("output_dir", "precision", "overrides", "use_wandb"):
            if key in kwargs:
                config[key] = kwargs.pop(key)
        config["rs"].update(kwargs)
        return cls(config)

    def _values(self, dataset, run_dir: str, reward_fn=None, environment=None, max_steps=None, max_epochs=None,
                val_dataset=None) -> Dict[str, Any]:
        policy, rs = self._config["policy"], dict(self._config.get("rs") or {})
        train, val = resolve_dataset(dataset, val_dataset)
        train = prompt_records(train)
        val = prompt_records(val, "val_dataset") if val else train[: int(rs.get("num_val_prompts", 32))]
        prompts, n = int(rs.get("num_prompts_per_step", 32)), int(rs.get("num_rollouts_per_prompt", 4))
        top = int(rs.get("top_n_rollouts", 1))
        seq = int(policy.get("max_total_sequence_length", 512))
        return {
            "pretrained_checkpoint.restore_from_path": self.model_path,
            "model.data.data_prefix": {"train": [self._write(run_dir, "train", train)],
                                       "validation": [self._write(run_dir, "validation", val)]},
            "model.encoder_seq_length": seq,
            "model.tensor_model_parallel_size": int((policy.get("dtensor_cfg") or {}).get("tensor_parallel_size", 1)),
            "model.pipeline_model_parallel_size": int(rs.get("pipeline_parallel_size", 1)),
            "model.optim.lr": float(policy.get("learning_rate", 1e-6)),
            "model.optim.sched.name": "Constant",
            "model.rs.num_rollout_samples": prompts,
            "model.rs.num_rollouts_per_prompt": n,
            "model.rs.top_n_rollouts": top,
            "model.rs.num_val_samples": len(val),
            "model.rs.length_params.max_length": int(rs.get("max_new_tokens", seq // 2)),
            "model.rs.sampling_params.temperature": float(rs.get("temperature", 1.0)),
            "model.rs.rollout_micro_batch_size": int(rs.get("rollout_micro_batch_size", min(prompts * n, 64))),
            "model.global_batch_size": int(rs.get("global_batch_size", prompts * top)),
            "model.micro_batch_size": int(rs.get("micro_batch_size", min(prompts * top, 8))),
            "model.seed": int(rs.get("seed", 1234)),
            "trainer.rs.max_steps": int(max_steps) if max_steps is not None else -1,
            "trainer.rs.max_epochs": int(max_epochs) if max_epochs is not None else (1000000 if max_steps else 1),
            "trainer.rs.val_check_interval": int(rs.get("val_period", 0) or 0),
            "trainer.rs.save_interval": int(rs.get("save_period", 10) or 0),
            "reward_fn": None,
        }

    def _run(self, cfg, hooks, reward_fn=None, environment=None, **_) -> Dict[str, Any]:
        from nemo_aligner.environments.reward_sources import EnvironmentRewardSource, FunctionRewardSource
        from nemo_aligner.recipes.rs import run_rs_actor

        tokenizer = _tokenizer_of(self.model_path)
        source = FunctionRewardSource(reward_fn, tokenizer) if reward_fn is not None else \
            EnvironmentRewardSource(environment, tokenizer)
        return run_rs_actor(cfg, reward_source=source, callbacks=hooks)
