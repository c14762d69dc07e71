"""The shared run of offline methods on ``model.data.data_prefix`` jsonl data (DPO family, KTO,
knowledge distillation): a model (and, when it keeps one, its frozen reference) from one checkpoint,
SupervisedTrainer."""

from __future__ import annotations

import logging
from typing import Callable

from omegaconf import DictConfig, OmegaConf

from nemo_aligner.recipes.run_helpers import fit_and_export, start_from_checkpoint
from nemo_aligner.algorithms.supervised import SupervisedTrainer, plan_max_steps
from nemo_aligner.data.nlp.builders import build_dataloader
from nemo_aligner.data.nlp.reward_datasets import data_prefix_paths
from nemo_aligner.utils.errors import ConfigError
from nemo_aligner.utils.run_control import RunTimer, max_time_of

logger = logging.getLogger(__name__)


def run_offline_preference(cfg: DictConfig, name: str, model_cls, make_dataset: Callable, make_collate: Callable,
                           data_description: str, callbacks=None, checkpoint_holds: str = "the SFT .nemo to align",
                           chunked_data: bool = False, packed_data: bool = False):
    """Train ``pretrained_checkpoint.restore_from_path`` (``checkpoint_holds``) with ``trainer.<name>``;
    a model with a reference policy takes that checkpoint as it. ``make_dataset(paths, model,
    seq_length, key)`` and ``make_collate(model, seq_length)`` build the data (``chunked_data``:
    ``model.data.data_impl=chunked_jsonl`` paths are read). Returns ``(summary, trainer, model)``."""
    info, exp, model = start_from_checkpoint(cfg, model_cls, checkpoint_holds, "megatron_gpt")
    if hasattr(model, "snapshot_reference_policy"):
        model.snapshot_reference_policy()  # before any resume: the reference is the starting checkpoint
    data_cfg = cfg.model.data
    seq = int(data_cfg.get("seq_length") or model.cfg.encoder_seq_length)
    datasets = {}
    for split in ("train", "validation"):
        paths = data_prefix_paths(data_cfg, split, chunks=chunked_data, packs=packed_data)
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
    logger.info("%s: %.2fM parameters; %d training and %d validation examples; %d steps", getattr(model, "loss_kind", name),
                model.num_parameters() / 1e6, len(datasets["train"]), len(datasets.get("validation", [])), max_steps)
    trainer = SupervisedTrainer(trainer_cfg, model, optimizer, scheduler, train_dl, val_dl, exp.logger,
                                exp.checkpoint_callback, RunTimer(max_time_of(cfg, name)), name=name)
    if callbacks is not None:
        trainer.callbacks = callbacks
    summary = fit_and_export(trainer, model, exp)
    summary["log_dir"] = exp.log_dir
    summary["best_checkpoint"] = exp.checkpoint_callback.best() if exp.checkpoint_callback else None
    return summary, trainer, model
