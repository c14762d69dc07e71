"""SPIN end to end from a Hydra config (NeMo-Aligner's ``train_gpt_spin.py``): the policy and its
first reference from ``pretrained_checkpoint.restore_from_path``, SFT data from
``model.data.train_ds``/``validation_ds``, SPINTrainer."""

from __future__ import annotations

import logging
from functools import partial
from typing import Dict

from omegaconf import DictConfig, OmegaConf

from nemo_aligner.algorithms.spin import SPINTrainer, plan_spin_steps
from nemo_aligner.data.nlp.builders import build_dataloader, build_sft_dataset
from nemo_aligner.data.nlp.spin_dataset import collate_spin
from nemo_aligner.models.nlp.gpt.megatron_gpt_spin_model import MegatronGPTSPINModel
from nemo_aligner.recipes.run_helpers import (fit_and_export, report_finished, sample_to_max_steps, sample_validation,
                                              start_from_checkpoint)
from nemo_aligner.utils.run_control import RunTimer, max_time_of

logger = logging.getLogger(__name__)


def run_spin(cfg: DictConfig, callbacks=None) -> Dict[str, float]:
    """Train ``pretrained_checkpoint.restore_from_path`` by self-play on SFT data; returns a summary."""
    info, exp, model = start_from_checkpoint(cfg, MegatronGPTSPINModel, "the SFT .nemo to start from", "megatron_gpt")
    spin_cfg = cfg.trainer.spin
    model.check_iterations(int(spin_cfg.get("max_iterations", 1) or 1))
    model.snapshot_reference_policy()  # iteration 0 plays against the starting checkpoint (a resume loads its own)
    data_cfg = cfg.model.data
    seq = int(model.cfg.encoder_seq_length)
    chat, tokens = bool(data_cfg.get("chat", False)), data_cfg.get("chat_prompt_tokens")
    train_ds = build_sft_dataset(data_cfg.train_ds, model.tokenizer, seq, chat, True, tokens, key="model.data.train_ds")
    collate = partial(collate_spin, pad_id=model.tokenizer.eos_id, max_seq_length=seq,
                      pad_to_multiple_of=data_cfg.get("pad_to_multiple_of", 8))
    seed = int(cfg.model.get("seed", 1234))
    train_ds = sample_to_max_steps(train_ds, cfg, "spin", cfg.model.global_batch_size, seed)
    workers = int(data_cfg.get("num_workers", 0) or 0)
    train_batches = OmegaConf.create({"global_batch_size": int(cfg.model.global_batch_size),
                                      "micro_batch_size": int(cfg.model.micro_batch_size),
                                      "shuffle": bool(data_cfg.train_ds.get("shuffle", True)), "drop_last": True})
    train_dl = build_dataloader(train_ds, train_batches, collate, info.dp_rank, info.dp, seed, num_workers=workers,
                                train=True, key="model")
    val_dl, n_val = None, 0
    val_cfg = data_cfg.get("validation_ds")
    if val_cfg is not None and (val_cfg.get("file_path") or val_cfg.get("file_names")):
        val_ds = build_sft_dataset(val_cfg, model.tokenizer, seq, chat, True, tokens, key="model.data.validation_ds")
        val_batches = OmegaConf.create({
            "global_batch_size": int(val_cfg.get("global_batch_size") or cfg.model.global_batch_size),
            "micro_batch_size": int(val_cfg.get("micro_batch_size") or cfg.model.micro_batch_size),
            "shuffle": False, "drop_last": bool(val_cfg.get("drop_last", False))})
        val_ds = sample_validation(val_ds, cfg, "spin", val_batches.global_batch_size, seed)
        val_dl = build_dataloader(val_ds, val_batches, collate, info.dp_rank, info.dp, seed, num_workers=workers,
                                  train=False, key="model.data.validation_ds")
        n_val = len(val_ds)
    max_steps, _, per_iteration = plan_spin_steps(spin_cfg, train_dl)
    optimizer, scheduler = model.setup_optimization(max_steps, clip_grad=spin_cfg.get("gradient_clip_val", 1.0))
    logger.info("SPIN: %.2fM parameters; %d training and %d validation examples; %d steps (%d per iteration)",
                model.num_parameters() / 1e6, len(train_ds), n_val, max_steps, per_iteration)
    trainer = SPINTrainer(spin_cfg, model, optimizer, scheduler, train_dl, val_dl, exp.logger,
                          exp.checkpoint_callback, RunTimer(max_time_of(cfg, "spin")), seed=seed)
    if callbacks is not None:
        trainer.callbacks = callbacks
    summary = fit_and_export(trainer, model, exp)
    summary["best_checkpoint"] = exp.checkpoint_callback.best() if exp.checkpoint_callback else None
    report_finished(summary, f"SPIN finished: {summary['steps']} steps in {summary['iterations']} "
                             f"iteration{'' if summary['iterations'] == 1 else 's'}, train "
                             f"loss {summary['final_train_loss']:.4f}, validation SFT loss {summary['final_val_loss']:.4f}")
    return summary
