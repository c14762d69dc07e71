"""PPO's two jobs from their Hydra configs: the actor (NeMo-Aligner's ``train_gpt_ppo_actor.py``)
and the critic server with the co-located reward model (``serve_ppo_critic.py``)."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Dict, Optional

from omegaconf import DictConfig, OmegaConf

from nemo_aligner.algorithms.callbacks import CallbackList
from nemo_aligner.algorithms.critic_server_trainer import CriticServerTrainer
from nemo_aligner.algorithms.ppo import PPOTrainer
from nemo_aligner.data.nlp.builders import build_dataloader
from nemo_aligner.data.nlp.prompt_dataset import PromptDataset, collate_prompts
from nemo_aligner.data.nlp.reward_datasets import data_prefix_paths
from nemo_aligner.models.nlp.gpt.loading import load_model
from nemo_aligner.models.nlp.gpt.megatron_gpt_critic import MegatronGPTCriticModel
from nemo_aligner.models.nlp.gpt.megatron_gpt_ppo_actor import MegatronGPTActorModel
from nemo_aligner.recipes.run_helpers import fit_and_export, report_finished
from nemo_aligner.servers.batching import check_batch_limits
from nemo_aligner.servers.clients import RemoteGPTRMCriticClient
from nemo_aligner.servers.critic_server import CriticServer
from nemo_aligner.servers.triton_host import check_ports_free, server_address
from nemo_aligner.utils.distributed import get_rank
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


def setup_actor(cfg: DictConfig, section: str, default_name: str, responses_per_prompt: int = 1,
                model_cls=MegatronGPTActorModel, trained_per_prompt: Optional[int] = None) -> ActorSetup:
    """Distributed start, exp_manager, the actor (``model_cls``; the initial policy kept on the CPU
    when the algorithm has a KL term), prompt loaders and the optimizer, from ``model.<section>`` and
    ``trainer.<section>`` (``ppo``, ``reinforce``, ``grpo``, ``rs``). ``trained_per_prompt``: rows
    trained on per prompt (default ``responses_per_prompt``), which sizes the LR schedule."""
    restore = (cfg.get("pretrained_checkpoint") or {}).get("restore_from_path")
    if not restore:
        raise ConfigError("pretrained_checkpoint.restore_from_path is required: the SFT .nemo the actor starts from")
    info = init_run(cfg, restore, "pretrained_checkpoint.restore_from_path")
    exp = exp_manager(cfg.get("exp_manager"), cfg, default_name=default_name)
    model = load_model(model_cls, cfg.model, cfg.trainer.precision, restore,
                       key="pretrained_checkpoint.restore_from_path", section=section)
    if model.uses_reference_policy:
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
    trained = prompts * (trained_per_prompt or responses_per_prompt)
    optim_steps = max_steps * (trained // int(cfg.model.global_batch_size))
    optimizer, scheduler = model.setup_optimization(max(optim_steps, 1),
                                                    clip_grad=trainer_cfg.get("gradient_clip_val", 1.0))
    logger.info("%s actor: %.2fM parameters; %d prompts, %d per step (x%d responses), %d steps", section,
                model.num_parameters() / 1e6, len(train_ds), prompts, responses_per_prompt, max_steps)
    return ActorSetup(exp, model, train_dl, val_dl, optimizer, scheduler, seed, prompts)


def print_rl_summary(label: str, summary: Dict[str, float]) -> None:
    report_finished(summary, f"{label} finished: {summary['steps']} steps, train reward "
                             f"{summary['final_train_reward']:.4f}, validation reward {summary['final_val_reward']:.4f} "
                             f"(best {summary['best_val_reward']:.4f})")


def fit_scored_actor(trainer, setup: ActorSetup, source, label: str, close_source: bool = True,
                     callbacks: Optional[CallbackList] = None) -> Dict[str, float]:
    """Fit a critic-free actor trainer whose rewards come from ``source``, export the model and print
    its summary (``label``); ``source`` is closed afterwards when ``close_source`` (this run made it)."""
    if callbacks is not None:
        trainer.callbacks = callbacks
    try:
        summary = fit_and_export(trainer, setup.model, setup.exp)
    finally:
        if close_source:
            source.close()
    summary["best_checkpoint"] = setup.exp.checkpoint_callback.best() if setup.exp.checkpoint_callback else None
    print_rl_summary(label, summary)
    return summary


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
    print_rl_summary("PPO", summary)
    return summary


def serve_ppo_critic(cfg) -> None:
    """``serve_ppo_critic.py``: critic (+ reward model) from ``pretrained_checkpoint.restore_from_path``."""

    ppo = cfg.trainer.ppo
    restore = (cfg.get("pretrained_checkpoint") or {}).get("restore_from_path")
    combine = bool(ppo.get("combine_rm_and_critic_server", True))
    if combine and not restore:
        raise ConfigError("trainer.ppo.combine_rm_and_critic_server=True needs pretrained_checkpoint.restore_from_path "
                          "(the reward model .nemo the critic starts from and that scores rollouts)")
    address = server_address(ppo, "trainer.ppo")
    parallel = init_run(cfg, restore, "pretrained_checkpoint.restore_from_path",
                        timeout_minutes=int(ppo.get("dist_timeout_minutes") or 7 * 24 * 60))
    mbs = ppo.get("inference_micro_batch_size") or cfg.model.get("forward_micro_batch_size") or cfg.model.micro_batch_size
    if not isinstance(mbs, int):
        mbs = int(list(mbs)[0])
    check_batch_limits(ppo.get("max_batch_size"), mbs, parallel.dp,
                       "trainer.ppo.max_batch_size", "trainer.ppo.inference_micro_batch_size")
    if get_rank() == 0:
        check_ports_free(address, "trainer.ppo")
    exp = exp_manager(cfg.get("exp_manager"), cfg, default_name="megatron_gpt_critic")
    model = load_model(MegatronGPTCriticModel, cfg.model, cfg.trainer.precision, restore,
                       key="pretrained_checkpoint.restore_from_path", allow_missing=("rm_head",))
    if combine:
        model.snapshot_reward_model()  # before any resume: the reward model is the starting checkpoint
    max_steps = int(ppo.get("max_steps") or 10000)
    optimizer, scheduler = model.setup_optimization(max_steps, clip_grad=ppo.get("gradient_clip_val", 1.0))
    trainer = CriticServerTrainer(model, optimizer, scheduler, exp.logger, exp.checkpoint_callback,
                                  int(cfg.model.global_batch_size),
                                  max_consecutive_nonfinite_steps=int(ppo.get("max_consecutive_nonfinite_steps", 10) or 0))
    if exp.resume_from:
        trainer.load_checkpoint(exp.resume_from)
    server = CriticServer(
        model, trainer, address, combine_rm_and_critic=combine, micro_batch_size=int(mbs),
        max_queue_delay_us=int(ppo.get("max_queue_delay_microseconds") or 0),
        strip_to_multiple=ppo.get("strip_sequence_length_to_multiple") or ppo.get("pad_sequence_length_to_multiple"),
        max_batch_size=ppo.get("max_batch_size"), workspace_dir=ppo.get("workspace_dir"),
        triton_log_file=ppo.get("triton_log_file"), shutdown_idle_s=float(ppo.get("shutdown_idle_s", 60)),
        max_sequence_length=ppo.get("max_sequence_length"), max_train_rows=ppo.get("max_train_rows"))
    try:
        server.run()
    finally:
        exp.logger.finalize()
