"""Rejection sampling end to end from a Hydra config (NeMo-Aligner's ``train_gpt_rs_actor.py``):
the actor from ``pretrained_checkpoint.restore_from_path``, rewards from ``reward_fn`` or the
``remote_rm`` reward-model server."""

from __future__ import annotations

from typing import Dict, Optional

from omegaconf import DictConfig

from nemo_aligner.algorithms.callbacks import CallbackList
from nemo_aligner.algorithms.rs import RSTrainer, check_rs_sampling
from nemo_aligner.models.nlp.gpt.megatron_gpt_rs_actor import MegatronGPTRSActorModel
from nemo_aligner.recipes.ppo import fit_scored_actor, setup_actor
from nemo_aligner.recipes.reinforce import build_reward_source
from nemo_aligner.utils.run_control import RunTimer, max_time_of


def run_rs_actor(cfg: DictConfig, reward_source=None, callbacks: Optional[CallbackList] = None) -> Dict[str, float]:
    """Train ``pretrained_checkpoint.restore_from_path`` by rejection sampling; rewards from
    ``reward_source`` (the API's reward function or environment) or, by default, ``reward_fn``/``remote_rm``."""
    rl = cfg.model.rs
    n, top = check_rs_sampling(rl)
    setup = setup_actor(cfg, "rs", "megatron_gpt_rs_actor", responses_per_prompt=n,
                        model_cls=MegatronGPTRSActorModel, trained_per_prompt=top)
    source = reward_source or build_reward_source(cfg, setup.model.tokenizer)
    trainer = RSTrainer(cfg.trainer.rs, setup.model, setup.optimizer, setup.scheduler, setup.train_dl, setup.val_dl,
                        source, setup.exp.logger, setup.exp.checkpoint_callback, RunTimer(max_time_of(cfg, "rs")),
                        rl_cfg=rl, seed=setup.seed)
    return fit_scored_actor(trainer, setup, source, "Rejection sampling", close_source=reward_source is None,
                            callbacks=callbacks)
