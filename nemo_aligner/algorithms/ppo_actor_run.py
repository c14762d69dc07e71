"""The PPO actor job end to end from a Hydra config (NeMo-Aligner's train_gpt_ppo_actor.py)."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Dict

from omegaconf import DictConfig, OmegaConf

from nemo_aligner.algorithms.ppo import PPOTrainer
from nemo_aligner.algorithms.run_helpers import fit_and_export
from nemo_aligner.data.nlp.builders import build_dataloader
from nemo_aligner.data.nlp.prompt_dataset import PromptDataset, collate_prompts
from nemo_aligner.data.nlp.reward_datasets import data_prefix_paths
from nemo_aligner.models.nlp.gpt.loading import load_model
from nemo_aligner.models.nlp.gpt.megatron_gpt_ppo_actor import MegatronGPTActorModel
from nemo_aligner.servers.clients import RemoteGPTRMCriticClient
from nemo_aligner.utils.distributed import is_global_rank_zero
from nemo_aligner.utils.errors import ConfigError
from nemo_aligner.utils.exp_manager import exp_manager
from nemo_aligner.utils.run_control import RunTimer, compute_max_steps, max_time_of
from nemo_aligner.utils.run_setup import init_run

logger = logging.getLogger(__name__)


@dataclass
class ActorSetup:
    """What an RL actor job needs before its trainer: the model, data and optimizer."""

    exp: object
    model: MegatronGPTActorModel
    train_dl: object
    val_dl: object
    optimizer: object
    scheduler: object
    seed: int
    num_prompts: int


def setup_actor(cfg: DictConfig, section: str, default_name: str, responses_per_prompt: int = 1) -> ActorSetup:
    """Distributed start, exp_manager, the actor (initial policy kept on the CPU), prompt loaders and
    the optimizer, from ``model.<section>`` and ``trainer.<section>`` (``ppo`` or ``reinforce``)."""
    restore = (cfg.get("pretrained_checkpoint") or {}).get("restore_from_path")
    if not restore:
        raise ConfigError("pretrained_checkpoint.restore_from_path is required: the SFT .nemo the actor starts from")
    info = init_run(cfg, restore, "pretrained_checkpoint.restore_from_path")
    exp = exp_manager(cfg.get("exp_manager"), cfg, default_name=default_name)
    model = load_model(MegatronGPTActorModel, cfg.model, cfg.trainer.precision, restore,
                       key="pretrained_checkpoint.restore_from_path", section=section)
    model.snapshot_initial_policy()  # before any resume: the reference is the starting checkpoint

    rl = cfg.model[section]
    seq = int(model.cfg.encoder_seq_length)
    max_prompt = seq - int(model.length_params.max_length)
    if max_prompt < 1:
        raise ConfigError(f"model.{section}.length_params.max_length={model.length_params.max_length} leaves no room "
                          f"for prompts in model.encoder_seq_length={seq}")
    train_paths = data_prefix_paths(cfg.model.data, "train")
    if not train_paths:
        raise ConfigError("model.data.data_prefix.train is required (jsonl of {\"text\": prompt})")
    train_ds = PromptDataset(train_paths, model.tokenizer, max_prompt, key="model.data.data_prefix.train")
    val_paths = data_prefix_paths(cfg.model.data, "validation")
    val_ds = PromptDataset(val_paths, model.tokenizer, max_prompt, key="model.data.data_prefix.validation") \
        if val_paths else None
    seed = int(cfg.model.get("seed", 1234))
    prompts = int(rl.num_rollout_samples)
    train_dl = build_dataloader(train_ds, OmegaConf.create({"global_batch_size": prompts, "micro_batch_size": 1,
                                                             "shuffle": True, "drop_last": True}),
                                collate_prompts, info.dp_rank, info.dp, seed, train=True,
                                key=f"model.{section}.num_rollout_samples")
    val_dl = None
    if val_ds is not None:
        num_val = min(int(rl.get("num_val_samples") or prompts), len(val_ds))
        num_val = max(num_val - num_val % info.dp, info.dp)
        val_dl = build_dataloader(val_ds, OmegaConf.create({"global_batch_size": num_val, "micro_batch_size": 1,
                                                             "shuffle": False, "drop_last": True}),
                                  collate_prompts, info.dp_rank, info.dp, seed, train=False,
                                  key=f"model.{section}.num_val_samples")
        val_dl.batch_sampler.max_batches_per_epoch = 1  # num_val_samples prompts per validation

    trainer_cfg = cfg.trainer[section]
    max_steps = compute_max_steps(trainer_cfg.get("max_steps"), trainer_cfg.get("max_epochs"),
                                  train_dl.batch_sampler.batches_per_epoch, key=f"trainer.{section}")
    # The LR schedule counts optimizer steps: rollouts / global_batch_size per step.
    optim_steps = max_steps * (prompts * responses_per_prompt // int(cfg.model.global_batch_size))
    optimizer, scheduler = model.setup_optimization(max(optim_steps, 1),
                                                    clip_grad=trainer_cfg.get("gradient_clip_val", 1.0))
    logger.info("%s actor: %.2fM parameters; %d prompts, %d per step (x%d responses), %d steps", section,
                model.num_parameters() / 1e6, len(train_ds), prompts, responses_per_prompt, max_steps)
    return ActorSetup(exp, model, train_dl, val_dl, optimizer, scheduler, seed, prompts)


def print_rl_summary(label: str, summary: Dict[str, float], log_dir: str) -> None:
    if is_global_rank_zero():
        nemo_path = summary["nemo_path"]
        print(f"{label} finished: {summary['steps']} steps, train reward {summary['final_train_reward']:.4f}, "
              f"validation reward {summary['final_val_reward']:.4f} (best {summary['best_val_reward']:.4f}), "
              f"{summary['seconds']:.0f}s; " + (f".nemo written to {nemo_path}" if nemo_path else f"logs in {log_dir}"),
              flush=True)


def run_ppo_actor(cfg: DictConfig) -> Dict[str, float]:
    """The PPO actor job against a critic (+ reward model) server."""
    setup = setup_actor(cfg, "ppo", "megatron_gpt_ppo_actor")
    client = RemoteGPTRMCriticClient(cfg.remote_critic_rm, pad_id=setup.model.tokenizer.eos_id)
    ppo = cfg.model.ppo
    try:
        client.check_request_sizes({"model.ppo.rollout_micro_batch_size": ppo.rollout_micro_batch_size,
                                    "model.ppo.val_rollout_micro_batch_size":
                                        ppo.get("val_rollout_micro_batch_size") or ppo.rollout_micro_batch_size})
        trainer = PPOTrainer(cfg.trainer.ppo, setup.model, setup.optimizer, setup.scheduler, setup.train_dl,
                             setup.val_dl, client, setup.exp.logger, setup.exp.checkpoint_callback,
                             RunTimer(max_time_of(cfg, "ppo")), ppo_cfg=cfg.model.ppo, seed=setup.seed)
        summary = fit_and_export(trainer, setup.model, setup.exp)
    finally:
        client.close()
    print_rl_summary("PPO", summary, setup.exp.log_dir)
    return summary
