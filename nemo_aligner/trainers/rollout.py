"""What the Python API's rollout trainers (GRPO, rejection sampling) share: the policy config,
the fit arguments (a reward function or an environment), the run's rollout settings and the engine call."""

from __future__ import annotations

from typing import Any, Dict, Optional

from nemo_aligner.trainers.arguments import check_environment, check_reward_fn
from nemo_aligner.trainers.base import BaseTrainer
from nemo_aligner.trainers.datasets import prompt_records, resolve_dataset
from nemo_aligner.utils.errors import ConfigError

# Keyword arguments every rollout trainer's from_pretrained takes besides its own.
ROLLOUT_EXTRA = ("max_new_tokens", "temperature", "micro_batch_size", "global_batch_size", "seed", "output_dir",
                 "precision", "val_period", "save_period", "num_val_prompts", "overrides", "use_wandb",
                 "pipeline_parallel_size", "rollout_micro_batch_size", "max_rollout_turns")
# Turns per episode with an environment unless max_rollout_turns says otherwise: it plays on while the
# environment returns done=False (a reward function scores one response: 1 turn).
ENVIRONMENT_TURNS = 8


class RolloutTrainer(BaseTrainer):
    """A trainer that samples responses to prompts and scores them with ``fit``'s ``reward_fn`` or
    ``environment``; subclasses name the recipe that runs it (``_recipe``)."""

    @classmethod
    def _new_config(cls, model_name_or_path: str, learning_rate: float, max_sequence_length: int,
                tensor_parallel_size: int, section: Dict[str, Any], kwargs: Dict[str, Any]) -> Dict[str, Any]:
        config = {
            "policy": {"model_name": str(model_name_or_path), "learning_rate": learning_rate,
                       "max_total_sequence_length": max_sequence_length,
                       "dtensor_cfg": {"tensor_parallel_size": tensor_parallel_size}},
            cls.algorithm: section,
        }
        for key in ("output_dir", "precision", "overrides", "use_wandb"):
            if key in kwargs:
                config[key] = kwargs.pop(key)
        config[cls.algorithm].update(kwargs)
        return config

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

    def _section(self) -> Dict[str, Any]:
        return dict(self._config.get(self.algorithm) or {})

    def _rollout_values(self, dataset, val_dataset, run_dir: str, max_steps: Optional[int], max_epochs: Optional[int],
                        responses_key: str, responses: int, trained_rows: int, environment=None) -> Dict[str, Any]:
        """Config values every rollout run sets: data, sizes, optimizer, sampling, steps and intervals.
        ``responses_key``: the config's name for responses per prompt; ``trained_rows``: rows trained
        on per step (the default global batch)."""
        policy, section, name = self._config["policy"], self._section(), self.algorithm
        train, val = resolve_dataset(dataset, val_dataset)
        train = prompt_records(train)
        val = prompt_records(val, "val_dataset") if val else train[: int(section.get("num_val_prompts", 32))]
        prompts = int(section.get("num_prompts_per_step", 32))
        seq = int(policy.get("max_total_sequence_length", 512))
        return {
            "pretrained_checkpoint.restore_from_path": self.model_path,
            "model.data.data_prefix": {"train": [self._write(run_dir, "train", train)],
                                       "validation": [self._write(run_dir, "validation", val)]},
            "model.encoder_seq_length": seq,
            "model.tensor_model_parallel_size": int((policy.get("dtensor_cfg") or {}).get("tensor_parallel_size", 1)),
            "model.pipeline_model_parallel_size": int(section.get("pipeline_parallel_size", 1)),
            "model.optim.lr": float(policy.get("learning_rate", 1e-6)),
            f"model.{name}.num_rollout_samples": prompts,
            f"model.{name}.{responses_key}": responses,
            f"model.{name}.num_val_samples": len(val),
            f"model.{name}.length_params.max_length": int(section.get("max_new_tokens", seq // 2)),
            f"model.{name}.sampling_params.temperature": float(section.get("temperature", 1.0)),
            f"model.{name}.rollout_micro_batch_size": int(section.get("rollout_micro_batch_size",
                                                                      min(prompts * responses, 64))),
            "model.global_batch_size": int(section.get("global_batch_size", trained_rows)),
            "model.micro_batch_size": int(section.get("micro_batch_size", min(trained_rows, 8))),
            "model.seed": int(section.get("seed", 1234)),
            f"model.{name}.max_rollout_turns": int(section.get("max_rollout_turns",
                                                              ENVIRONMENT_TURNS if environment is not None else 1)),
            f"trainer.{name}.max_steps": int(max_steps) if max_steps is not None else -1,
            f"trainer.{name}.max_epochs": int(max_epochs) if max_epochs is not None else (1000000 if max_steps else 1),
            f"trainer.{name}.val_check_interval": int(section.get("val_period", 0) or 0),
            # NeMo-RL's checkpointing.save_period: a checkpoint every 10 steps even without validation,
            # so an interrupted run resumes (0 or None: only at the end)
            f"trainer.{name}.save_interval": int(section.get("save_period", 10) or 0),
            "reward_fn": None,
        }

    @staticmethod
    def _recipe():
        """The recipe function that runs the algorithm: ``(cfg, reward_source=, callbacks=) -> summary``."""
        raise NotImplementedError

    def _run(self, cfg, hooks, reward_fn=None, environment=None, **_) -> Dict[str, Any]:
        from nemo_aligner.environments.reward_sources import EnvironmentRewardSource, FunctionRewardSource
        from nemo_aligner.utils.nemo_file import load_tokenizer

        tokenizer = load_tokenizer(self.model_path, "policy.model_name")
        source = FunctionRewardSource(reward_fn, tokenizer) if reward_fn is not None else \
            EnvironmentRewardSource(environment, tokenizer)
        return self._recipe()(cfg, reward_source=source, callbacks=hooks)
