"""DPO (and IPO, RPO) end to end from a Hydra config (NeMo-Aligner's train_gpt_dpo.py)."""

from __future__ import annotations

import logging
from functools import partial
from typing import Dict

from omegaconf import DictConfig, OmegaConf

from nemo_aligner.algorithms.run_helpers import fit_and_export
from nemo_aligner.algorithms.supervised import SupervisedTrainer, plan_max_steps
from nemo_aligner.data.nlp.builders import build_dataloader
from nemo_aligner.data.nlp.dpo_dataset import DPOPairDataset, collate_dpo
from nemo_aligner.data.nlp.reward_datasets import data_prefix_paths
from nemo_aligner.models.nlp.gpt.loading import load_model
from nemo_aligner.models.nlp.gpt.megatron_gpt_dpo_model import MegatronGPTDPOModel
from nemo_aligner.utils.distributed import is_global_rank_zero
from nemo_aligner.utils.errors import ConfigError
from nemo_aligner.utils.exp_manager import exp_manager
from nemo_aligner.utils.run_control import RunTimer, max_time_of
from nemo_aligner.utils.run_setup import init_run

logger = logging.getLogger(__name__)


def run_dpo(cfg: DictConfig) -> Dict[str, float]:
    """Train ``pretrained_checkpoint.restore_from_path`` on preference pairs; the reference is its start."""
    restore = (cfg.get("pretrained_checkpoint") or {}).get("restore_from_path")
    if not restore:
        raise ConfigError("pretrained_checkpoint.restore_from_path is required: the SFT .nemo to align")
    info = init_run(cfg, restore, "pretrained_checkpoint.restore_from_path")
    exp = exp_manager(cfg.get("exp_manager"), cfg, default_name=str(cfg.get("name", "megatron_gpt")))
    model = load_model(MegatronGPTDPOModel, cfg.model, cfg.trainer.precision, restore,
                       key="pretrained_checkpoint.restore_from_path")
    model.snapshot_reference_policy()  # before any resume: the reference is the starting checkpoint
    data_cfg = cfg.model.data
    seq = int(data_cfg.get("seq_length") or model.cfg.encoder_seq_length)
    datasets = {}
    for split in ("train", "validation"):
        paths = data_prefix_paths(data_cfg, split)
        if paths:
            datasets[split] = DPOPairDataset(paths, model.tokenizer, seq, key=f"model.data.data_prefix.{split}",
                                             default_chosen_reward=float(data_cfg.get("default_chosen_reward", 1.0)),
                                             default_rejected_reward=float(data_cfg.get("default_rejected_reward", 0.0)))
    if "train" not in datasets:
        raise ConfigError("model.data.data_prefix.train is required (jsonl of prompt/chosen_response/rejected_response)")
    collate = partial(collate_dpo, pad_id=model.tokenizer.eos_id, seq_length=seq,
                      pad_to_multiple_of=data_cfg.get("pad_length_to_multiple_of") or 8)
    batches = OmegaConf.create({"global_batch_size": int(cfg.model.global_batch_size),
                                "micro_batch_size": int(cfg.model.micro_batch_size)})
    seed = int(cfg.model.get("seed", 1234))
    workers = int(data_cfg.get("num_workers", 0) or 0)
    train_dl = build_dataloader(datasets["train"], OmegaConf.merge(batches, {"shuffle": True, "drop_last": True}),
                                collate, info.dp_rank, info.dp, seed, num_workers=workers, train=True, key="model")
    val_dl = None
    if "validation" in datasets:
        val_dl = build_dataloader(datasets["validation"], OmegaConf.merge(batches, {"shuffle": False, "drop_last": False}),
                                  collate, info.dp_rank, info.dp, seed, num_workers=workers, train=False, key="model")
    dpo_cfg = cfg.trainer.dpo
    max_steps, _ = plan_max_steps(dpo_cfg, train_dl, "dpo")
    optimizer, scheduler = model.setup_optimization(max_steps, clip_grad=dpo_cfg.get("gradient_clip_val", 1.0))
    logger.info("%s: %.2fM parameters; %d training and %d validation pairs; %d steps", model.loss_kind,
                model.num_parameters() / 1e6, len(datasets["train"]), len(datasets.get("validation", [])), max_steps)
    trainer = SupervisedTrainer(dpo_cfg, model, optimizer, scheduler, train_dl, val_dl, exp.logger,
                                exp.checkpoint_callback, RunTimer(max_time_of(cfg, "dpo")), name="dpo")
    summary = fit_and_export(trainer, model, exp)
    summary["val_accuracy"] = trainer.last_val_metrics.get("accuracy", float("nan"))
    summary["val_reward_margin"] = trainer.last_val_metrics.get("reward_margin", float("nan"))
    if is_global_rank_zero():
        nemo_path = summary["nemo_path"]
        print(f"DPO ({model.loss_kind}) finished: {summary['steps']} steps, train loss {summary['final_train_loss']:.4f}, "
              f"validation loss {summary['final_val_loss']:.4f}, preference accuracy {summary['val_accuracy']:.3f}, "
              f"reward margin {summary['val_reward_margin']:.3f}, {summary['seconds']:.0f}s; "
              + (f".nemo written to {nemo_path}" if nemo_path else f"logs in {exp.log_dir}"), flush=True)
    return summary
