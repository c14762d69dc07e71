"""GRPO end to end from a Hydra config (``train_gpt_grpo.py``) or the Python API.

GRPO is the critic-free loop of :mod:`nemo_aligner.algorithms.reinforce` with group-relative
advantages (``normalize_rewards``: each prompt's rewards minus their group baseline, over the
group's standard deviation) and the KL to the reference policy in the loss
(``model.grpo.reference_policy_kl_penalty``, k3 estimator) rather than in the reward.
"""

from __future__ import annotations

from typing import Dict, Optional

from omegaconf import DictConfig

from nemo_aligner.algorithms.callbacks import CallbackList
from nemo_aligner.algorithms.reinforce import ReinforceTrainer, check_group_sampling
from nemo_aligner.recipes.ppo import fit_scored_actor, setup_actor
from nemo_aligner.recipes.reinforce import build_reward_source
from nemo_aligner.utils.run_control import RunTimer, max_time_of


def run_grpo(cfg: DictConfig, reward_source=None, callbacks: Optional[CallbackList] = None) -> Dict[str, float]:
    """Train ``pretrained_checkpoint.restore_from_path`` with GRPO; rewards from ``reward_source``
    (the API's reward function or environment) or, by default, ``reward_fn``/``remote_rm``."""
    n = check_group_sampling(cfg.model.grpo, "grpo")
    setup = setup_actor(cfg, "grpo", "megatron_gpt_grpo", responses_per_prompt=n)
    source = reward_source or build_reward_source(cfg, setup.model.tokenizer)
    trainer = ReinforceTrainer(cfg.trainer.grpo, setup.model, setup.optimizer, setup.scheduler, setup.train_dl,
                               setup.val_dl, source, setup.exp.logger, setup.exp.checkpoint_callback,
                               RunTimer(max_time_of(cfg, "grpo")), rl_cfg=cfg.model.grpo, seed=setup.seed, name="grpo")
    return fit_scored_actor(trainer, setup, source, "GRPO", close_source=reward_source is None, callbacks=callbacks)
