"""megatron-core's MoE layer with experts split over ranks, fed different numbers of tokens.

With expert parallelism, megatron-core's all-gather token dispatcher gathers every rank's tokens
with ``all_gather_into_tensor``, which needs the same number of tokens on each rank of the expert
group. Megatron's pre-training batches have that; preference pairs, reward-model pairs and chat
samples padded to their own micro-batch's longest row do not (gloo aborts, NCCL reads garbage).
Here each MoE layer pads its tokens to the group's largest count with zero rows, marked as
padding for the router (``padding_mask``: they count in no load-balancing statistic), and drops
their outputs. Ranks that already hold the largest count run the layer unchanged.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def install() -> None:
    from megatron.core.transformer.moe.moe_layer import MoELayer

    original = MoELayer.forward
    if getattr(original, "_pads_to_equal_tokens", False):
        return

    def forward(self, hidden_states, intermediate_tensors=None, padding_mask=None):
        from megatron.core import parallel_state

        group = getattr(self.token_dispatcher, "tp_ep_group", None)
        if (intermediate_tensors is not None or group is None
                or parallel_state.get_expert_model_parallel_world_size() == 1):
            return original(self, hidden_states, intermediate_tensors, padding_mask)
        s, b, h = hidden_states.shape
        tokens = s * b
        most = torch.tensor([tokens], dtype=torch.long, device=hidden_states.device)
        dist.all_reduce(most, op=dist.ReduceOp.MAX, group=group)
        most = int(most.item())
        if most == tokens:
            return original(self, hidden_states, intermediate_tensors, padding_mask)
        # one sequence of `most` tokens: [S, B] flattened as the layer flattens them, then the padding.
        # megatron-core's router reads True in padding_mask as padding (its code inverts the mask to
        # find the valid tokens, whatever its docstrings say); the layer takes it as [batch, sequence].
        padding = torch.ones(1, most, dtype=torch.bool, device=hidden_states.device)
        padding[0, :tokens] = False if padding_mask is None else padding_mask.transpose(0, 1).reshape(-1).bool()
        padded = torch.cat([hidden_states.reshape(tokens, 1, h), hidden_states.new_zeros(most - tokens, 1, h)])
        out, bias = original(self, padded, None, padding)
        return out[:tokens].reshape(s, b, h), bias

    forward._pads_to_equal_tokens = True
    MoELayer.forward = forward
