"""Knowledge distillation end to end from a Hydra config (NeMo-Aligner's
``train_gpt_knowledge_distillation.py``): the student from ``pretrained_checkpoint.restore_from_path``,
records of ``compute_topk_logits.py`` from ``model.data.data_prefix``, SupervisedTrainer."""

from __future__ import annotations

import logging
from functools import partial
from typing import Dict

from omegaconf import DictConfig, OmegaConf

from nemo_aligner.algorithms.supervised import SupervisedTrainer, plan_max_steps
from nemo_aligner.data.nlp.builders import build_dataloader
from nemo_aligner.data.nlp.kd_dataset import KnowledgeDistillationDataset, collate_kd
from nemo_aligner.data.nlp.reward_datasets import data_prefix_paths
from nemo_aligner.models.nlp.gpt.loading import load_model
from nemo_aligner.models.nlp.gpt.megatron_gpt_knowledge_distillation import MegatronGPTKnowledgeDistillationModel
from nemo_aligner.recipes.run_helpers import fit_and_export
from nemo_aligner.utils.distributed import is_global_rank_zero
from nemo_aligner.utils.errors import ConfigError
from nemo_aligner.utils.exp_manager import exp_manager
from nemo_aligner.utils.run_control import RunTimer, max_time_of
from nemo_aligner.utils.run_setup import init_run

logger = logging.getLogger(__name__)
NAME = "knowledge_distillation"


def run_knowledge_distillation(cfg: DictConfig, callbacks=None) -> Dict[str, float]:
    """Train the student ``pretrained_checkpoint.restore_from_path`` towards the teacher's top-k logits."""
    restore = (cfg.get("pretrained_checkpoint") or {}).get("restore_from_path")
    if not restore:
        raise ConfigError("pretrained_checkpoint.restore_from_path is required: the student .nemo")
    info = init_run(cfg, restore, "pretrained_checkpoint.restore_from_path")
    exp = exp_manager(cfg.get("exp_manager"), cfg, default_name=str(cfg.get("name", "megatron_gpt_knowledge_distillation")))
    model = load_model(MegatronGPTKnowledgeDistillationModel, cfg.model, cfg.trainer.precision, restore,
                       key="pretrained_checkpoint.restore_from_path")
    data_cfg = cfg.model.data
    seq = int(model.cfg.encoder_seq_length)
    top_k = data_cfg.get("top_k")
    if top_k is not None and int(top_k) < 1:
        raise ConfigError(f"model.data.top_k={top_k} must be >= 1 (or null: every logit in the records)")
    datasets = {}
    for split in ("train", "validation"):
        paths = data_prefix_paths(data_cfg, split)
        if paths:
            datasets[split] = KnowledgeDistillationDataset(paths, model.tokenizer.vocab_size, seq, top_k,
                                                           key=f"model.data.data_prefix.{split}")
    if "train" not in datasets:
        raise ConfigError("model.data.data_prefix.train is required (records of compute_topk_logits.py)")
    collate = partial(collate_kd, pad_id=model.tokenizer.eos_id,
                      pad_to_multiple_of=data_cfg.get("pad_to_multiple_of", 8))
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
    trainer_cfg = cfg.trainer[NAME]
    max_steps, _ = plan_max_steps(trainer_cfg, train_dl, NAME)
    optimizer, scheduler = model.setup_optimization(max_steps, clip_grad=trainer_cfg.get("gradient_clip_val", 1.0))
    logger.info("knowledge distillation (%s, top-%d): %.2fM parameters; %d training and %d validation records; "
                "%d steps", model.kd_kind, datasets["train"].k, model.num_parameters() / 1e6, len(datasets["train"]),
                len(datasets.get("validation", [])), max_steps)
    trainer = SupervisedTrainer(trainer_cfg, model, optimizer, scheduler, train_dl, val_dl, exp.logger,
                                exp.checkpoint_callback, RunTimer(max_time_of(cfg, NAME)), name=NAME)
    if callbacks is not None:
        trainer.callbacks = callbacks
    if trainer_cfg.get("val_at_start", False) and val_dl is not None and not exp.resume_from:
        trainer.validate()  # the student's starting distance to the teacher, logged at step 0
    summary = fit_and_export(trainer, model, exp)
    summary["best_checkpoint"] = exp.checkpoint_callback.best() if exp.checkpoint_callback else None
    summary["val_kd_loss"] = trainer.last_val_metrics.get("kd_loss", float("nan"))
    if is_global_rank_zero():
        nemo_path = summary["nemo_path"]
        print(f"Knowledge distillation finished: {summary['steps']} steps, train loss {summary['final_train_loss']:.4f}, "
              f"validation loss {summary['final_val_loss']:.4f} (KL to the teacher {summary['val_kd_loss']:.4f}), "
              f"{summary['seconds']:.0f}s; " + (f".nemo written to {nemo_path}" if nemo_path else
                                                f"logs in {summary['log_dir']}"), flush=True)
    return summary
