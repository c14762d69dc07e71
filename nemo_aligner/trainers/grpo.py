"""GRPOTrainer: GRPO from Python with a reward function or an environment."""

from __future__ import annotations

from typing import Any, Dict

from nemo_aligner.trainers.arguments import check_environment, check_reward_fn
from nemo_aligner.trainers.base import BaseTrainer
from nemo_aligner.trainers.datasets import prompt_records, resolve_dataset
from nemo_aligner.utils.errors import ConfigError

_EXTRA = ("max_new_tokens", "temperature", "micro_batch_size", "global_batch_size", "kl_penalty", "seed",
          "output_dir", "precision", "val_period", "save_period", "num_val_prompts", "overrides", "use_wandb",
          "pipeline_parallel_size", "rollout_micro_batch_size")


class GRPOTrainer(BaseTrainer):
    """``GRPOTrainer.from_pretrained(path, num_prompts_per_step=32, num_generations_per_prompt=16,
    learning_rate=1e-6)`` then ``fit(dataset, reward_fn=fn)`` (or ``environment=env``)."""

    algorithm = "grpo"
    config_name = "gpt_grpo"
    section_rules = {
        "num_prompts_per_step": ("int", (1, False)), "num_generations_per_prompt": ("int", (2, False)),
        "normalize_rewards": ("bool", None), "use_leave_one_out_baseline": ("bool", None),
        "max_new_tokens": ("int", (1, False)), "temperature": ("float", (0.0, True)),
        "kl_penalty": ("float", (0.0, False)), "num_val_prompts": ("int", (1, False)),
        "rollout_micro_batch_size": ("int", (1, False)), "save_period": ("int", (0, False)),
    }

    @classmethod
    def from_pretrained(cls, model_name_or_path: str, num_prompts_per_step: int = 32,
                        num_generations_per_prompt: int = 16, learning_rate: float = 1e-6,
                        max_sequence_length: int = 512, tensor_parallel_size: int = 1, normalize_rewards: bool = True,
                        use_leave_one_out_baseline: bool = True, **kwargs) -> "GRPOTrainer":
        cls._check_kwargs(kwargs, _EXTRA, "GRPOTrainer.from_pretrained")
        config = {
            "policy": {"model_name": str(model_name_or_path), "learning_rate": learning_rate,
                       "max_total_sequence_length": max_sequence_length,
                       "dtensor_cfg": {"tensor_parallel_size": tensor_parallel_size}},
            "grpo": {"num_prompts_per_step": num_prompts_per_step, "num_generations_per_prompt": num_generations_per_prompt,
                     "normalize_rewards": normalize_rewards, "use_leave_one_out_baseline": use_leave_one_out_baseline},
        }
        for key in ("output_dir", "precision", "overrides", "use_wandb"):
            if key in kwargs:
                config[key] = kwargs.pop(key)
        config["grpo"].update(kwargs)
        return cls(config)

    def _checked_fit_kwargs(self, kwargs: Dict[str, Any], owner: str) -> Dict[str, Any]:
        reward_fn, environment = kwargs.get("reward_fn"), kwargs.get("environment")
        if (reward_fn is None) == (environment is None):
            raise ConfigError(f"{type(self).__name__}.fit needs exactly one of reward_fn (prompt, response) -> float or "
                              "environment")
        if reward_fn is not None:
            kwargs = dict(kwargs, reward_fn=check_reward_fn(reward_fn, owner))
        else:
            check_environment(environment, owner)
        return kwargs

    def _values(self, dataset, run_dir: str, reward_fn=None, environment=None, max_steps=None, max_epochs=None,
                val_dataset=None) -> Dict[str, Any]:
        policy, grpo = self._config["policy"], dict(self._config.get("grpo") or {})
        train, val = resolve_dataset(dataset, val_dataset)
        train = prompt_records(train)
        val = prompt_records(val, "val_dataset") if val else train[: int(grpo.get("num_val_prompts", 32))]
        prompts, n = int(grpo.get("num_prompts_per_step", 32)), int(grpo.get("num_generations_per_prompt", 16))
        rollouts = prompts * n
        seq = int(policy.get("max_total_sequence_length", 512))
        values = {
            "pretrained_checkpoint.restore_from_path": self.model_path,
            "model.data.data_prefix": {"train": [self._write(run_dir, "train", train)],
                                       "validation": [self._write(run_dir, "validation", val)]},
            "model.encoder_seq_length": seq,
            "model.tensor_model_parallel_size": int((policy.get("dtensor_cfg") or {}).get("tensor_parallel_size", 1)),
            "model.pipeline_model_parallel_size": int(grpo.get("pipeline_parallel_size", 1)),
            "model.optim.lr": float(policy.get("learning_rate", 1e-6)),
            "model.optim.sched.name": "Constant",
            "model.grpo.num_rollout_samples": prompts,
            "model.grpo.num_responses_per_prompt": n,
            "model.grpo.num_val_samples": len(val),
            "model.grpo.length_params.max_length": int(grpo.get("max_new_tokens", seq // 2)),
            "model.grpo.sampling_params.temperature": float(grpo.get("temperature", 1.0)),
            "model.grpo.reference_policy_kl_penalty": float(grpo.get("kl_penalty", 0.01)),
            "model.grpo.rollout_micro_batch_size": int(grpo.get("rollout_micro_batch_size", min(rollouts, 64))),
            "model.global_batch_size": int(grpo.get("global_batch_size", rollouts)),
            "model.micro_batch_size": int(grpo.get("micro_batch_size", min(rollouts, 8))),
            "model.seed": int(grpo.get("seed", 1234)),
            "trainer.grpo.normalize_rewards": bool(grpo.get("normalize_rewards", True)),
            "trainer.grpo.use_leave_one_out_baseline": bool(grpo.get("use_leave_one_out_baseline", True)),
            "trainer.grpo.max_steps": int(max_steps) if max_steps is not None else -1,
            "trainer.grpo.max_epochs": int(max_epochs) if max_epochs is not None else (1000000 if max_steps else 1),
            "trainer.grpo.val_check_interval": int(grpo.get("val_period", 0) or 0),
            # NeMo-RL's checkpointing.save_period: a checkpoint every 10 steps even without validation,
            # so an interrupted run resumes (0 or None: only at the end)
            "trainer.grpo.save_interval": int(grpo.get("save_period", 10) or 0),
            "reward_fn": None,
        }
        return values

    def _run(self, cfg, hooks, reward_fn=None, environment=None, **_) -> Dict[str, Any]:
        from nemo_aligner.recipes.grpo import run_grpo
        from nemo_aligner.environments.reward_sources import EnvironmentRewardSource, FunctionRewardSource

        tokenizer = _tokenizer_of(self.model_path)
        source = FunctionRewardSource(reward_fn, tokenizer) if reward_fn is not None else \
            EnvironmentRewardSource(environment, tokenizer)
        return run_grpo(cfg, reward_source=source, callbacks=hooks)


def _tokenizer_of(nemo_path: str):
    from nemo_aligner.utils.nemo_file import load_tokenizer

    return load_tokenizer(nemo_path, "policy.model_name")
