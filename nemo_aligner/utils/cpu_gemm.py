"""Packed float32 weights for the decode loop's skinny matmuls on the CPU.

A decode step multiplies a few rows (one token per sequence) by every weight matrix. Which
library's packed GEMM runs that fastest depends on the CPU (measured, see benchmarks/README.md):

- Intel Xeon (AVX-512): MKL's packed GEMM (``torch.ops.mkl._mkl_linear``) is ~1.4x faster than
  ``F.linear`` and bit-identical to it. Our own kernel built for AVX-512 (``native``: 32-column
  weight panels and a 12 x 32 register block) runs the small benchmark model's 32-row decode
  matmuls ~10% faster than MKL's packed GEMM (weights streamed from memory, as in a decode step),
  so it is the choice on Intel CPUs with AVX-512; there MKL's ``F.linear`` stays faster for
  hundreds of rows and more (prefills and training, ~300-320 against ~250-290 GFLOP/s), so those
  keep ``F.linear``.
- AMD EPYC (Zen 3, AVX2): MKL's packed GEMM is no faster than ``F.linear`` (presumably MKL's fast
  small-matrix paths are selected for Intel CPUs only); oneDNN's packed GEMM
  (``torch.ops.mkldnn._linear_pointwise``, dispatched by instruction set, not vendor) runs a decode
  step's matmuls in 0.75x the time on the tiny benchmark model and 0.59x on the small one. Its
  results differ from ``F.linear`` by float32 rounding only.

- Our own AVX2/FMA kernel (``native``: ``packed_linear`` in ``utils.cpu_kernels``, 16-column
  weight panels and a 6 x 16 register block) runs the same matmuls at 1.2-1.4x oneDNN's speed on
  that AMD EPYC (tiny model at 32 and 64 rows, small model at 32). It is the choice on non-Intel x86
  CPUs where the kernels build, for every row count (prefills too).

- bf16 models on CPUs with AVX512_BF16 but no AMX (Zen 4): our kernel built with AVX512_BF16
  (``native``: column pairs of the weight in 32-column panels, VDPBF16PS into float32 sums, the same
  12 x 32 blocking), returning its float32 sums unrounded to the fused decode step: at the GRPO
  benchmark's 64 rows, 300-410 GFLOP/s against oneDNN's 180-330 with the widening cast; the GRPO
  shape's ``generate`` 0.83x oneDNN's time (interleaved calls in one process).
- bf16 models on CPUs with AMX tiles: our AMX kernel (``amx``: ``amx_pack``/``amx_linear`` in
  ``utils.cpu_kernels``, 16 x 32 weight tiles, two column tiles against 32 rows at a time, float32
  activations rounded inside and float32 sums returned): the small benchmark model's 32-row decode
  matmuls stream weights at ~20 GB/s against ~11 GB/s for oneDNN's packed bf16 GEMM with the casts
  around it, a whole greedy ``generate`` 0.75x the time (0.65x on the tiny model), 2-core Xeon.
  More rows than the decode batch (prefills) go to ``F.linear``: torch's bf16 matmul, blocked for
  large products, runs 2048 rows ~2.5x faster than this kernel.
- bf16 models where neither of ours is built: oneDNN's packed bf16 weights (Zen 4: the small
  benchmark model's decode step 0.75x the time of ``F.linear``'s).

``NEMO_ALIGNER_DECODE_GEMM`` (``auto`` | ``native`` | ``mkl`` | ``onednn`` | ``amx`` | ``plain``) overrides the choice.

Where the choice is ``native`` on a CPU other than Intel's, the float32 CPU matmuls of training and
of log-prob passes use our kernel too (:class:`NativeLinear`, routed in by ``utils.patches.cpu_compat``): forward, input
gradient and weight gradient (added straight into megatron-core's ``main_grad``): 1.15-1.2x MKL's
``F.linear`` alone at training shapes on the AMD EPYC, ~1.1x within a training step.

Where the CPU has bf16 matmul units (and ``NEMO_ALIGNER_DECODE_GEMM`` names no backend other than
``onednn``), the bf16 CPU matmuls of training and of log-prob passes run
their forward and input gradient on oneDNN's packed bf16 weights (:class:`OneDNNLinear`): torch's
bf16 matmul re-lays the weight out on every call and runs ~270 GFLOP/s at a thousand rows on a Zen
4 against ~430 on packed weights. A schedule's micro-batches share one layout per weight
(:func:`weights_unchanged`).
"""

from __future__ import annotations

import contextlib
import functools
import os
import platform
import threading
from typing import Callable, Optional

import torch
import torch.nn.functional as F

from nemo_aligner.utils.cpu_info import cpuinfo, has_fast_bf16_matmul
from nemo_aligner.utils.errors import ConfigError

ENV_VAR = "NEMO_ALIGNER_DECODE_GEMM"
BACKENDS = ("native", "mkl", "onednn", "amx", "plain")
REUSABLE_PACKS = ("native", "amx")  # backends whose packs pack() writes into given memory (``reuse``)


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
    if backend == "amx":
        kernels = _kernels()
        return kernels is not None and kernels.has_amx()
    return backend == "plain"


def native_packs_bf16() -> bool:
    """Whether our packed GEMM multiplies bf16 (built with AVX512_BF16)."""
    kernels = _kernels()
    return kernels is not None and kernels.has_packed_linear() and kernels.has_bf16_gemm()


def native_is_avx512() -> bool:
    """Whether our packed GEMM is built for AVX-512 (32-column panels)."""
    kernels = _kernels()
    return kernels is not None and kernels.has_packed_linear() and kernels.packed_gemm_tile()[1] == 32


def large_matmuls_on_torch() -> bool:
    """Whether matmuls of many rows (prefills, training) run faster on ``F.linear`` than on our
    kernel: on Intel CPUs, where MKL's large GEMMs are faster."""
    return cpu_vendor() == "GenuineIntel"


def requested_backend() -> str:
    """``NEMO_ALIGNER_DECODE_GEMM`` (``auto`` when unset); an unknown value is an error naming it."""
    requested = os.environ.get(ENV_VAR, "auto").strip().lower() or "auto"
    if requested not in ("auto",) + BACKENDS:
        raise ConfigError(f"{ENV_VAR}={requested!r}: expected one of auto, {', '.join(BACKENDS)}")
    return requested


def decode_gemm_backend(dtype: torch.dtype = torch.float32) -> str:
    """The packed-GEMM backend for CPU decode steps of a ``dtype`` model: ``NEMO_ALIGNER_DECODE_GEMM``
    if set (an unavailable one is an error), else for float32 on Intel CPUs our own kernel where it
    is built for AVX-512 (else MKL), on other x86 CPUs our own kernel (else oneDNN); for bf16 where
    the CPU has bf16 matmul units, our AMX kernel on CPUs with AMX tiles, our AVX512_BF16 kernel on
    others, else oneDNN; plain ``F.linear`` elsewhere or where the chosen library is missing."""
    requested = requested_backend()
    if requested != "auto":
        if not available(requested):
            raise ConfigError(f"{ENV_VAR}={requested!r}: this torch build has no {requested} packed GEMM")
        return requested
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return "plain"
    if dtype == torch.bfloat16:
        if not has_fast_bf16_matmul():
            return "plain"
        if "amx_bf16" in cpuinfo("flags").split():
            if available("amx"):
                return "amx"
        elif available("native") and native_packs_bf16():
            return "native"  # AVX512_BF16 without AMX tiles
        return "onednn" if available("onednn") else "plain"
    if cpu_vendor() == "GenuineIntel":
        if available("native") and native_is_avx512():
            return "native"
        return "mkl" if available("mkl") else "plain"
    for backend in ("native", "onednn"):
        if available(backend):
            return backend
    return "plain"


def pack(weight: torch.Tensor, rows: int, backend: str, reuse: Optional[torch.Tensor] = None,
         huge_pages: bool = False) -> Optional[torch.Tensor]:
    """``weight`` [out, in] packed by ``backend`` for ``rows``-row inputs; None when it cannot be
    packed (not a CPU matrix of a dtype the backend packs: float32; bf16 for oneDNN, and for our
    GEMM where it is built with AVX512_BF16 and ``in`` is even; only bf16 for the AMX kernel; the
    plain backend; a build without the packed kernels).

    Our kernels' packs (``REUSABLE_PACKS``) are written into ``reuse`` where it is an earlier pack
    of the same shape (a kept buffer, see ``decode_buffers``), else into fresh memory, on 2 MiB pages
    where ``huge_pages``; the other backends ignore both."""
    dtypes = (torch.bfloat16,) if backend == "amx" else (torch.float32,)
    if backend == "onednn" or (backend == "native" and native_packs_bf16() and weight.shape[-1] % 2 == 0):
        dtypes = (torch.float32, torch.bfloat16)
    if backend == "plain" or weight.dim() != 2 or weight.dtype not in dtypes or weight.device.type != "cpu":
        return None
    try:
        if backend == "native":
            return _kernels().pack_linear(weight.detach().contiguous(), reuse, huge_pages)
        if backend == "amx":
            return _kernels().amx_pack(weight.detach().contiguous(), reuse, huge_pages)
        if backend == "mkl":
            return torch.ops.mkl._mkl_reorder_linear_weight(weight.detach(), rows)
        return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), rows)
    except RuntimeError:
        return None


def linear(weight: torch.Tensor, bias: Optional[torch.Tensor], packed: Optional[torch.Tensor], rows: int,
           backend: str) -> Callable[[torch.Tensor], torch.Tensor]:
    """``x -> x @ weight.T + bias`` through ``packed`` (from :func:`pack` with the same ``rows`` and
    ``backend``), or ``F.linear`` when ``packed`` is None (and, for oneDNN, for inputs of more than
    ``rows`` rows).

    Our bf16 GEMMs sum in float32 and return the sums rounded to bf16; the callable's
    ``float_output`` attribute is the same product returned in float32 (unrounded), for callers
    that widen the result anyway; it takes bf16 or float32 inputs (rounded to bf16 as a cast
    would: by the AMX kernel itself)."""
    if packed is None:
        return lambda x: F.linear(x, weight, bias)
    if backend == "mkl":
        mkl_linear = torch.ops.mkl._mkl_linear
        return lambda x: mkl_linear(x, packed, weight, bias, rows)
    skinny = rows * weight.shape[1]
    if backend == "amx" or (backend == "native" and weight.dtype == torch.bfloat16):  # our bf16 GEMMs
        kernels, out_features = _kernels(), weight.shape[0]
        float_bias = bias.float() if bias is not None else None
        if backend == "amx":  # rounds float32 inputs to bf16 itself
            float_output = lambda x: kernels.amx_linear(x.contiguous(), packed, out_features, float_bias)  # noqa: E731
        else:
            float_output = lambda x: kernels.packed_linear(x.to(weight.dtype).contiguous(), packed,  # noqa: E731
                                                           out_features, float_bias)

        def call(x):
            if backend == "amx" and x.numel() > skinny:  # a prefill's thousands of rows: torch's blocked GEMM
                return F.linear(x, weight, bias)
            return float_output(x).to(weight.dtype)

        call.float_output = float_output
        return call
    if backend == "native":
        packed_linear, out_features = _kernels().packed_linear, weight.shape[0]
        native = lambda x: packed_linear(x.contiguous(), packed, out_features, bias)  # noqa: E731
        if not large_matmuls_on_torch():
            return native  # any number of rows: a prefill's thousands run ~1.2x F.linear's speed too (AMD EPYC)
        # a prefill's thousands of rows: MKL's F.linear is faster there
        return lambda x: native(x) if x.numel() <= skinny else F.linear(x, weight, bias)
    onednn_linear = torch.ops.mkldnn._linear_pointwise
    if weight.dtype == torch.bfloat16:
        # bf16: packed weights are faster for every row count (Zen 4, a thousand rows: ~430 against
        # ~270 GFLOP/s for F.linear, which re-lays out the weight on every call)
        return lambda x: onednn_linear(x, packed, bias, "none", [], "")
    # float32: oneDNN is faster only for skinny inputs: a prefill's thousands of rows run ~10% faster
    # on MKL (measured on the small benchmark model, Zen 3).
    return lambda x: onednn_linear(x, packed, bias, "none", [], "") if x.numel() <= skinny else F.linear(x, weight, bias)


_TRAINING_CHOICE: dict = {}  # (dtype, the two settings' values) -> whether training runs on packed weights


def _training_choice(dtype: torch.dtype) -> bool:
    from nemo_aligner.utils import cpu_kernels

    key = (dtype, os.environ.get(ENV_VAR, ""), os.environ.get(cpu_kernels.ENV_VAR, ""))
    if key not in _TRAINING_CHOICE:
        if dtype == torch.float32:
            _TRAINING_CHOICE[key] = decode_gemm_backend() == "native" and not large_matmuls_on_torch()
        else:  # where bf16 decode steps run on packed weights, unless another backend is named
            _TRAINING_CHOICE[key] = (requested_backend() in ("auto", "onednn") and available("onednn")
                                     and decode_gemm_backend(torch.bfloat16) in ("native", "onednn", "amx"))
    return _TRAINING_CHOICE[key]


def training_kernels():
    """The compiled kernels where float32 CPU training matmuls run on our GEMM (the packed-GEMM
    choice is ``native`` on a CPU other than Intel's), else None. Called for every linear layer: the
    choice is kept per value of the two settings."""
    return _kernels() if _training_choice(torch.float32) else None


def bf16_training_on_onednn() -> bool:
    """Whether bf16 CPU training and log-prob matmuls run on oneDNN's packed bf16 weights
    (:class:`OneDNNLinear`): on a CPU with bf16 matmul units, unless ``NEMO_ALIGNER_DECODE_GEMM``
    names a backend other than oneDNN (our bf16 GEMM serves decode steps only: at training's
    thousand rows oneDNN's is faster)."""
    return _training_choice(torch.bfloat16)


def _weight_gradient(weight: torch.Tensor, main_grad: Optional[torch.Tensor], like: torch.Tensor,
                     compute: Callable[[], torch.Tensor], accumulate: Callable[[torch.Tensor], None]):
    """The weight gradient a linear layer's backward returns, as megatron-core's: without ``main_grad``
    the gradient itself (``compute()``); with it (gradient accumulation fusion: the DDP buffer the
    optimizer reads) ``accumulate(main_grad)`` adds it there, and the returned gradient is a dummy
    (of ``like``'s dtype) where the parameter has ``grad_added_to_main_grad``, else None."""
    if main_grad is None:
        return compute()
    accumulate(main_grad)
    weight.main_grad = main_grad
    if not hasattr(weight, "grad_added_to_main_grad"):
        return None
    # megatron-core's DDP hooks expect a gradient tensor (they skip adding it)
    make = torch.zeros if getattr(weight, "zero_out_wgrad", False) else torch.empty
    weight.grad_added_to_main_grad = True
    return make(main_grad.shape, dtype=like.dtype, device=like.device)


def _save_for_backward(ctx, input, weight, bias, main_grad) -> None:
    ctx.save_for_backward(input, weight)
    ctx.main_grad = main_grad  # not saved for backward: a buffer written in place
    ctx.has_bias = bias is not None


def _linear_backward(ctx, grad_output: torch.Tensor, input_gradient: Callable, weight_gradient: Callable):
    """The gradients a packed linear layer's backward returns (input, weight, bias; None for
    ``main_grad``): ``input_gradient(grad_output, weight)``, and ``weight_gradient(grad [rows, n],
    input [rows, k])`` giving the ``(compute, accumulate)`` pair of :func:`_weight_gradient`."""
    input, weight = ctx.saved_tensors
    n, k = weight.shape
    grad_output = grad_output.contiguous()
    grad = grad_output.view(-1, n)
    grad_input = grad_weight = grad_bias = None
    if ctx.needs_input_grad[0]:
        grad_input = input_gradient(grad_output, weight)
    if ctx.needs_input_grad[1]:
        compute, accumulate = weight_gradient(grad, input.reshape(-1, k))
        grad_weight = _weight_gradient(weight, ctx.main_grad, input, compute, accumulate)
    if ctx.has_bias and ctx.needs_input_grad[2]:
        grad_bias = grad.sum(0)
    return grad_input, grad_weight, grad_bias, None


class NativeLinear(torch.autograd.Function):
    """``input @ weight^T (+ bias)`` for float32 CPU tensors through our packed GEMM, forward and
    backward. With ``main_grad`` (megatron-core's gradient accumulation fusion: the DDP buffer the
    optimizer reads), the weight gradient is added into it in the GEMM itself, and the gradient
    returned for the weight follows megatron-core's linear layer (a dummy where the parameter has
    ``grad_added_to_main_grad``, else None)."""

    @staticmethod
    def forward(ctx, input, weight, bias, main_grad):
        ext = _kernels()
        n = weight.shape[0]
        # [..., n] straight from the kernel: a view of it as the output would be refused by autograd
        # wherever the layer's output is later modified in place
        out = ext.packed_gemm(input.contiguous(), False, ext.pack_linear(weight.contiguous()), n,
                              bias.contiguous() if bias is not None else None, None)
        _save_for_backward(ctx, input, weight, bias, main_grad)
        return out

    @staticmethod
    def backward(ctx, grad_output):
        ext = _kernels()

        def input_gradient(grad_output, weight):
            return ext.packed_gemm(grad_output, False, ext.pack_matrix(weight.contiguous()), weight.shape[1], None, None)

        def weight_gradient(grad, total):
            # weight gradient [n, k] = grad^T @ input: grad is read transposed in place
            k = total.shape[1]
            packed_input = ext.pack_matrix(total.contiguous())

            def accumulate(main_grad):
                if main_grad.dtype == torch.float32 and main_grad.is_contiguous():
                    ext.packed_gemm(grad, True, packed_input, k, None, main_grad)
                else:
                    main_grad.add_(ext.packed_gemm(grad, True, packed_input, k, None, None).to(main_grad.dtype))

            return (lambda: ext.packed_gemm(grad, True, packed_input, k, None, None)), accumulate

        return _linear_backward(ctx, grad_output, input_gradient, weight_gradient)


_KEPT = threading.local()  # .packs: {(id(weight), transposed): (weight, version, packed)} inside weights_unchanged()


@contextlib.contextmanager
def weights_unchanged():
    """Within it, :class:`OneDNNLinear` lays out each weight (and its transpose) once and reuses it:
    for a schedule's micro-batches, during which the caller guarantees that no weight changes.
    Outside it every call lays out the weight afresh (an optimizer may change weights in place
    through ``.data``, which no version counter sees). Nests; the layouts (up to two bf16 copies of
    each weight: as it is and transposed) are dropped on exit."""
    outer = getattr(_KEPT, "packs", None)
    if outer is None:
        _KEPT.packs = {}
    try:
        yield
    finally:
        if outer is None:
            _KEPT.packs = None


def _onednn_pack(weight: torch.Tensor, rows: int, transposed: bool) -> torch.Tensor:
    """``weight`` (or its transpose) laid out for oneDNN's bf16 linear; kept inside
    :func:`weights_unchanged`."""
    packs = getattr(_KEPT, "packs", None)
    key = (id(weight), transposed)
    # the version too: a swap of weights through the state dict inside the block is seen
    if packs is not None and key in packs and packs[key][0] is weight and packs[key][1] == weight._version:
        return packs[key][2]
    matrix = weight.detach().t().contiguous() if transposed else weight.detach()
    packed = torch.ops.mkldnn._reorder_linear_weight(matrix, rows)
    if packs is not None:
        packs[key] = (weight, weight._version, packed)  # the weight itself kept: its id is not reused meanwhile
    return packed


class OneDNNLinear(torch.autograd.Function):
    """``input @ weight^T (+ bias)`` for bf16 CPU tensors with the forward and the input gradient on
    oneDNN's packed bf16 weights (torch's bf16 matmul re-lays the weight out on every call, in a
    slower GEMM: Zen 4, a thousand rows, ~270 against ~430 GFLOP/s); the weight gradient is torch's
    bf16 matmul (float32 sums), added into megatron-core's ``main_grad`` where given."""

    @staticmethod
    def forward(ctx, input, weight, bias, main_grad):
        packed = _onednn_pack(weight, input.numel() // input.shape[-1], transposed=False)
        out = torch.ops.mkldnn._linear_pointwise(input.contiguous(), packed, bias, "none", [], "")
        _save_for_backward(ctx, input, weight, bias, main_grad)
        return out

    @staticmethod
    def backward(ctx, grad_output):
        def input_gradient(grad_output, weight):
            # [.., n] @ weight [n, k]: weight^T [k, n] is the "weight" of this product
            packed = _onednn_pack(weight, grad_output.numel() // weight.shape[0], transposed=True)
            return torch.ops.mkldnn._linear_pointwise(grad_output, packed, None, "none", [], "")

        def weight_gradient(grad, total):
            # float32 main_grad: the bf16 GEMM (float32 sums, one rounding of this micro-batch's
            # gradient) added in, as megatron-core does without its fused CUDA kernel
            return (lambda: grad.t().mm(total)), (lambda main_grad: main_grad.add_(grad.t().mm(total)))

        return _linear_backward(ctx, grad_output, input_gradient, weight_gradient)


# Keyword arguments of megatron-core's linear functions (0.16-0.19) that NativeLinear handles; any
# other keyword (a newer megatron-core's) sends the call back to megatron-core.
_LINEAR_KEYS = {"bias", "gradient_accumulation_fusion", "allreduce_dgrad", "sequence_parallel", "grad_output_buffer",
                "wgrad_deferral_limit", "async_grad_allreduce", "tp_group", "gtp_remat_size"}


def native_linear_or(original: Callable) -> Callable:
    """megatron-core's ``linear_with_grad_accumulation_and_async_allreduce`` or
    ``linear_with_frozen_weight`` (``original``), with this rank's local matmul on packed weights
    where they apply: float32 CPU tensors on our GEMM (:func:`training_kernels`), bf16 ones on
    oneDNN's (:func:`bf16_training_on_onednn`); no autocast, no communication inside the linear (no
    sequence parallelism or input-gradient all-reduce: a layer's tensor-parallel reduction happens
    outside it), no deferred weight gradients; everything else goes to ``original``."""

    def packed(input, weight, bias):
        """The autograd function for this call, or None where megatron-core's function runs it."""
        dtype = input.dtype
        if (weight.dtype != dtype or input.device.type != "cpu" or weight.dim() != 2
                or input.shape[-1] != weight.shape[1] or hasattr(weight, "__fsdp_param__")
                or torch.is_autocast_enabled("cpu")
                or (bias is not None and (bias.dtype != dtype or bias.device.type != "cpu"))):
            return None
        if dtype == torch.float32 and training_kernels() is not None:
            return NativeLinear
        if dtype == torch.bfloat16 and bf16_training_on_onednn():
            return OneDNNLinear
        return None

    def linear(input, weight, *args, **kwargs):
        if (args or not kwargs.keys() <= _LINEAR_KEYS or kwargs.get("allreduce_dgrad")
                or kwargs.get("sequence_parallel") or kwargs.get("grad_output_buffer") is not None
                or kwargs.get("async_grad_allreduce") or (kwargs.get("gtp_remat_size") or 1) != 1):
            return original(input, weight, *args, **kwargs)
        bias = kwargs.get("bias")
        function = packed(input, weight, bias)
        if function is None:
            return original(input, weight, *args, **kwargs)
        main_grad = None
        if kwargs.get("gradient_accumulation_fusion") and weight.requires_grad:
            main_grad = getattr(weight, "main_grad", None)
        return function.apply(input, weight, bias, main_grad)

    # Its name, docstring and attributes (megatron-core's function reads its own `.warned` through
    # the module-level name, which is now this one).
    functools.update_wrapper(linear, original)
    linear.nemo_aligner_native = True
    return linear
