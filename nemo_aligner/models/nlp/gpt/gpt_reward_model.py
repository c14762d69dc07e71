"""megatron-core GPT with a scalar (or per-attribute) head instead of the vocabulary projection.

The checkpoint keys match NeMo-Aligner's reward models (``model.rm_head.weight``,
``model.rm_head.bias``); the unused vocabulary projection is not kept.
"""

from __future__ import annotations

from copy import deepcopy
from typing import List, Optional
from unittest.mock import patch

import torch
from megatron.core.models.gpt import GPTModel
from megatron.core.tensor_parallel.layers import RowParallelLinear


class RewardModelHead(RowParallelLinear):
    """Hidden states -> ``num_attributes`` values, in ``dtype`` (float32 by default).

    Reads the hidden state of the last real token of each sequence (``lengths - 1``),
    or their mean over the real tokens with ``use_avg_pool``; with ``output_sequence``
    it scores every position (PPO critic values). With ``merge_attributes`` the
    attributes are combined with ``attribute_weights`` into one scalar.
    """

    def __init__(self, hidden_size: int, num_attributes: int, *, config, init_method, dtype=torch.float32,
                 output_sequence: bool = False, use_avg_pool: bool = False, merge_attributes: bool = False,
                 attribute_weights: Optional[List[float]] = None):
        config = deepcopy(config)
        config.params_dtype = dtype
        config.sequence_parallel = False
        super().__init__(hidden_size, num_attributes, config=config, init_method=init_method, bias=True,
                         input_is_parallel=False, skip_bias_add=False)
        self.head_dtype = dtype
        self.output_sequence = output_sequence
        self.use_avg_pool = use_avg_pool
        self.merge_attributes = merge_attributes
        weights = attribute_weights if attribute_weights is not None else [1.0 / num_attributes] * num_attributes
        if len(weights) != num_attributes:
            raise ValueError(f"{len(weights)} attribute weights for {num_attributes} attributes")
        self.register_buffer("attribute_weights", torch.tensor(weights, dtype=torch.float32), persistent=False)

    @torch.no_grad()
    def reset_parameters(self, seed: int, std: float) -> None:
        """Initialise from a generator of its own, so a new head is the same at any TP/PP layout
        (the shared RNG has been consumed differently by the layers built before it)."""
        from megatron.core import parallel_state

        generator = torch.Generator().manual_seed(seed)
        full = torch.randn(self.output_size, self.input_size, generator=generator, dtype=torch.float32) * std
        tp, rank = parallel_state.get_tensor_model_parallel_world_size(), parallel_state.get_tensor_model_parallel_rank()
        width = self.input_size // tp
        self.weight.copy_(full[:, rank * width : (rank + 1) * width].to(self.weight.dtype))
        if self.bias is not None:
            self.bias.zero_()

    def _linear(self, hidden: torch.Tensor) -> torch.Tensor:
        # Never under a lower-precision autocast: the head is where rewards get their resolution.
        with torch.autocast(device_type=hidden.device.type, enabled=False):
            return super().forward(hidden.to(self.weight.dtype))[0]

    def forward(self, hidden_states: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        """``hidden_states`` [S, B, H], ``lengths`` [B] -> [B, A] (or [B, S, A] with ``output_sequence``)."""
        if self.output_sequence:
            values = self._linear(hidden_states).permute(1, 0, 2).contiguous()
        else:
            if self.use_avg_pool:
                positions = torch.arange(hidden_states.size(0), device=hidden_states.device).unsqueeze(-1)
                mask = (positions < lengths.unsqueeze(0)).unsqueeze(-1).to(hidden_states.dtype)
                pooled = (hidden_states * mask).sum(0) / lengths.clamp(min=1).unsqueeze(-1).to(hidden_states.dtype)
            else:
                batch = torch.arange(hidden_states.size(1), device=hidden_states.device)
                pooled = hidden_states[(lengths - 1).clamp(min=0), batch]
            values = self._linear(pooled.unsqueeze(0)).squeeze(0)
        if self.merge_attributes:
            return (values.float() @ self.attribute_weights.to(values.device)).unsqueeze(-1)
        return values


class GPTRewardModel(GPTModel):
    """``GPTModel`` whose last stage ends in a ``RewardModelHead``; other stages return hidden states."""

    def __init__(self, *args, num_attributes: int = 1, head_dtype=torch.float32, output_sequence: bool = False,
                 use_avg_pool: bool = False, merge_attributes: bool = False, attribute_weights=None,
                 head_seed: int = 1234, **kwargs):
        # The vocabulary projection is never used, so it is not tied to (or synced with) the embedding.
        kwargs["share_embeddings_and_output_weights"] = False
        super().__init__(*args, **kwargs)
        if self.post_process:
            self.output_layer = None
            self.rm_head = RewardModelHead(
                self.config.hidden_size, num_attributes, config=self.config, init_method=self.config.init_method,
                dtype=head_dtype, output_sequence=output_sequence, use_avg_pool=use_avg_pool,
                merge_attributes=merge_attributes, attribute_weights=attribute_weights,
            )
            self.rm_head.reset_parameters(head_seed, self.config.init_method_std)

    def forward(self, input_ids, lengths, position_ids, attention_mask=None, decoder_input=None, **kwargs):
        # GPTModel returns the (final-layernormed) hidden states when it believes it is not the last stage.
        with patch.object(self, "post_process", False):
            hidden = super().forward(input_ids=input_ids, position_ids=position_ids, attention_mask=attention_mask,
                                     decoder_input=decoder_input)
        if self.post_process:
            return self.rm_head(hidden, lengths)
        return hidden

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata=None):
        # With post_process hidden, GPTModel does not look for the removed output layer.
        with patch.object(self, "post_process", False):
            return super().sharded_state_dict(prefix, sharded_offsets, metadata)
