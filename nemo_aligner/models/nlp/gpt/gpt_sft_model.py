"""GPT for supervised fine-tuning: masked next-token loss over micro-batches and pipeline stages."""

from __future__ import annotations

from typing import Dict, Tuple

import torch
import torch.distributed as dist

from nemo_aligner.models.alignable_interface import SupervisedInterface
from nemo_aligner.models.nlp.gpt.megatron_gpt_model import MegatronGPTModel
from nemo_aligner.utils.distributed import broadcast_from_last_stage


def masked_token_loss(per_token_loss: torch.Tensor, loss_mask: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(mean over trained tokens, sum, count)`` of a ``[batch, seq]`` per-token loss."""
    mask = loss_mask.to(per_token_loss.dtype)
    total = (per_token_loss.float() * mask.float()).sum()
    count = mask.float().sum()
    return total / count.clamp(min=1.0), total, count


class GPTSFTModel(MegatronGPTModel, SupervisedInterface):
    """Next-token cross-entropy on the tokens where ``loss_mask`` is 1.

    The training loss of a step is the mean over micro-batches of each micro-batch's
    per-token mean (the quantity whose gradient is applied), averaged over data-parallel
    ranks. ``token_loss`` is the exact per-token mean over the whole global batch.
    """

    def __init__(self, cfg, tokenizer, precision="32", trainable: bool = True):
        super().__init__(cfg, tokenizer, precision, trainable)
        self.micro_batch_size = int(cfg.get("micro_batch_size", 1))
        self.val_micro_batch_size = int(cfg.get("val_micro_batch_size", self.micro_batch_size))
        self._active_micro_batch_size = self.micro_batch_size

    def loss_func(self, micro_batch: Dict[str, torch.Tensor], output: torch.Tensor):
        mean, total, count = masked_token_loss(output, micro_batch["loss_mask"])
        # clone: the schedule divides the returned loss in place by the number of micro-batches.
        return mean, {"loss": mean.detach().clone(), "loss_sum": total.detach(), "tokens": count.detach()}

    def get_loss_and_metrics(self, batch: Dict[str, torch.Tensor], forward_only: bool) -> Tuple[float, Dict[str, float]]:
        from megatron.core import parallel_state

        outputs = self.forward_backward(batch, self.loss_func, forward_only, self._active_micro_batch_size)
        # [mean of micro-batch means, loss sum, token count] on the last stage, zeros elsewhere.
        stats = torch.zeros(3, dtype=torch.float64)
        if parallel_state.is_pipeline_last_stage():
            stats[0] = torch.stack([o["loss"] for o in outputs]).double().mean()
            stats[1] = torch.stack([o["loss_sum"] for o in outputs]).double().sum()
            stats[2] = torch.stack([o["tokens"] for o in outputs]).double().sum()
        stats = broadcast_from_last_stage(stats)
        group = parallel_state.get_data_parallel_group()
        dp = dist.get_world_size(group)
        stats[0] /= dp
        dist.all_reduce(stats, group=group)
        loss = float(stats[0])
        token_loss = float(stats[1] / stats[2].clamp(min=1.0))
        return loss, {"loss": loss, "token_loss": token_loss, "tokens": float(stats[2]),
                      "loss_sum": float(stats[1])}

    def prepare_for_training_step(self) -> None:
        self.train()
        self._active_micro_batch_size = self.micro_batch_size
        self.zero_grad()

    def prepare_for_validation_step(self) -> None:
        self.eval()
        self._active_micro_batch_size = self.val_micro_batch_size

    def finish_validation_step(self) -> None:
        self._active_micro_batch_size = self.micro_batch_size
        self.train()
