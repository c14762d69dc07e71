"""``scaled_dot_product_attention`` with the CPU's faster precision for short bf16/fp16 sequences.

torch's CPU flash attention in bf16 processes keys in fixed blocks, so its forward + backward costs
about the same from 64 to 256 keys: up to 2.6x the float32 kernel's time at 64-160 keys (16 x 4
heads x 78 positions: 11.2 ms against 4.8 ms with the casts, on an AMX Xeon; the float32 result is
also the more accurate one). Training in bf16 on the CPU therefore runs attention over short key
lengths in float32 and casts the output back; elsewhere this is ``F.scaled_dot_product_attention``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from nemo_aligner.utils.cpu_info import has_fast_bf16_matmul

# Key lengths up to which float32 attention is the faster for bf16 on a CPU with bf16 matmul units
# (measured crossover between 160 and 192 keys). Elsewhere (fp16, or bf16 without those units)
# float32 is used at every length: most CPUs emulate those half-precision matmuls.
FLOAT32_MAX_KEYS = 160


def _float32_is_faster(query: torch.Tensor, key: torch.Tensor) -> bool:
    if query.device.type != "cpu" or query.dtype not in (torch.bfloat16, torch.float16):
        return False
    if not (torch.is_grad_enabled() and query.requires_grad):
        return False
    native = query.dtype == torch.bfloat16 and has_fast_bf16_matmul()
    return key.shape[-2] <= FLOAT32_MAX_KEYS or not native


def scaled_dot_product_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, **kwargs) -> torch.Tensor:
    """``F.scaled_dot_product_attention(query, key, value, **kwargs)``; CPU training in bf16/fp16
    computes it in float32 where that is the faster kernel (see the module docstring)."""
    if _float32_is_faster(query, key):
        return F.scaled_dot_product_attention(query.float(), key.float(), value.float(), **kwargs).to(query.dtype)
    return F.scaled_dot_product_attention(query, key, value, **kwargs)
