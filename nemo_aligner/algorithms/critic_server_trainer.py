"""CriticServerTrainer: trains the PPO critic on the batches the actor sends, saves on request."""

from __future__ import annotations

import logging
import time
from typing import Dict, Optional

import numpy as np
import torch

from nemo_aligner.utils.optim import current_lr
from nemo_aligner.utils.run_control import NonFiniteGuard
from nemo_aligner.utils.train_checkpoint import load_train_checkpoint

logger = logging.getLogger(__name__)


class CriticServerTrainer:
    """One ``train`` call = one pass over the actor's rollouts in global batches of ``model.global_batch_size``.

    The rows are padded with ``mask == 0`` rows up to a multiple of the global batch size, each
    data-parallel rank takes its share of every global batch, and each global batch is one
    optimizer step. Collective: every rank calls ``train`` with the same (broadcast) data.
    """

    def __init__(self, model, optimizer, scheduler, logger_, ckpt_callback, global_batch_size: int,
                 max_consecutive_nonfinite_steps: int = 10):
        from megatron.core import parallel_state

        self.model = model
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.logger = logger_
        self.ckpt_callback = ckpt_callback
        self.global_batch_size = int(global_batch_size)
        self.dp = parallel_state.get_data_parallel_world_size()
        self.dp_rank = parallel_state.get_data_parallel_rank()
        if self.global_batch_size % (self.dp * model.micro_batch_size):
            from nemo_aligner.utils.errors import ConfigError

            raise ConfigError(f"model.global_batch_size={self.global_batch_size} is not a multiple of data parallel "
                              f"{self.dp} x model.micro_batch_size={model.micro_batch_size}")
        self.nonfinite = NonFiniteGuard(max_consecutive_nonfinite_steps,
                                        "trainer.ppo.max_consecutive_nonfinite_steps (critic)", what="critic steps",
                                        advice="check the returns the actor sends")
        self.step = 0  # optimizer steps
        self.consumed_samples = 0
        self.train_calls = 0
        self.saved_train_calls = 0  # train_calls at the last checkpoint (written or resumed from)

    def state_dict(self) -> dict:
        return {"step": self.step, "consumed_samples": self.consumed_samples, "train_calls": self.train_calls,
                "epoch": 0}

    def load_checkpoint(self, path: str) -> None:
        state = load_train_checkpoint(path, self.model, self.optimizer, self.scheduler)
        self.step = int(state["step"])
        self.consumed_samples = int(state.get("consumed_samples", 0))
        self.train_calls = int(state.get("train_calls", 0))
        self.saved_train_calls = self.train_calls
        logger.info("critic resumed at optimizer step %d", self.step)

    def _padded(self, tokens, returns, prev_values, mask):
        rows = tokens.shape[0]
        target = -(-rows // self.global_batch_size) * self.global_batch_size
        extra = target - rows

        def pad(a, value=0):
            if not extra:
                return a
            return np.concatenate([a, np.full((extra,) + a.shape[1:], value, dtype=a.dtype)])

        return pad(tokens, self.model.tokenizer.eos_id), pad(returns), pad(prev_values), pad(mask), rows

    def train(self, tokens: np.ndarray, returns: np.ndarray, prev_values: np.ndarray, mask: np.ndarray) -> float:
        """Collective: train on the rollouts; returns the mean critic loss over the optimizer steps."""
        start = time.monotonic()
        tokens, returns, prev_values, mask, rows = self._padded(tokens, returns, prev_values, mask)
        self.model.prepare_for_training()
        local = self.global_batch_size // self.dp
        losses = []
        try:
            for begin in range(0, tokens.shape[0], self.global_batch_size):
                shard = slice(begin + self.dp_rank * local, begin + (self.dp_rank + 1) * local)
                batch = {"tokens": torch.from_numpy(tokens[shard]).long(),
                         "returns": torch.from_numpy(returns[shard]).float(),
                         "prev_values": torch.from_numpy(prev_values[shard]).float(),
                         "mask": torch.from_numpy(mask[shard]).float()}
                self.model.prepare_for_training_step()
                loss, metrics = self.model.get_loss_and_metrics(batch, forward_only=False)
                if not self.nonfinite.check(loss, self.model):
                    self.nonfinite.skip(self.optimizer, self.step + 1)
                    self.logger.log_metrics({"skipped_step": 1.0, "skipped_steps": float(self.nonfinite.total)},
                                            step=self.step + 1, prefix="critic/")
                    continue
                lr = current_lr(self.optimizer)  # the rate this update uses
                success, grad_norm, _ = self.optimizer.step()
                if success:
                    self.scheduler.step(increment=1)
                self.step += 1
                losses.append(loss)
                self.logger.log_metrics({"loss": loss, "lr": lr,
                                         "grad_norm": float(grad_norm or 0.0)}, step=self.step, prefix="critic/")
        finally:
            self.model.finish_training()
        self.consumed_samples += rows
        self.train_calls += 1
        mean = float(np.mean(losses)) if losses else float("nan")  # every step skipped: no loss to report
        logger.info("critic trained on %d rollouts in %d steps: loss %.4f (%.1fs)", rows, len(losses), mean,
                    time.monotonic() - start)
        return mean

    def log_times(self, **seconds: float) -> None:
        """Log the server's busy seconds per kind of request (``critic/time/<kind>``) at the current step."""
        self.logger.log_metrics({f"time/{k}": v for k, v in seconds.items()}, step=self.step, prefix="critic/")

    def save(self, metrics: Optional[Dict[str, float]] = None) -> Optional[str]:
        """Collective: a training checkpoint of the critic (what ``critic_save`` calls)."""
        if self.ckpt_callback is None:
            return None
        path = self.ckpt_callback.save(self.model, self.optimizer, self.scheduler, self.state_dict(), metrics or {})
        self.saved_train_calls = self.train_calls
        return path
