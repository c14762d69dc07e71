"""SFT end to end from a Hydra config: data, model, optimizer, exp_manager, SupervisedTrainer."""

from __future__ import annotations

import logging

from typing import Dict

from omegaconf import DictConfig, open_dict

from nemo_aligner.recipes.prepare_packed import check_packed_attention
from nemo_aligner.recipes.run_helpers import fit_and_export, report_finished, sample_to_max_steps, sample_validation
from nemo_aligner.algorithms.supervised import SupervisedTrainer, plan_max_steps
from nemo_aligner.data.nlp.builders import build_dataloader, build_sft_dataset, sft_collate_fn
from nemo_aligner.data.nlp.jsonl import check_files_exist
from nemo_aligner.models.nlp.gpt.gpt_sft_model import GPTSFTModel
from nemo_aligner.models.nlp.gpt.loading import load_model
from nemo_aligner.utils.exp_manager import exp_manager
from nemo_aligner.utils.run_control import RunTimer, max_time_of
from nemo_aligner.utils.run_setup import init_run

logger = logging.getLogger(__name__)


def run_sft(cfg: DictConfig, callbacks=None, model_cls=GPTSFTModel, build_dataset=None, make_collate=None,
            what: str = "SFT") -> Dict[str, float]:
    """Fine-tune ``model.restore_from_path`` (or a fresh model) on ``model.data.*``; returns a summary.
    ``model_cls``, ``build_dataset(ds_cfg, model, seq_len, key)`` and ``make_collate(model, seq_len)``
    replace the SFT model and data (SteerLM 2.0)."""
    restore = cfg.model.get("restore_from_path")
    info = init_run(cfg, restore, "model.restore_from_path")
    exp = exp_manager(cfg.get("exp_manager"), cfg, default_name=str(cfg.get("name", "megatron_gpt_sft")))
    data_cfg = cfg.model.data
    with open_dict(cfg.model):
        cfg.model.micro_batch_size = data_cfg.train_ds.micro_batch_size
        cfg.model.global_batch_size = data_cfg.train_ds.global_batch_size
        cfg.model.val_micro_batch_size = data_cfg.validation_ds.get("micro_batch_size", cfg.model.micro_batch_size)

    for split in ("train_ds", "validation_ds"):  # before the model is built: a wrong path stops the run at once
        if not bool(data_cfg[split].get("packed_sequence", False)):
            check_files_exist(data_cfg[split].get("file_path") or data_cfg[split].get("file_names"))
    model = load_model(model_cls, cfg.model, cfg.trainer.precision, restore, key="model.restore_from_path")
    seq_len = int(model.cfg.encoder_seq_length)
    answer_only = bool(cfg.model.get("answer_only_loss", True))
    chat = bool(data_cfg.get("chat", False))
    tokens = data_cfg.get("chat_prompt_tokens")
    if build_dataset is None:
        def build_dataset(ds_cfg, model, seq, key):
            return build_sft_dataset(ds_cfg, model.tokenizer, seq, chat, answer_only, tokens, key=key)
    for split in ("train_ds", "validation_ds"):
        if bool(data_cfg[split].get("packed_sequence", False)):
            check_packed_attention(model, f"model.data.{split}.packed_sequence")
    train_ds = build_dataset(data_cfg.train_ds, model, seq_len, "model.data.train_ds")
    val_ds = build_dataset(data_cfg.validation_ds, model, seq_len, "model.data.validation_ds")
    collate = (make_collate(model, seq_len) if make_collate is not None
               else sft_collate_fn(model.tokenizer, seq_len, data_cfg.get("pad_to_multiple_of", 8)))
    seed = int(cfg.model.get("seed", 1234))
    train_ds = sample_to_max_steps(train_ds, cfg, "sft", data_cfg.train_ds.global_batch_size, seed)
    val_ds = sample_validation(val_ds, cfg, "sft", data_cfg.validation_ds.global_batch_size, seed)
    workers = int(data_cfg.get("num_workers", 0) or 0)
    train_dl = build_dataloader(train_ds, data_cfg.train_ds, collate, info.dp_rank, info.dp, seed,
                                num_workers=workers, train=True, key="model.data.train_ds")
    val_dl = build_dataloader(val_ds, data_cfg.validation_ds, collate, info.dp_rank, info.dp, seed,
                              num_workers=workers, train=False, key="model.data.validation_ds")

    sft_cfg = cfg.trainer.sft
    max_steps, _ = plan_max_steps(sft_cfg, train_dl, "sft")
    optimizer, scheduler = model.setup_optimization(max_steps, clip_grad=sft_cfg.get("gradient_clip_val", 1.0))
    logger.info("model: %.2fM parameters; %d training samples, %d validation samples; %d steps",
                model.num_parameters() / 1e6, len(train_ds), len(val_ds), max_steps)
    trainer = SupervisedTrainer(sft_cfg, model, optimizer, scheduler, train_dl, val_dl, exp.logger,
                                exp.checkpoint_callback, RunTimer(max_time_of(cfg, "sft")), name="sft")
    if callbacks is not None:
        trainer.callbacks = callbacks
    summary = fit_and_export(trainer, model, exp)
    summary["best_checkpoint"] = exp.checkpoint_callback.best() if exp.checkpoint_callback else None
    report_finished(summary, f"{what} finished: {summary['steps']} steps, {summary['epochs']} epochs, "
                             f"train loss {summary['final_train_loss']:.4f}, validation loss "
                             f"{summary['final_val_loss']:.4f} (best {summary['best_val_loss']:.4f})")
    return summary
