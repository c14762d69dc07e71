"""Reward-model training end to end from a Hydra config (NeMo-Aligner's train_reward_model.py)."""

from __future__ import annotations

import logging
from functools import partial
from typing import Dict

from omegaconf import DictConfig, OmegaConf

from nemo_aligner.recipes.run_helpers import fit_and_export, report_finished
from nemo_aligner.algorithms.supervised import SupervisedTrainer, plan_max_steps
from nemo_aligner.data.nlp.builders import build_dataloader
from nemo_aligner.data.nlp.reward_datasets import (
    RegressionRewardDataset,
    RewardComparisonDataset,
    collate_comparisons,
    collate_regression,
    data_prefix_paths,
)
from nemo_aligner.models.nlp.gpt.loading import load_model
from nemo_aligner.models.nlp.gpt.megatron_gpt_reward_model import MegatronGPTRewardModel
from nemo_aligner.utils.errors import ConfigError, DataError
from nemo_aligner.utils.exp_manager import exp_manager
from nemo_aligner.utils.run_control import RunTimer, max_time_of
from nemo_aligner.utils.preference_losses import BT_LOSSES
from nemo_aligner.utils.run_setup import init_run

logger = logging.getLogger(__name__)


def build_reward_dataset(model, data_cfg, split: str):
    """The comparison or regression dataset of ``model.data.data_prefix.<split>`` (None if not given)."""
    paths = data_prefix_paths(data_cfg, split)
    if paths is None:
        return None
    seq = int(data_cfg.get("seq_length") or model.cfg.encoder_seq_length)
    key = f"model.data.data_prefix.{split}"
    append_eod = bool(data_cfg.get("append_eod", True))
    if model.reward_model_type == "binary_ranking":
        return RewardComparisonDataset(paths, model.tokenizer, seq, key=key, add_eos=append_eod)
    regression = model.cfg.get("regression") or {}
    return RegressionRewardDataset(paths, model.tokenizer, seq, model.num_attributes,
                                   attribute_names=regression.get("attribute_names"), key=key,
                                   missing=model.loss_mask_val, add_eos=append_eod)


def check_preference_pairs(model, datasets: Dict[str, object]) -> int:
    """For a regression model trained with a Bradley-Terry loss (``model.regression.loss_func``
    ``*_bt``): consecutive records are pairs, the first carrying the preference strength as attribute 0
    (HelpSteer2-Preference's ``quality:<strength>``). Returns the records per group the samplers keep
    together: 2, or 1 for other losses."""
    if model.reward_model_type != "regression" or model.regression_loss not in BT_LOSSES:
        return 1
    kind = f"model.regression.loss_func={model.regression_loss}"
    if model.micro_batch_size % 2:
        raise ConfigError(f"model.micro_batch_size={model.micro_batch_size}: {kind} takes consecutive pairs of "
                          "records; use an even size (NeMo-Aligner: 2)")
    index = model.preference_index()
    if index >= model.num_attributes:
        raise ConfigError(f"{kind} trains output {index} (helpfulness) but model.regression.num_attributes="
                          f"{model.num_attributes}; use NeMo's nine SteerLM attributes (num_attributes=9)")
    for split, dataset in datasets.items():
        if dataset is None:
            continue
        if len(dataset) % 2:
            raise DataError(f"model.data.data_prefix.{split}: {len(dataset)} records; {kind} reads them as "
                            "consecutive pairs (an even count)")
        for i in range(0, len(dataset), 2):
            strength = dataset.items[i][1][0]
            if strength == model.loss_mask_val:
                raise DataError(f"model.data.data_prefix.{split}: record {i + 1} (the first of a pair) has no "
                                f"attribute 0 ({dataset.attribute_names[0]}), the preference strength {kind} reads")
    return 2


def run_reward_model(cfg: DictConfig) -> Dict[str, float]:
    """Train a reward model from ``pretrained_checkpoint.restore_from_path`` (or random weights)."""
    restore = (cfg.get("pretrained_checkpoint") or {}).get("restore_from_path")
    regression = cfg.model.get("regression") or {}
    if (str(cfg.model.get("reward_model_type", "binary_ranking")) == "regression"
            and bool(regression.get("merge_attributes", False)) and int(regression.get("num_attributes", 1) or 1) > 1):
        # the merged head outputs one value, which the loss would fit to every attribute's label
        raise ConfigError("model.regression.merge_attributes=True is for serving (one reward per response, e.g. "
                          "for PPO); train with it False, then serve with ++model.regression.merge_attributes=True "
                          "and ++model.regression.attribute_weights=[...]")
    info = init_run(cfg, restore, "pretrained_checkpoint.restore_from_path")
    exp = exp_manager(cfg.get("exp_manager"), cfg, default_name=str(cfg.get("name", "megatron_gpt")))
    # A new head is expected when starting from an SFT (or base) model.
    # NeMo-Aligner's model.regression.load_rm_head_weights (default False): a new head unless True
    load_head = bool((cfg.model.get("regression") or {}).get("load_rm_head_weights", False))
    model = load_model(MegatronGPTRewardModel, cfg.model, cfg.trainer.precision, restore,
                       key="pretrained_checkpoint.restore_from_path", allow_missing=("rm_head",),
                       keep_new=() if load_head else ("rm_head",))
    data_cfg = cfg.model.data
    train_ds = build_reward_dataset(model, data_cfg, "train")
    if train_ds is None:
        raise ConfigError("model.data.data_prefix.train is required")
    val_ds = build_reward_dataset(model, data_cfg, "validation")
    seq = int(data_cfg.get("seq_length") or model.cfg.encoder_seq_length)
    collate_fn = collate_comparisons if model.reward_model_type == "binary_ranking" else collate_regression
    collate = partial(collate_fn, pad_id=model.tokenizer.eos_id, seq_length=seq,
                      pad_to_multiple_of=data_cfg.get("pad_to_multiple_of", 8))
    batches = OmegaConf.create({"global_batch_size": int(cfg.model.global_batch_size),
                                "micro_batch_size": int(cfg.model.micro_batch_size)})
    seed = int(cfg.model.get("seed", 1234))
    workers = int(data_cfg.get("num_workers", 0) or 0)
    group = check_preference_pairs(model, {"train": train_ds, "validation": val_ds})
    # NeMo-Aligner's trainer.rm.{train,val}_random_sampler; a preference pair is shuffled as one
    shuffle_train = bool(cfg.trainer.rm.get("train_random_sampler", True))
    shuffle_val = bool(cfg.trainer.rm.get("val_random_sampler", False))
    train_dl = build_dataloader(train_ds, OmegaConf.merge(batches, {"shuffle": shuffle_train, "drop_last": True}),
                                collate, info.dp_rank, info.dp, seed, num_workers=workers, train=True,
                                key="model", group_size=group)
    val_dl = None
    if val_ds is not None:
        val_dl = build_dataloader(val_ds, OmegaConf.merge(batches, {"shuffle": shuffle_val, "drop_last": False}),
                                  collate, info.dp_rank, info.dp, seed, num_workers=workers, train=False, key="model",
                                  group_size=group)

    rm_cfg = cfg.trainer.rm
    max_steps, _ = plan_max_steps(rm_cfg, train_dl, "rm")
    optimizer, scheduler = model.setup_optimization(max_steps, clip_grad=rm_cfg.get("gradient_clip_val", 1.0))
    kind = "comparison pairs" if model.reward_model_type == "binary_ranking" else "labelled texts"
    logger.info("reward model (%s): %.2fM parameters; %d training and %d validation %s; %d steps",
                model.reward_model_type, model.num_parameters() / 1e6, len(train_ds), len(val_ds or []), kind, max_steps)
    trainer = SupervisedTrainer(rm_cfg, model, optimizer, scheduler, train_dl, val_dl, exp.logger,
                                exp.checkpoint_callback, RunTimer(max_time_of(cfg, "rm")), name="rm")
    summary = fit_and_export(trainer, model, exp)
    summary["val_accuracy"] = trainer.last_val_metrics.get("accuracy", float("nan"))
    quality = (f"validation accuracy {summary['val_accuracy']:.3f}" if model.reward_model_type == "binary_ranking"
               else f"validation MSE {trainer.last_val_metrics.get('mse', float('nan')):.4f}")
    report_finished(summary, f"Reward model finished: {summary['steps']} steps, train loss "
                             f"{summary['final_train_loss']:.4f}, validation loss {summary['final_val_loss']:.4f}, {quality}")
    return summary
