"""megatron-core's unfused RoPE (``rope_utils._apply_rotary_pos_emb_bshd``) routed through a
leaner implementation (``models/nlp/gpt/lean_ops.apply_rotary``) in its common case."""

from __future__ import annotations

from typing import Callable, Optional

import torch

_original: Optional[Callable] = None
_lean: Optional[Callable] = None


def _apply_rotary_pos_emb_bshd(t, freqs, rotary_interleaved: bool = False, mscale: float = 1.0, **flags):
    # ``flags``: the interleaving variants (multi_latent_attention up to megatron-core 0.16,
    # mla_rotary_interleaved from 0.17), which megatron-core's own code handles.
    if rotary_interleaved or any(flags.values()) or freqs.shape[-1] % 2:
        return _original(t, freqs, rotary_interleaved=rotary_interleaved, mscale=mscale, **flags)
    return _lean(t, freqs, mscale)


def install(apply_rotary: Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor]) -> None:
    """Route megatron-core's unfused RoPE through ``apply_rotary(t, freqs, mscale)`` (idempotent)."""
    global _original, _lean
    from megatron.core.models.common.embeddings import rope_utils

    _lean = apply_rotary
    if _original is None:
        _original = rope_utils._apply_rotary_pos_emb_bshd
        rope_utils._apply_rotary_pos_emb_bshd = _apply_rotary_pos_emb_bshd


def original() -> Optional[Callable]:
    """megatron-core's own implementation, once :func:`install` has replaced it."""
    return _original
