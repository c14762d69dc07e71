"""A frozen reference policy for DPO-style training: the starting weights kept on the CPU and
swapped into the model to score sequences (one copy of the network on the device)."""

from __future__ import annotations

import torch

from nemo_aligner.models.nlp.gpt.megatron_gpt_ppo_actor import next_token_batch
from nemo_aligner.utils.weight_swap import cpu_state_copy, swapped_weights


class ReferencePolicyMixin:
    """For a :class:`MegatronGPTModel`: ``snapshot_reference_policy()`` then ``token_logps(...)``."""

    ref_state = None

    def snapshot_reference_policy(self) -> None:
        """Keep the current weights on the CPU as the reference policy."""
        self.ref_state = cpu_state_copy(self.module)

    @torch.no_grad()
    def token_logps(self, tokens: torch.Tensor, rows_per_micro_batch: int, reference: bool = False) -> torch.Tensor:
        """Log-prob of each next token, ``[B, L-1]`` float32 on every rank, by the current policy or
        (``reference=True``) the snapshot; dropout off either way."""
        from megatron.core import parallel_state

        from nemo_aligner.utils.distributed import broadcast_from_last_stage

        if reference and self.ref_state is None:
            raise RuntimeError("snapshot_reference_policy() was not called")
        data = next_token_batch(tokens)
        training = self.module.training
        self.eval()
        if reference:
            with swapped_weights(self.module, self.ref_state):
                outputs = self.forward_backward(data, None, True, rows_per_micro_batch)
        else:
            outputs = self.forward_backward(data, None, True, rows_per_micro_batch)
        if training:
            self.train()
        result = torch.zeros(tokens.shape, dtype=torch.float32)
        if parallel_state.is_pipeline_last_stage():
            result = -torch.cat([o.float() for o in outputs]).cpu()  # results live on the host
        return broadcast_from_last_stage(result)[:, :-1].contiguous()
