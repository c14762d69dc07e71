"""megatron-core's MoE router without Transformer Engine.

megatron-core 0.16's router gating (``moe_utils.RouterGatingLinearFunction``) tests
``te_general_gemm is not None``, a name bound only when Transformer Engine imports: without TE
every routed layer fails with a NameError. Bound to None here, the router takes its torch matmul.
"""

from __future__ import annotations


def install() -> None:
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None
