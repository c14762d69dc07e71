"""The end of every training run: resume, fit, write the final .nemo, close the loggers."""

from __future__ import annotations

import logging
from typing import Dict

logger = logging.getLogger(__name__)


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
        nemo_path = callback.save_nemo(model)
    exp.logger.finalize()
    summary.update(nemo_path=nemo_path, log_dir=exp.log_dir)
    return summary
