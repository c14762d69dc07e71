"""RejectionSamplingTrainer: rejection sampling from Python with a reward function or an environment."""

from __future__ import annotations

from typing import Any, Dict

from nemo_aligner.trainers.rollout import ROLLOUT_EXTRA, RolloutTrainer


class RejectionSamplingTrainer(RolloutTrainer):
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
        "max_rollout_turns": ("int", (1, False)),
    }

    @classmethod
    def from_pretrained(cls, model_name_or_path: str, num_prompts_per_step: int = 32, num_rollouts_per_prompt: int = 4,
                        top_n_rollouts: int = 1, learning_rate: float = 1e-6, max_sequence_length: int = 512,
                        tensor_parallel_size: int = 1, **kwargs) -> "RejectionSamplingTrainer":
        cls._check_kwargs(kwargs, ROLLOUT_EXTRA, "RejectionSamplingTrainer.from_pretrained")
        section = {"num_prompts_per_step": num_prompts_per_step, "num_rollouts_per_prompt": num_rollouts_per_prompt,
                   "top_n_rollouts": top_n_rollouts}
        return cls(cls._new_config(model_name_or_path, learning_rate, max_sequence_length, tensor_parallel_size, section,
                               kwargs))

    def _values(self, dataset, run_dir: str, reward_fn=None, environment=None, max_steps=None, max_epochs=None,
                val_dataset=None) -> Dict[str, Any]:
        rs = self._section()
        prompts, n = int(rs.get("num_prompts_per_step", 32)), int(rs.get("num_rollouts_per_prompt", 4))
        top = int(rs.get("top_n_rollouts", 1))
        values = self._rollout_values(dataset, val_dataset, run_dir, max_steps, max_epochs, "num_rollouts_per_prompt",
                                      n, trained_rows=prompts * top, environment=environment)
        values["model.rs.top_n_rollouts"] = top
        return values

    @staticmethod
    def _recipe():
        from nemo_aligner.recipes.rs import run_rs_actor

        return run_rs_actor
