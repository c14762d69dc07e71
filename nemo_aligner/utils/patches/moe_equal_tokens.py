"""megatron-core's MoE layer with experts split over ranks, fed different numbers of tokens.

With expert parallelism, megatron-core's all-gather token dispatcher gathers every rank's tokens
with ``all_gather_into_tensor``, which needs the same number of tokens on each rank of the expert
group. Megatron's pre-training batches have that; preference pairs, reward-model pairs and chat
samples padded to their own micro-batch's longest row do not (gloo aborts, NCCL reads garbage).
Here each MoE layer pads its tokens to the group's largest count with zero rows, marked as
padding for the router where the layer takes a ``padding_mask`` (megatron-core 0.16 on: they then
count in no load-balancing statistic), and drops their outputs. Ranks that already hold the
largest count run the layer unchanged.
"""

from __future__ import annotations

import inspect

import torch
import torch.distributed as dist


def install() -> None:
    from megatron.core.transformer.moe.moe_layer import MoELayer

    original = MoELayer.forward
    if getattr(original, "_pads_to_equal_tokens", False):
        return
    takes_mask = "padding_mask" in inspect.signature(original).parameters

    def forward(self, hidden_states, *args, **kwargs):
        from megatron.core import parallel_state

        group = getattr(self.token_dispatcher, "tp_ep_group", None)
        if (group is None or parallel_state.get_expert_model_parallel_world_size() == 1
                or any(a is not None for a in args) or kwargs.get("intermediate_tensors") is not None):
            return original(self, hidden_states, *args, **kwargs)
        s, b, h = hidden_states.shape
        tokens = s * b
        most = torch.tensor([tokens], dtype=torch.long, device=hidden_states.device)
        dist.all_reduce(most, op=dist.ReduceOp.MAX, group=group)
        most = int(most.item())
        if most == tokens:
            return original(self, hidden_states, *args, **kwargs)
        padded = torch.cat([hidden_states.reshape(tokens, 1, h), hidden_states.new_zeros(most - tokens, 1, h)])
        if takes_mask:
            # one sequence of `most` tokens: [S, B] flattened as the layer flattens them, then the
            # padding. megatron-core's router reads True in padding_mask as padding (its code inverts
            # the mask to find the valid tokens, whatever its docstrings say); the layer takes it as
            # [batch, sequence].
            given = kwargs.pop("padding_mask", None)
            padding = torch.ones(1, most, dtype=torch.bool, device=hidden_states.device)
            padding[0, :tokens] = False if given is None else given.transpose(0, 1).reshape(-1).bool()
            kwargs["padding_mask"] = padding
        out, bias = original(self, padded, **kwargs)
        return out[:tokens].reshape(s, b, h), bias

    forward._pads_to_equal_tokens = True
    MoELayer.forward = forward
