"""SteerLM 2.0 (NeMo-Aligner's ``GPTSteerLMModel``): attribute-conditioned SFT on sampled responses,
each weighted by ``ws - b``: ``ws`` the normalised importance weights towards
``P(y|a,x) ~ P(a|x,y) P(y|x)`` (from the data), ``b = softmax(log Q_theta(y|a,x) - log Q'(y|a,x))``
over the same record's responses (the current policy's own reweighting, the baseline). The gradient
is ``-sum_i (ws_i - b_i) grad log Q_theta(y_i|a,x)``: zero once the policy reweights its samples as
the target does."""

from __future__ import annotations

from typing import Dict, Tuple

import torch

from nemo_aligner.models.nlp.gpt.gpt_sft_model import GPTSFTModel
from nemo_aligner.utils.errors import ConfigError


def steerlm2_weights(ws: torch.Tensor, row_nll: torch.Tensor, log_q: torch.Tensor, num_responses: int):
    """``(ws - b, b, KL(ws || b) per record)`` for rows grouped record-major, ``num_responses`` per record."""
    ws = ws.double().view(-1, num_responses)
    base = torch.softmax((-row_nll.double() - log_q.double()).view(-1, num_responses), dim=-1)
    distance = ((ws + 1e-8) * torch.log((ws + 1e-8) / (base + 1e-8))).sum(-1)  # NeMo-Aligner's "distance"
    return (ws - base).reshape(-1), base.reshape(-1), distance


class GPTSteerLM2Model(GPTSFTModel):
    """``model.steerlm2.micro_batch_size`` (rows per micro-batch of the weighted loss) and
    ``forward_micro_batch_size`` (rows per micro-batch of the pass that computes the weights)."""

    def __init__(self, cfg, tokenizer, precision="32", trainable: bool = True):
        super().__init__(cfg, tokenizer, precision, trainable)
        s2 = cfg.get("steerlm2") or {}
        self.loss_micro_batch_size = int(s2.get("micro_batch_size") or self.micro_batch_size)
        self.weight_micro_batch_size = int(s2.get("forward_micro_batch_size") or self.loss_micro_batch_size)
        for key, value in (("micro_batch_size", self.loss_micro_batch_size),
                           ("forward_micro_batch_size", self.weight_micro_batch_size)):
            if value < 1:
                raise ConfigError(f"model.steerlm2.{key}={value} must be >= 1")

    def _micro_batch(self, rows: int, size: int, key: str) -> int:
        if rows % size:
            raise ConfigError(f"model.steerlm2.{key}={size} must divide the {rows} response rows of a step on each "
                              "data-parallel rank (records per rank x responses per record)")
        return size

    @torch.no_grad()
    def row_nll(self, batch: Dict[str, torch.Tensor]) -> torch.Tensor:
        """``-log Q_theta(y|a,x)`` of every row (summed over its response tokens), on every rank."""
        from megatron.core import parallel_state

        from nemo_aligner.utils.distributed import broadcast_from_last_stage

        data = {k: batch[k] for k in ("tokens", "labels", "position_ids")}
        mbs = self._micro_batch(batch["tokens"].shape[0], self.weight_micro_batch_size, "forward_micro_batch_size")
        outputs = self.forward_backward(data, None, True, mbs)
        nll = torch.zeros(batch["tokens"].shape[0], dtype=torch.float32)
        if parallel_state.is_pipeline_last_stage():
            nll = (torch.cat([o.float() for o in outputs]).cpu() * batch["loss_mask"]).sum(-1)
        return broadcast_from_last_stage(nll)

    def _weighted_loss(self, mb, per_token_ce):
        per_row = (per_token_ce.float() * mb["loss_mask"]).sum(-1)
        loss = (per_row * mb["scale"]).sum() * mb["num_micro_batches"][0]  # the schedule divides by it again
        return loss, {"loss_sum": (per_row * mb["scale"]).sum().detach()}

    def get_loss_and_metrics(self, batch: Dict[str, torch.Tensor], forward_only: bool) -> Tuple[float, Dict[str, float]]:
        """One step's records on this data-parallel rank: weights from a forward pass, then the
        weighted NLL ``sum_i (ws_i - b_i) NLL_i / (mean response tokens of the record) / records``."""
        rows = batch["tokens"].shape[0]
        groups = int(batch["group"].max()) + 1
        n = rows // groups
        training = self.module.training
        self.eval()  # the weights' pass: no dropout
        nll = self.row_nll(batch)
        if training:
            self.train()
        weight, base, distance = steerlm2_weights(batch["ws"], nll, batch["log_q"], n)
        tokens = batch["loss_mask"].sum(-1).view(groups, n).mean(-1).clamp(min=1.0)
        scale = (weight.view(groups, n) / tokens.double().unsqueeze(-1)).reshape(-1) / groups
        mbs = self._micro_batch(rows, self.loss_micro_batch_size, "micro_batch_size")
        data = {k: batch[k] for k in ("tokens", "labels", "loss_mask", "position_ids")}
        data["scale"] = scale.float()
        data["num_micro_batches"] = torch.full((rows,), float(rows // mbs))
        outputs = self.forward_backward(data, self._weighted_loss, forward_only, mbs)
        m = self.reduce_metrics(outputs, mean_keys=("loss_sum",))
        loss = m["loss_sum"] * (rows // mbs)  # the mean over micro-batches back to the sum over them
        extra = torch.tensor([float(distance.mean()), float((batch["ws"].view(groups, n) * nll.view(groups, n)).sum(-1).mean()),
                              float(nll.mean())], dtype=torch.float64)
        extra = self._dp_mean(extra)
        return loss, {"loss": loss, "distance": float(extra[0]), "ws_weighted_nll": float(extra[1]),
                      "response_nll": float(extra[2])}

    @staticmethod
    def _dp_mean(values: torch.Tensor) -> torch.Tensor:
        import torch.distributed as dist
        from megatron.core import parallel_state

        from nemo_aligner.utils.distributed import host_all_reduce

        if not dist.is_initialized():
            return values
        group = parallel_state.get_data_parallel_group()
        return host_all_reduce(values, group=group) / dist.get_world_size(group)
