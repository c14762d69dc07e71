"""GRPOTrainer: GRPO from Python with a reward function or an environment."""

from __future__ import annotations

from typing import Any, Dict

from nemo_aligner.trainers.rollout import ROLLOUT_EXTRA, RolloutTrainer

_EXTRA = ROLLOUT_EXTRA + ("kl_penalty",)


class GRPOTrainer(RolloutTrainer):
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
        "max_rollout_turns": ("int", (1, False)),
    }

    @classmethod
    def from_pretrained(cls, model_name_or_path: str, num_prompts_per_step: int = 32,
                        num_generations_per_prompt: int = 16, learning_rate: float = 1e-6,
                        max_sequence_length: int = 512, tensor_parallel_size: int = 1, normalize_rewards: bool = True,
                        use_leave_one_out_baseline: bool = True, **kwargs) -> "GRPOTrainer":
        cls._check_kwargs(kwargs, _EXTRA, "GRPOTrainer.from_pretrained")
        section = {"num_prompts_per_step": num_prompts_per_step, "num_generations_per_prompt": num_generations_per_prompt,
                   "normalize_rewards": normalize_rewards, "use_leave_one_out_baseline": use_leave_one_out_baseline}
        return cls(cls._new_config(model_name_or_path, learning_rate, max_sequence_length, tensor_parallel_size, section,
                               kwargs))

    def _values(self, dataset, run_dir: str, reward_fn=None, environment=None, max_steps=None, max_epochs=None,
                val_dataset=None) -> Dict[str, Any]:
        grpo = self._section()
        prompts, n = int(grpo.get("num_prompts_per_step", 32)), int(grpo.get("num_generations_per_prompt", 16))
        values = self._rollout_values(dataset, val_dataset, run_dir, max_steps, max_epochs, "num_responses_per_prompt",
                                      n, trained_rows=prompts * n, environment=environment)
        values.update({
            "model.grpo.reference_policy_kl_penalty": float(grpo.get("kl_penalty", 0.01)),
            "trainer.grpo.normalize_rewards": bool(grpo.get("normalize_rewards", True)),
            "trainer.grpo.use_leave_one_out_baseline": bool(grpo.get("use_leave_one_out_baseline", True)),
        })
        return values

    @staticmethod
    def _recipe():
        from nemo_aligner.recipes.grpo import run_grpo

        return run_grpo
