"""A megatron-core GPT's forward over rollouts packed by prompt (``nemo_aligner.utils.prompt_sharing``).

Two things make the packed row compute what the unpacked rows would: the attention layout
(``SDPADotProductAttention`` reads it from the mask) and each token's own position, which RoPE
takes from the sequence index unless told otherwise: :func:`per_row_rotary` hands the layers
rotary angles gathered at the packed positions for the duration of the forward.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Dict, Optional

import torch


def prompt_sharing_unsupported(module, config) -> Optional[str]:
    """Why this stage cannot run packed rollouts, or None when it can."""
    from nemo_aligner.models.nlp.gpt.sdpa_attention import SDPADotProductAttention

    if config.attention_dropout:
        return "attention dropout is on"
    if getattr(config, "context_parallel_size", 1) > 1:
        return "context parallelism splits the sequence"
    if module.position_embedding_type not in ("rope", "learned_absolute", "none"):
        return f"position embedding {module.position_embedding_type!r}"
    if module.position_embedding_type == "rope" and getattr(config, "apply_rope_fusion", False):
        return "fused RoPE takes one position per sequence index"
    for layer in module.decoder.layers:
        if not isinstance(getattr(layer.self_attention, "core_attention", None), SDPADotProductAttention):
            return "the layer spec's attention is not nemo-aligner's SDPA attention (e.g. Transformer Engine's)"
    return None


@contextmanager
def per_row_rotary(module, positions: torch.Tensor):
    """While active, ``module``'s RoPE gives each token of ``positions`` [B, S] its own angles
    ([S, B, 1, rot] instead of [S, 1, 1, rot]); a no-op without RoPE."""
    rope = getattr(module, "rotary_pos_emb", None) if module.position_embedding_type == "rope" else None
    if rope is None:
        yield
        return
    original = rope.forward

    def forward(max_seq_len, *args, **kwargs):
        freqs = original(max_seq_len, *args, **kwargs)  # [S, 1, 1, rot]: angles of positions 0..S-1
        return freqs[:, 0, 0][positions.t()].unsqueeze(2)

    rope.forward = forward
    try:
        yield
    finally:
        del rope.forward  # the class's own forward again


def packed_forward(model, micro_batch: Dict[str, torch.Tensor]):
    """One stage's forward of a packed micro-batch (``tokens``, ``position_ids``, ``attention_mask``):
    the packed logits [G, L, V/TP] on the last stage, the hidden states for the next one elsewhere."""
    from megatron.core.utils import unwrap_model

    with per_row_rotary(unwrap_model(model), micro_batch["position_ids"]):
        return model(micro_batch["tokens"], micro_batch["position_ids"], micro_batch["attention_mask"])
