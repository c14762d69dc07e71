"""The PPO critic: a value per token, trained on the clipped value loss. With
``combine_rm_and_critic_server`` the reward model's weights (same network, scalar head) are
kept on the CPU and swapped in to score finished sequences, so one server returns both."""

from __future__ import annotations

from typing import Dict, Optional, Tuple

import torch

from nemo_aligner.models.alignable_interface import CriticModelInterface
from nemo_aligner.models.nlp.gpt.megatron_gpt_reward_model import MegatronGPTRewardModel
from nemo_aligner.utils import ppo_utils
from nemo_aligner.models.nlp.gpt.expert_lockstep import swapped_weights


class MegatronGPTCriticModel(MegatronGPTRewardModel, CriticModelInterface):
    """``model.loss_clip_val`` (0.2), ``model.offload_adam_states``; the head scores every position."""

    def __init__(self, cfg, tokenizer, precision="32", trainable: bool = True):
        super().__init__(cfg, tokenizer, precision, trainable)
        self.loss_clip_val = float(cfg.get("loss_clip_val", 0.2))
        self.offload_adam_states = bool(cfg.get("offload_adam_states", True))
        self.rm_state: Optional[Dict[str, torch.Tensor]] = None

    def head_kwargs(self) -> dict:
        kwargs = super().head_kwargs()
        kwargs["output_sequence"] = True
        kwargs["merge_attributes"] = self.num_attributes > 1  # a critic needs one value per position
        return kwargs

    @property
    def output_width(self) -> int:
        return 1

    # ----------------------------------------------------------------- reward model on the CPU
    def snapshot_reward_model(self) -> None:
        """Keep the current weights (the reward model the critic starts from) on the CPU for scoring."""
        self.rm_state = self.cpu_weights_copy()

    def _head(self):
        return getattr(self.module, "rm_head", None)

    @torch.no_grad()
    def infer_rewards(self, tokens: torch.Tensor, lengths: torch.Tensor, micro_batch_size: Optional[int] = None):
        """Sequence rewards [B] from the co-located reward model (weights swapped in, head reading the last token)."""
        if self.rm_state is None:
            raise RuntimeError("snapshot_reward_model() was not called (combine_rm_and_critic_server=False?)")
        head = self._head()
        with swapped_weights(self.module, self.rm_state):
            if head is not None:
                head.output_sequence = False
            try:
                return super().infer(tokens, lengths, micro_batch_size)
            finally:
                if head is not None:
                    head.output_sequence = True

    @torch.no_grad()
    def infer_values(self, tokens: torch.Tensor, lengths: torch.Tensor, micro_batch_size: Optional[int] = None):
        """Values [B, S], one per token position (the value of the state after that token)."""
        from megatron.core import parallel_state

        from nemo_aligner.utils.distributed import broadcast_from_last_stage

        mbs = micro_batch_size or tokens.shape[0]
        seq = tokens.shape[1]
        batch = {"tokens": tokens.long(), "lengths": lengths.long(),
                 "position_ids": torch.arange(seq).unsqueeze(0).expand(tokens.shape[0], seq).contiguous()}
        outputs = self.forward_backward(batch, None, True, mbs, forward_fn=self._single_forward)
        values = torch.zeros(tokens.shape[0], seq, dtype=torch.float32)
        if parallel_state.is_pipeline_last_stage():
            values = torch.cat([o.float().reshape(o.shape[0], seq) for o in outputs], dim=0).cpu()  # on the host
        return broadcast_from_last_stage(values)

    def infer_rm_critic(self, tokens: torch.Tensor, lengths: torch.Tensor, micro_batch_size: Optional[int] = None):
        """``(rewards [B] or None, values [B, S])``; rewards only with the co-located reward model."""
        values = self.infer_values(tokens, lengths, micro_batch_size)
        rewards = self.infer_rewards(tokens, lengths, micro_batch_size) if self.rm_state is not None else None
        return rewards, values

    def infer(self, tokens: torch.Tensor, lengths: torch.Tensor, micro_batch_size: Optional[int] = None):
        return self.infer_values(tokens, lengths, micro_batch_size)

    # ----------------------------------------------------------------- training
    def prepare_for_training(self) -> None:
        if self.offload_adam_states and self.device.type == "cuda" and self.optimizer is not None:
            self.optimizer_offload.restore()

    def finish_training(self) -> None:
        if self.offload_adam_states and self.device.type == "cuda" and self.optimizer is not None:
            self.optimizer_offload.offload()

    def _critic_loss(self, mb, output):
        values = output.float().reshape(output.shape[0], -1)[:, :-1]
        loss = ppo_utils.critic_loss(values, mb["prev_values"], mb["returns"], mb["mask"], self.loss_clip_val)
        return loss, {"loss": loss.detach().clone(), "tokens": mb["mask"].sum().detach()}

    def get_loss_and_metrics(self, batch: Dict[str, torch.Tensor], forward_only: bool) -> Tuple[float, Dict[str, float]]:
        """``tokens`` [B, S], ``returns``/``prev_values``/``mask`` [B, S-1]."""
        seq = batch["tokens"].shape[1]
        data = {k: batch[k] for k in ("tokens", "returns", "prev_values", "mask")}
        data["lengths"] = torch.full((batch["tokens"].shape[0],), seq, dtype=torch.long)
        data["position_ids"] = torch.arange(seq).unsqueeze(0).expand(batch["tokens"].shape[0], seq).contiguous()
        outputs = self.forward_backward(data, self._critic_loss, forward_only, self.micro_batch_size,
                                        forward_fn=self._single_forward)
        m = self.reduce_metrics(outputs, sum_keys=("tokens",), mean_keys=("loss",))
        return m["loss"], m
