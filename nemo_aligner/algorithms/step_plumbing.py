"""What every trainer loop does around its own step: the optimizer update and, after each step,
validation, checkpoints, callbacks and the time limit on their intervals."""

from __future__ import annotations

import logging
from typing import Callable, Dict

from nemo_aligner.utils.distributed import is_global_rank_zero
from nemo_aligner.utils.optim import current_lr

logger = logging.getLogger(__name__)


def optimizer_update(optimizer, scheduler) -> Dict[str, float]:
    """One optimizer step, and a scheduler step when the optimizer took it (an fp16 overflow skips
    it); returns the learning rate the step used, the gradient norm and ``skipped_step``."""
    lr = current_lr(optimizer)  # the rate this step uses (the scheduler moves it on below)
    success, grad_norm, _ = optimizer.step()
    if success:
        scheduler.step(increment=1)
    metrics = {"lr": lr}
    if grad_norm is not None:
        metrics["grad_norm"] = float(grad_norm)
    if not success:
        metrics["skipped_step"] = 1.0
    return metrics


class StepSchedule:
    """For a trainer with ``step``, ``max_steps``, ``epoch``, ``val_check_interval``, ``save_interval``,
    ``timer``, ``callbacks``, ``name``, ``validate()`` and ``save(val_metrics)``."""

    def end_of_step(self, metrics: Dict[str, float], epoch_before: int, bar,
                    report: Callable[[Dict[str, float]], str]) -> bool:
        """Validate, save and call back as the intervals say after step ``self.step``; returns
        whether to stop (the time limit: a checkpoint was saved). ``report(val)``: the line the
        progress bar prints after a validation."""
        is_end = self.step >= self.max_steps
        ran_val = bool((self.val_check_interval > 0 and self.step % self.val_check_interval == 0) or is_end)
        val: Dict[str, float] = {}
        if ran_val:
            val = self.validate()
            if val and is_global_rank_zero():
                bar.write(report(val))
        out_of_time = self.timer.is_finished()
        if (self.save_interval > 0 and self.step % self.save_interval == 0) or is_end or out_of_time:
            # scored by this step's validation only: an earlier score would let pruning keep this
            # checkpoint over the one that earned it
            self.save(val if ran_val else None)
        self.callbacks.on_step_end(self.step, dict(metrics, **self.callback_validation_metrics(val)))
        if self.epoch > epoch_before:
            self.callbacks.on_epoch_end(epoch_before)
        if out_of_time:
            logger.info("%s after %d %s steps; checkpoint saved, stopping", self.timer.stop_reason, self.step,
                        self.name)
        return out_of_time

    def callback_validation_metrics(self, val: Dict[str, float]) -> Dict[str, float]:
        """Validation metrics as the step-end callbacks receive them."""
        return val
