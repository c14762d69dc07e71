"""SupervisedTrainer: the fit loop for SFT and reward-model training."""

from __future__ import annotations

import logging
import math
import sys
import time
from typing import Dict, Optional, Tuple

import torch
import torch.distributed as dist
from tqdm import tqdm

from nemo_aligner.data.nlp.builders import limit_batches, sampler_of
from nemo_aligner.algorithms.callbacks import CallbackList
from nemo_aligner.algorithms.step_plumbing import StepSchedule, optimizer_update
from nemo_aligner.utils.distributed import host_all_reduce, is_global_rank_zero
from nemo_aligner.utils.optim import current_lr
from nemo_aligner.utils.run_control import NonFiniteGuard, RunTimer, compute_max_steps, interval_steps
from nemo_aligner.utils.train_checkpoint import load_train_checkpoint, run_identity

logger = logging.getLogger(__name__)


# Per-batch counts that weight the other metrics when validation batches are averaged.
_WEIGHT_KEYS = ("tokens", "pairs", "samples", "labels")


def aggregate_validation(per_batch: list) -> Dict[str, float]:
    """Average each metric over validation batches, weighted by the batch's count of tokens,
    pairs or labels when it reports one (a padded last batch then weighs what it holds; a
    per-attribute ``mse_<a>`` by its own ``labels_<a>``);
    ``loss`` is the exact per-token mean when batches report ``loss_sum`` and ``tokens``."""
    if not per_batch:
        return {}
    weight_key = next((k for k in _WEIGHT_KEYS if all(k in m for m in per_batch)), None)
    weights = [float(m[weight_key]) if weight_key else 1.0 for m in per_batch]
    total = sum(weights) or 1.0
    # "mse_<attribute>" is a mean over that attribute's own labels ("labels_<attribute>"), which a
    # batch may lack (missing labels): weighted by those counts, not by all of the batch's labels.
    own = {key: "labels_" + key[len("mse_"):] for key in per_batch[0]
           if key.startswith("mse_") and all("labels_" + key[len("mse_"):] in m for m in per_batch)}
    out = {key: sum(w * m[key] for w, m in zip(weights, per_batch)) / total
           for key in per_batch[0] if key not in _WEIGHT_KEYS and key not in own and key not in own.values()}
    for key, count_key in own.items():
        counts = [float(m[count_key]) for m in per_batch]
        out[key] = sum(c * m[key] for c, m in zip(counts, per_batch)) / max(sum(counts), 1.0)
        out[count_key] = sum(counts)
    if weight_key:
        out[weight_key] = sum(weights)
    if weight_key == "tokens" and all("loss_sum" in m for m in per_batch):
        out["loss"] = sum(m["loss_sum"] for m in per_batch) / max(total, 1.0)
        out.pop("token_loss", None)
        out.pop("loss_sum", None)
    return out


def progress_bar(total: int, initial: int, name: str) -> tqdm:
    """tqdm on global rank 0; redrawn at most every 5 s when the output is not a terminal (logs, CI)."""
    interactive = sys.stdout.isatty()
    return tqdm(total=total, initial=initial, desc=name, unit="step", disable=not is_global_rank_zero(),
                dynamic_ncols=True, leave=True, mininterval=0.1 if interactive else 5.0, file=sys.stdout)


def plan_max_steps(cfg, train_dataloader, name: str = "sft") -> Tuple[int, int]:
    """``(max_steps, steps_per_epoch)`` from ``max_steps``, ``max_epochs`` and ``limit_train_batches``."""
    sampler = sampler_of(train_dataloader)
    steps_per_epoch = limit_batches(cfg.get("limit_train_batches"), sampler.batches_per_epoch)
    max_steps = compute_max_steps(cfg.get("max_steps"), cfg.get("max_epochs"), steps_per_epoch, key=f"trainer.{name}")
    return max_steps, steps_per_epoch


class SupervisedTrainer(StepSchedule):
    """Train a ``SupervisedInterface`` model on fixed batches: step, validate, save, repeat.

    ``cfg`` is the algorithm's trainer section (``trainer.sft`` or ``trainer.rm``):
    ``max_steps``, ``max_epochs``, ``val_check_interval``, ``val_at_start``, ``save_interval``,
    ``limit_val_batches``, ``limit_train_batches``, ``max_time``.
    """

    def __init__(self, cfg, model, optimizer, scheduler, train_dataloader, val_dataloader, logger_,
                 ckpt_callback, run_timer: Optional[RunTimer] = None, name: str = "sft"):
        self.cfg = cfg
        self.model = model
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.train_dataloader = train_dataloader
        self.val_dataloader = val_dataloader
        self.logger = logger_
        self.ckpt_callback = ckpt_callback
        self.timer = run_timer or RunTimer(None)
        self.name = name
        self.step = 0
        self.consumed_samples = 0
        self.best_val: Optional[float] = None
        self.last_val_metrics: Dict[str, float] = {}
        self.last_train_metrics: Dict[str, float] = {}
        self.sampler = sampler_of(train_dataloader)
        self.max_steps, self.steps_per_epoch = plan_max_steps(cfg, train_dataloader, name)
        self.sampler.max_batches_per_epoch = self.steps_per_epoch
        self.global_batch_size = self.sampler.global_batch_size
        self.val_check_interval = interval_steps(cfg.get("val_check_interval"), self.steps_per_epoch)
        self.save_interval = interval_steps(cfg.get("save_interval"), self.steps_per_epoch)
        self.callbacks = CallbackList()  # the Python API sets its own
        self.nonfinite = NonFiniteGuard(cfg.get("max_consecutive_nonfinite_steps", 10),
                                        f"trainer.{self.name}.max_consecutive_nonfinite_steps")

    # ----------------------------------------------------------------- state
    @property
    def epoch(self) -> int:
        return self.consumed_samples // (self.steps_per_epoch * self.global_batch_size)

    def state_dict(self) -> dict:
        return {"step": self.step, "consumed_samples": self.consumed_samples, "epoch": self.epoch,
                "best_val": self.best_val, **run_identity(self.name, self.sampler)}

    def load_checkpoint(self, path: str) -> None:
        state = load_train_checkpoint(path, self.model, self.optimizer, self.scheduler,
                                      identity=run_identity(self.name, self.sampler), key=f"trainer.{self.name}")
        self.step = int(state["step"])
        self.consumed_samples = int(state["consumed_samples"])
        self.best_val = state.get("best_val")
        logger.info("resumed at step %d (%d samples consumed)", self.step, self.consumed_samples)

    # ----------------------------------------------------------------- steps
    def train_single_step(self, batch) -> Tuple[float, Dict[str, float]]:
        self.model.prepare_for_training_step()
        loss, metrics = self.model.get_loss_and_metrics(batch=batch, forward_only=False)
        self.model.finish_training_step()
        if not self.nonfinite.check(loss, self.model):
            return loss, self._skip_nonfinite_step(metrics)
        return loss, dict(metrics, **optimizer_update(self.optimizer, self.scheduler))

    @torch.no_grad()
    def run_validation(self) -> Dict[str, float]:
        if self.val_dataloader is None:
            return {}
        val_sampler = sampler_of(self.val_dataloader)
        total = val_sampler.batches_per_epoch if val_sampler else len(self.val_dataloader)
        num_batches = limit_batches(self.cfg.get("limit_val_batches"), total)
        per_batch = []
        for i, batch in enumerate(self.val_dataloader):
            if i >= num_batches:
                break
            self.model.prepare_for_validation_step()
            _, metrics = self.validation_loss(batch)
            self.model.finish_validation_step()
            per_batch.append(metrics)
        return aggregate_validation(per_batch)

    def validation_loss(self, batch) -> Tuple[float, Dict[str, float]]:
        """Loss and metrics of one validation batch."""
        return self.model.get_loss_and_metrics(batch=batch, forward_only=True)

    def _tokens_in(self, batch) -> float:
        """Tokens in the global batch (real ones when the batch has lengths), summed over data-parallel ranks."""
        from megatron.core import parallel_state

        length_keys = [k for k in ("lengths", "chosen_length", "rejected_length") if k in batch]
        if length_keys:
            local = sum(float(batch[k].sum()) for k in length_keys)
        else:  # padded token tensors
            local = sum(batch[k].numel() for k in ("tokens", "chosen", "rejected") if k in batch)
        count = torch.tensor([float(local)])
        if dist.is_initialized():
            count = host_all_reduce(count, group=parallel_state.get_data_parallel_group())
        return float(count.item())

    def validate(self) -> Dict[str, float]:
        metrics = self.run_validation()
        if metrics:
            val = metrics["loss"]
            metrics["val_loss"] = metrics["validation_loss"] = val
            self.best_val = val if self.best_val is None else min(self.best_val, val)
            self.logger.log_metrics({k: v for k, v in metrics.items() if k not in ("val_loss", "validation_loss")},
                                    step=self.step, prefix="val/")
            self.last_val_metrics = metrics
        return metrics

    def save(self, val_metrics: Optional[Dict[str, float]] = None) -> Optional[str]:
        """Save a checkpoint scored by ``val_metrics``: this step's validation, or none (a save between
        validations must not carry an earlier step's score, or pruning could keep it over the
        checkpoint that earned that score)."""
        if self.ckpt_callback is None:
            return None
        metrics = dict(val_metrics or {})
        metrics.update({f"train_{k}": v for k, v in self.last_train_metrics.items()})
        return self.ckpt_callback.save(self.model, self.optimizer, self.scheduler, self.state_dict(), metrics)

    def _skip_nonfinite_step(self, metrics: Dict[str, float]) -> Dict[str, float]:
        """Drop this step's gradients (no optimizer or scheduler step); stop after too many in a row."""
        self.nonfinite.skip(self.optimizer, self.step + 1)
        metrics = {k: v for k, v in dict(metrics).items() if isinstance(v, (int, float)) and math.isfinite(v)}
        metrics.update(skipped_step=1.0, skipped_steps=float(self.nonfinite.total), lr=current_lr(self.optimizer))
        return metrics

    # ----------------------------------------------------------------- loop
    def fit(self) -> Dict[str, float]:
        """Train until ``max_steps``/``max_epochs``/``max_time``; validate and save on the intervals."""
        if self.step >= self.max_steps:
            logger.info("already trained %d of %d steps; nothing to do", self.step, self.max_steps)
            return self.summary(0.0)
        if self.step == 0 and self.cfg.get("val_at_start", False):
            self.validate()  # the starting model's validation, logged at step 0
        start = time.monotonic()
        bar = progress_bar(self.max_steps, self.step, self.name)
        stop = False
        self.callbacks.on_train_begin()
        try:
            while self.step < self.max_steps and not stop:
                self.sampler.consumed_samples = self.consumed_samples
                steps_left_in_epoch = self.steps_per_epoch - (self.consumed_samples // self.global_batch_size) % self.steps_per_epoch
                for i, batch in enumerate(self.train_dataloader):
                    if i >= steps_left_in_epoch or self.step >= self.max_steps:
                        break
                    t0 = time.monotonic()
                    self.callbacks.on_step_begin(self.step + 1)
                    epoch_before = self.epoch
                    loss, metrics = self.train_single_step(batch)
                    self.step += 1
                    self.consumed_samples += self.global_batch_size
                    tokens = self._tokens_in(batch)
                    elapsed = time.monotonic() - t0
                    metrics.update(loss=loss, tokens_per_sec=tokens / max(elapsed, 1e-9), step_time=elapsed,
                                   consumed_samples=self.consumed_samples, epoch=self.epoch)
                    self.last_train_metrics = {"loss": loss}
                    self.logger.log_metrics(metrics, step=self.step, prefix="train/")
                    bar.update(1)
                    bar.set_postfix(loss=f"{loss:.4f}", lr=f"{metrics['lr']:.2e}",
                                    tok_s=f"{metrics['tokens_per_sec']:.0f}", refresh=False)

                    stop = self.end_of_step(metrics, epoch_before, bar, lambda val: (
                        f"step {self.step}: train loss {loss:.4f}, validation loss {val['loss']:.4f}"))
                    if stop:
                        break
        finally:
            bar.close()
        summary = self.summary(time.monotonic() - start)
        self.callbacks.on_train_end(summary)
        return summary

    def callback_validation_metrics(self, val: Dict[str, float]) -> Dict[str, float]:
        return {f"val_{k}": v for k, v in val.items()}

    def summary(self, seconds: float) -> Dict[str, float]:
        return {"steps": self.step, "epochs": self.epoch, "consumed_samples": self.consumed_samples,
                "final_train_loss": self.last_train_metrics.get("loss", float("nan")),
                "final_val_loss": self.last_val_metrics.get("loss", float("nan")),
                "best_val_loss": self.best_val if self.best_val is not None else float("nan"),
                "seconds": seconds}
