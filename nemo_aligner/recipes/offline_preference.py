"""The shared run of offline preference methods (DPO family, KTO): a policy and its frozen
reference from one checkpoint, jsonl data from ``model.data.data_prefix``, SupervisedTrainer."""

from __future__ import annotations

import logging
from typing import Callable

from omegaconf import DictConfig, OmegaConf

from nemo_aligner.recipes.run_helpers import fit_and_export
from nemo_aligner.algorithms.supervised import SupervisedTrainer, plan_max_steps
from nemo_aligner.data.nlp.builders import build_dataloader
from nemo_aligner.data.nlp.reward_datasets import data_prefix_paths
from nemo_aligner.models.nlp.gpt.loading import load_model
from nemo_aligner.utils.errors import ConfigError
from nemo_aligner.utils.exp_manager import exp_manager
from nemo_aligner.utils.run_control import RunTimer, max_time_of
from nemo_aligner.utils.run_setup import init_run

logger = logging.getLogger(__name__)


def run_offline_preference(cfg: DictConfig, name: str, model_cls, make_dataset: Callable, make_collate: Callable,
                           data_description: str, callbacks=None):
    """Train ``pretrained_checkpoint.restore_from_path`` with ``trainer.<name>``; the reference
    policy is that checkpoint. ``make_dataset(paths, model, seq_length, key)`` and
    ``make_collate(model, seq_length)`` build the data. Returns ``(summary, trainer, model)``."""
    restore = (cfg.get("pretrained_checkpoint") or {}).get("restore_from_path")
    if not restore:
        raise ConfigError("pretrained_checkpoint.restore_from_path is required: the SFT .nemo to align")
    info = init_run(cfg, restore, "pretrained_checkpoint.restore_from_path")
    exp = exp_manager(cfg.get("exp_manager"), cfg, default_name=str(cfg.get("name", "megatron_gpt")))
    model = load_model(model_cls, cfg.model, cfg.trainer.precision, restore, key="pretrained_checkpoint.restore_from_path")
    model.snapshot_reference_policy()  # before any resume: the reference is the starting checkpoint
    data_cfg = cfg.model.data
    seq = int(data_cfg.get("seq_length") or model.cfg.encoder_seq_length)
    datasets = {}
    for split in ("train", "validation"):
        paths = data_prefix_paths(data_cfg, split)
        if paths:
            datasets[split] = make_dataset(paths, model, seq, f"model.data.data_prefix.{split}")
    if "train" not in datasets:
        raise ConfigError(f"model.data.data_prefix.train is required (jsonl of {data_description})")
    collate = make_collate(model, seq)
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
    trainer_cfg = cfg.trainer[name]
    max_steps, _ = plan_max_steps(trainer_cfg, train_dl, name)
    optimizer, scheduler = model.setup_optimization(max_steps, clip_grad=trainer_cfg.get("gradient_clip_val", 1.0))
    logger.info("%s: %.2fM parameters; %d training and %d validation examples; %d steps", model.loss_kind,
                model.num_parameters() / 1e6, len(datasets["train"]), len(datasets.get("validation", [])), max_steps)
    trainer = SupervisedTrainer(trainer_cfg, model, optimizer, scheduler, train_dl, val_dl, exp.logger,
                                exp.checkpoint_callback, RunTimer(max_time_of(cfg, name)), name=name)
    if callbacks is not None:
        trainer.callbacks = callbacks
    summary = fit_and_export(trainer, model, exp)
    summary["log_dir"] = exp.log_dir
    summary["best_checkpoint"] = exp.checkpoint_callback.best() if exp.checkpoint_callback else None
    return summary, trainer, model
