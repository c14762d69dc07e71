"""Core attention for megatron-core's local layer spec through ``scaled_dot_product_attention``.

The local spec's ``DotProductAttention`` materialises the full score matrix (baddbmm, softmax,
bmm); on the CPU torch's SDPA kernels (flash attention for CPU) are faster and use less memory.
Used when attention dropout is off (or in eval), with no attention sink; otherwise the original.
It also computes the shared-prompt layout of ``nemo_aligner.utils.prompt_sharing`` and NeMo's
sliding window (``model.window_size``), which megatron-core's local attention computes only on a GPU
and without padding masks.
"""

from __future__ import annotations

import torch
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnMaskType

from nemo_aligner.utils.prompt_sharing import is_shared_prompt_mask, shared_prompt_attention
from nemo_aligner.utils.sdpa import scaled_dot_product_attention


class SDPADotProductAttention(DotProductAttention):
    """``DotProductAttention`` with the same inputs and outputs, computed by SDPA. ``window``: each
    query also sees only the ``window`` positions before its own (None: all of them)."""

    def __init__(self, *args, window=None, **kwargs):
        super().__init__(*args, **kwargs)
        self.window = window
        # apply_query_key_layer_scaling divides the scale by the layer number for the fused softmax to
        # multiply back; SDPA's softmax does not, so it takes the whole scale
        self.attention_scale = self.softmax_scale * (self.layer_number if self.config.apply_query_key_layer_scaling else 1)

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        dropout = self.config.attention_dropout if self.training else 0.0
        mask_type = attn_mask_type if attn_mask_type is not None else self.attn_mask_type
        unsupported = (dropout or getattr(self, "softmax_offset", None) is not None or attention_bias is not None
                       or packed_seq_params is not None)
        shared = is_shared_prompt_mask(attention_mask, query.shape[0])
        # a packed response sees its prompt's and its own slots: the mask's key length is its span
        span = attention_mask.shape[-1] if shared else key.shape[0]
        windowed = self.window is not None and span > self.window + 1  # else the window hides nothing
        if windowed and (shared or unsupported):
            raise ValueError(f"sliding-window attention (model.window_size) over {span} positions needs "
                             "attention without dropout, attention sinks, bias, packed sequences or shared prompts")
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
            return shared_prompt_attention(query, key, value, attention_mask, self.attention_scale)
        # [s, b, n, d] -> [b, n, s, d]
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
        if windowed:
            # query i (aligned to the last keys) sees keys i - window .. i
            sq, sk = q.shape[2], k.shape[2]
            allowed = torch.ones(sq, sk, dtype=torch.bool, device=q.device)
            allowed = allowed.tril(diagonal=sk - sq).triu(diagonal=sk - sq - self.window)
            if attention_mask is not None:
                allowed = allowed & ~attention_mask.bool()
            out = scaled_dot_product_attention(q, k, v, attn_mask=allowed, scale=self.attention_scale)
        elif attention_mask is None:
            out = scaled_dot_product_attention(q, k, v, is_causal=mask_type == AttnMaskType.causal,
                                               scale=self.attention_scale)
        else:  # megatron masks mark the positions to hide
            out = scaled_dot_product_attention(q, k, v, attn_mask=~attention_mask.bool(), scale=self.attention_scale)
        sq, b = query.shape[0], query.shape[1]
        return out.permute(2, 0, 1, 3).reshape(sq, b, -1)
