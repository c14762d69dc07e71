"""The end of every training run: resume, fit, write the final .nemo, close the loggers."""

from __future__ import annotations

import logging
from typing import Dict

logger = logging.getLogger(__name__)


def report_finished(summary: Dict, text: str) -> None:
    """Print (global rank 0) ``<text>, <seconds>s; `` and where the run's result is: the ``.nemo``
    written, else the log directory."""
    from nemo_aligner.utils.distributed import is_global_rank_zero

    if is_global_rank_zero():
        nemo_path = summary.get("nemo_path")
        print(f"{text}, {summary['seconds']:.0f}s; "
              + (f".nemo written to {nemo_path}" if nemo_path else f"logs in {summary['log_dir']}"), flush=True)


def start_from_checkpoint(cfg, model_cls, what: str, default_name: str):
    """The start of a run from ``pretrained_checkpoint.restore_from_path`` (``what`` it holds): distributed
    set-up, the experiment directory and loggers, the model. Returns ``(parallel info, exp, model)``."""
    from nemo_aligner.models.nlp.gpt.loading import load_model
    from nemo_aligner.utils.errors import ConfigError
    from nemo_aligner.utils.exp_manager import exp_manager
    from nemo_aligner.utils.run_setup import init_run

    restore = (cfg.get("pretrained_checkpoint") or {}).get("restore_from_path")
    if not restore:
        raise ConfigError(f"pretrained_checkpoint.restore_from_path is required: {what}")
    info = init_run(cfg, restore, "pretrained_checkpoint.restore_from_path")
    exp = exp_manager(cfg.get("exp_manager"), cfg, default_name=str(cfg.get("name", default_name)))
    model = load_model(model_cls, cfg.model, cfg.trainer.precision, restore, key="pretrained_checkpoint.restore_from_path")
    return info, exp, model


def fit_and_export(trainer, model, exp) -> Dict:
    """Resume from ``exp.resume_from`` if set, ``trainer.fit()``, and write ``<name>.nemo`` when training
    finished (``save_nemo_on_train_end``; with ``save_best_model``, from the best checkpoint's weights).
    Returns the trainer's summary plus ``nemo_path`` and ``log_dir``."""
    try:
        if exp.resume_from:
            trainer.load_checkpoint(exp.resume_from)
        summary = trainer.fit()
    finally:
        trainer.timer.close()
    stopped = trainer.timer.stop_reason
    if stopped:
        summary["stopped"] = stopped
    nemo_path = None
    callback = exp.checkpoint_callback
    if callback is not None and callback.save_nemo_on_train_end and trainer.step >= trainer.max_steps:
        best = callback.best() if callback.save_best_model else None
        if best is not None:  # NeMo's save_best_model: the .nemo gets the best weights, not the last
            logger.info("save_best_model: writing the .nemo from the best checkpoint %s", best)
            model.load_weights(best, what=f"best checkpoint {best}")
            summary["nemo_from_checkpoint"] = best
        # The weights the .nemo gets: the best checkpoint's, or the last step's (a checkpoint if one was saved then).
        source = best or (callback.last_saved if callback.last_saved_step == trainer.step else None)
        if callback.nemo_holds(source):  # always_save_nemo wrote it from that checkpoint: a second write is waste
            logger.info("save_nemo_on_train_end: %s already holds %s", callback.nemo_path, source)
            nemo_path = callback.nemo_path
        else:
            nemo_path = callback.save_nemo(model)
    exp.logger.finalize()
    summary.update(nemo_path=nemo_path, log_dir=exp.log_dir)
    return summary


def sample_to_max_steps(dataset, cfg, algorithm: str, global_batch_size: int, seed: int):
    """NeMo-Aligner's ``model.data.sample=True``: the training set becomes ``trainer.<algorithm>.max_steps``
    x ``global_batch_size`` records drawn from it (``SampledDataset``), so that ``max_steps`` may outlast
    one pass over the data (an epoch is then the whole run). Without a positive max_steps it is unchanged."""
    return _sampled(dataset, cfg, algorithm, "max_steps", global_batch_size, seed, "training")


def sample_validation(dataset, cfg, algorithm: str, global_batch_size: int, seed: int):
    """NeMo-Aligner's ``model.data.sample=True`` for the validation set: ``trainer.<algorithm>.limit_val_batches``
    x its ``global_batch_size`` records drawn from it, fewer or more than the file holds. A fraction
    (a float up to 1.0) or -1 leaves it as it is: Aligner's product is then no record count."""
    return _sampled(dataset, cfg, algorithm, "limit_val_batches", global_batch_size, seed, "validation")


def _sampled(dataset, cfg, algorithm: str, count_key: str, global_batch_size: int, seed: int, split: str):
    if not bool(cfg.model.data.get("sample", False)):
        return dataset
    from nemo_aligner.data.nlp.builders import SampledDataset

    count = cfg.trainer[algorithm].get(count_key)
    if count is None or isinstance(count, bool) or (isinstance(count, float) and count <= 1.0) or int(count) <= 0:
        logger.info("model.data.sample=True draws the %s set from trainer.%s.%s, a number of batches > 0 (it is "
                    "%s): the %s set is used as it is", split, algorithm, count_key, count, split)
        return dataset
    num_samples = int(count) * int(global_batch_size)
    logger.info("model.data.sample=True: %d %s records (trainer.%s.%s=%d x global_batch_size=%d) drawn from %d",
                num_samples, split, algorithm, count_key, int(count), int(global_batch_size), len(dataset))
    key = "model.data.train_ds" if split == "training" else "model.data.validation_ds"
    return SampledDataset(dataset, num_samples, seed, key=key)
