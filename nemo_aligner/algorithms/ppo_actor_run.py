"""The PPO actor job end to end from a Hydra config (NeMo-Aligner's train_gpt_ppo_actor.py)."""

from __future__ import annotations

import logging
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


def run_ppo_actor(cfg: DictConfig) -> Dict[str, float]:
    restore = (cfg.get("pretrained_checkpoint") or {}).get("restore_from_path")
    if not restore:
        raise ConfigError("pretrained_checkpoint.restore_from_path is required: the SFT .nemo the actor starts from")
    info = init_run(cfg, restore, "pretrained_checkpoint.restore_from_path")
    exp = exp_manager(cfg.get("exp_manager"), cfg, default_name="megatron_gpt_ppo_actor")
    model = load_model(MegatronGPTActorModel, cfg.model, cfg.trainer.precision, restore,
                       key="pretrained_checkpoint.restore_from_path")
    model.snapshot_initial_policy()  # before any resume: the reference is the starting checkpoint

    ppo = cfg.model.ppo
    seq = int(model.cfg.encoder_seq_length)
    max_prompt = seq - int(model.length_params.max_length)
    if max_prompt < 1:
        raise ConfigError(f"model.ppo.length_params.max_length={model.length_params.max_length} leaves no room for "
                          f"prompts in model.encoder_seq_length={seq}")
    train_paths = data_prefix_paths(cfg.model.data, "train")
    if not train_paths:
        raise ConfigError("model.data.data_prefix.train is required (jsonl of {\"text\": prompt})")
    train_ds = PromptDataset(train_paths, model.tokenizer, max_prompt, key="model.data.data_prefix.train")
    val_paths = data_prefix_paths(cfg.model.data, "validation")
    val_ds = PromptDataset(val_paths, model.tokenizer, max_prompt, key="model.data.data_prefix.validation") \
        if val_paths else None
    seed = int(cfg.model.get("seed", 1234))
    rollouts = int(ppo.num_rollout_samples)
    train_dl = build_dataloader(train_ds, OmegaConf.create({"global_batch_size": rollouts, "micro_batch_size": 1,
                                                             "shuffle": True, "drop_last": True}),
                                collate_prompts, info.dp_rank, info.dp, seed, train=True, key="model.ppo.num_rollout_samples")
    val_dl = None
    if val_ds is not None:
        num_val = min(int(ppo.get("num_val_samples") or rollouts), len(val_ds))
        num_val = max(num_val - num_val % info.dp, info.dp)
        val_dl = build_dataloader(val_ds, OmegaConf.create({"global_batch_size": num_val, "micro_batch_size": 1,
                                                             "shuffle": False, "drop_last": True}),
                                  collate_prompts, info.dp_rank, info.dp, seed, train=False,
                                  key="model.ppo.num_val_samples")
        val_dl.batch_sampler.max_batches_per_epoch = 1  # num_val_samples prompts per validation

    ppo_trainer_cfg = cfg.trainer.ppo
    max_steps = compute_max_steps(ppo_trainer_cfg.get("max_steps"), ppo_trainer_cfg.get("max_epochs"),
                                  train_dl.batch_sampler.batches_per_epoch, key="trainer.ppo")
    # The LR schedule counts optimizer steps: num_rollout_samples / global_batch_size per PPO step.
    optim_steps = max_steps * (rollouts // int(cfg.model.global_batch_size))
    optimizer, scheduler = model.setup_optimization(max(optim_steps, 1),
                                                    clip_grad=ppo_trainer_cfg.get("gradient_clip_val", 1.0))
    client = RemoteGPTRMCriticClient(cfg.remote_critic_rm, pad_id=model.tokenizer.eos_id)
    trainer = PPOTrainer(ppo_trainer_cfg, model, optimizer, scheduler, train_dl, val_dl, client, exp.logger,
                         exp.checkpoint_callback, RunTimer(max_time_of(cfg, "ppo")), ppo_cfg=ppo, seed=seed)
    logger.info("PPO actor: %.2fM parameters; %d prompts, %d per step, %d steps", model.num_parameters() / 1e6,
                len(train_ds), rollouts, trainer.max_steps)
    try:
        summary = fit_and_export(trainer, model, exp)
    finally:
        client.close()
    nemo_path = summary["nemo_path"]
    if is_global_rank_zero():
        print(f"PPO finished: {summary['steps']} steps, train reward {summary['final_train_reward']:.4f}, "
              f"validation reward {summary['final_val_reward']:.4f} (best {summary['best_val_reward']:.4f}), "
              f"{summary['seconds']:.0f}s; " + (f".nemo written to {nemo_path}" if nemo_path else f"logs in {exp.log_dir}"),
              flush=True)
    return summary
