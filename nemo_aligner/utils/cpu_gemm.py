"""Packed float32 weights for the decode loop's skinny matmuls on the CPU.

A decode step multiplies a few rows (one token per sequence) by every weight matrix. Which
library's packed GEMM runs that fastest depends on the CPU (measured, see benchmarks/README.md):

- Intel Xeon (AVX-512): MKL's packed GEMM (``torch.ops.mkl._mkl_linear``) is ~1.4x faster than
  ``F.linear`` and bit-identical to it.
- AMD EPYC (Zen 3, AVX2): MKL's packed GEMM is no faster than ``F.linear`` (presumably MKL's fast
  small-matrix paths are selected for Intel CPUs only); oneDNN's packed GEMM
  (``torch.ops.mkldnn._linear_pointwise``, dispatched by instruction set, not vendor) runs a decode
  step's matmuls in 0.75x the time on the tiny benchmark model and 0.59x on the small one. Its
  results differ from ``F.linear`` by float32 rounding only.

- Our own AVX2/FMA kernel (``native``: ``packed_linear`` in ``utils.cpu_kernels``, 16-column
  weight panels and a 6 x 16 register block) runs the same matmuls at 1.2-1.4x oneDNN's speed on
  that AMD EPYC (tiny model at 32 and 64 rows, small model at 32). It is the choice on non-Intel x86
  CPUs where the kernels build; on Intel CPUs MKL stays the choice (AVX-512 there, not measured
  against ours).

``NEMO_ALIGNER_DECODE_GEMM`` (``auto`` | ``native`` | ``mkl`` | ``onednn`` | ``plain``) overrides the choice.
"""

from __future__ import annotations

import os
import platform
from typing import Callable, Optional

import torch
import torch.nn.functional as F

from nemo_aligner.utils.cpu_info import cpuinfo
from nemo_aligner.utils.errors import ConfigError

ENV_VAR = "NEMO_ALIGNER_DECODE_GEMM"
BACKENDS = ("native", "mkl", "onednn", "plain")


def cpu_vendor() -> str:
    """The CPU's vendor string (``GenuineIntel``, ``AuthenticAMD``, ...), or "" where unknown."""
    return cpuinfo("vendor_id")


def _kernels():
    from nemo_aligner.utils import cpu_kernels  # imported here: building the kernels is costly

    return cpu_kernels.load()


def available(backend: str) -> bool:
    """Whether this torch build has ``backend``'s packed-GEMM ops."""
    if backend == "mkl":
        mkl = getattr(torch.ops, "mkl", None)
        return torch.backends.mkl.is_available() and mkl is not None and hasattr(mkl, "_mkl_linear")
    if backend == "onednn":
        return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")
    if backend == "native":
        kernels = _kernels()
        return kernels is not None and kernels.has_packed_linear()
    return backend == "plain"


def decode_gemm_backend() -> str:
    """The packed-GEMM backend for CPU decode steps: ``NEMO_ALIGNER_DECODE_GEMM`` if set (an
    unavailable one is an error), else MKL on Intel CPUs, our own kernel (else oneDNN) on other
    x86 CPUs, plain ``F.linear`` elsewhere or where the chosen library is missing."""
    requested = os.environ.get(ENV_VAR, "auto").strip().lower() or "auto"
    if requested not in ("auto",) + BACKENDS:
        raise ConfigError(f"{ENV_VAR}={requested!r}: expected one of auto, {', '.join(BACKENDS)}")
    if requested != "auto":
        if not available(requested):
            raise ConfigError(f"{ENV_VAR}={requested!r}: this torch build has no {requested} packed GEMM")
        return requested
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return "plain"
    if cpu_vendor() == "GenuineIntel":
        return "mkl" if available("mkl") else "plain"
    for backend in ("native", "onednn"):
        if available(backend):
            return backend
    return "plain"


def pack(weight: torch.Tensor, rows: int, backend: str) -> Optional[torch.Tensor]:
    """``weight`` [out, in] packed by ``backend`` for ``rows``-row inputs; None when it cannot be
    packed (not a float32 CPU matrix, the plain backend, or a build without the packed kernels)."""
    if backend == "plain" or weight.dim() != 2 or weight.dtype != torch.float32 or weight.device.type != "cpu":
        return None
    try:
        if backend == "native":
            return _kernels().pack_linear(weight.detach().contiguous())
        if backend == "mkl":
            return torch.ops.mkl._mkl_reorder_linear_weight(weight.detach(), rows)
        return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), rows)
    except RuntimeError:
        return None


def linear(weight: torch.Tensor, bias: Optional[torch.Tensor], packed: Optional[torch.Tensor], rows: int,
           backend: str) -> Callable[[torch.Tensor], torch.Tensor]:
    """``x -> x @ weight.T + bias`` through ``packed`` (from :func:`pack` with the same ``rows`` and
    ``backend``), or ``F.linear`` when ``packed`` is None (and, for oneDNN, for inputs of more than
    ``rows`` rows)."""
    if packed is None:
        return lambda x: F.linear(x, weight, bias)
    if backend == "mkl":
        mkl_linear = torch.ops.mkl._mkl_linear
        return lambda x: mkl_linear(x, packed, weight, bias, rows)
    if backend == "native":  # any number of rows: a prefill's thousands run ~1.2x F.linear's speed too
        packed_linear, out_features = _kernels().packed_linear, weight.shape[0]
        return lambda x: packed_linear(x.contiguous(), packed, out_features, bias)
    skinny = rows * weight.shape[1]
    onednn_linear = torch.ops.mkldnn._linear_pointwise
    # oneDNN is faster only for skinny inputs: a prefill's thousands of rows run ~10% faster on MKL
    # (measured on the small benchmark model, Zen 3).
    return lambda x: onednn_linear(x, packed, bias, "none", [], "") if x.numel() <= skinny else F.linear(x, weight, bias)
