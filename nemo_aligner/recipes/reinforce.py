"""The REINFORCE/RLOO actor job end to end from a Hydra config (``train_gpt_reinforce_actor.py``)."""

from __future__ import annotations

from typing import Dict

from omegaconf import DictConfig

from nemo_aligner.recipes.ppo import fit_scored_actor, setup_actor
from nemo_aligner.algorithms.reinforce import ReinforceTrainer, check_group_sampling
from nemo_aligner.utils.errors import ConfigError
from nemo_aligner.environments.reward_sources import FunctionRewardSource, load_reward_fn
from nemo_aligner.servers.clients import RemoteRewardSource
from nemo_aligner.utils.run_control import RunTimer, max_time_of


def build_reward_source(cfg: DictConfig, tokenizer):
    """``reward_fn`` ("module:function") when set, otherwise the ``remote_rm`` reward-model server."""
    if cfg.get("reward_fn"):
        return FunctionRewardSource(load_reward_fn(cfg.reward_fn), tokenizer)
    if cfg.get("remote_rm") is None:
        raise ConfigError("set reward_fn (a 'module:function') or remote_rm.reward_model.{ip, port}")
    return RemoteRewardSource(cfg.remote_rm, pad_id=tokenizer.eos_id)


def run_reinforce_actor(cfg: DictConfig) -> Dict[str, float]:
    rl = cfg.model.reinforce
    n = check_group_sampling(rl, "reinforce", refuse_greedy=False)
    setup = setup_actor(cfg, "reinforce", "megatron_gpt_reinforce_actor", responses_per_prompt=n)
    source = build_reward_source(cfg, setup.model.tokenizer)
    trainer = ReinforceTrainer(cfg.trainer.reinforce, setup.model, setup.optimizer, setup.scheduler, setup.train_dl,
                               setup.val_dl, source, setup.exp.logger, setup.exp.checkpoint_callback,
                               RunTimer(max_time_of(cfg, "reinforce")), rl_cfg=rl, seed=setup.seed)
    return fit_scored_actor(trainer, setup, source, "REINFORCE")
