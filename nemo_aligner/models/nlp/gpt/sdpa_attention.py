"""Core attention for megatron-core's local layer spec through ``scaled_dot_product_attention``.

The local spec's ``DotProductAttention`` materialises the full score matrix (baddbmm, softmax,
bmm); on the CPU torch's SDPA kernels (flash attention for CPU) are faster and use less memory.
Used when attention dropout is off (or in eval), with no attention sink; otherwise the original.
It also computes the shared-prompt layout of ``nemo_aligner.utils.prompt_sharing``.
"""

from __future__ import annotations

import torch.nn.functional as F
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnMaskType

from nemo_aligner.utils.prompt_sharing import is_shared_prompt_mask, shared_prompt_attention


class SDPADotProductAttention(DotProductAttention):
    """``DotProductAttention`` with the same inputs and outputs, computed by SDPA."""

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        dropout = self.config.attention_dropout if self.training else 0.0
        mask_type = attn_mask_type if attn_mask_type is not None else self.attn_mask_type
        unsupported = (dropout or getattr(self, "softmax_offset", None) is not None or attention_bias is not None
                       or packed_seq_params is not None)
        shared = is_shared_prompt_mask(attention_mask, query.shape[0])
        if shared and unsupported:
            raise ValueError("shared-prompt packing needs attention without dropout, attention sinks, "
                             "bias or packed sequences")
        if unsupported:
            return super().forward(query, key, value, attention_mask, attn_mask_type, attention_bias, packed_seq_params)
        groups = self.num_attention_heads_per_partition // self.num_query_groups_per_partition
        if groups > 1:
            key = key.repeat_interleave(groups, dim=2)
            value = value.repeat_interleave(groups, dim=2)
        if shared:  # GRPO/RLOO groups packed by prompt (nemo_aligner.utils.prompt_sharing)
            return shared_prompt_attention(query, key, value, attention_mask, self.softmax_scale)
        # [s, b, n, d] -> [b, n, s, d]
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
        if attention_mask is None:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=mask_type == AttnMaskType.causal,
                                                 scale=self.softmax_scale)
        else:  # megatron masks mark the positions to hide
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=~attention_mask.bool(), scale=self.softmax_scale)
        sq, b = query.shape[0], query.shape[1]
        return out.permute(2, 0, 1, 3).reshape(sq, b, -1)
