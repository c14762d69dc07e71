"""Memory-lean RoPE, SwiGLU and RMSNorm for megatron-core's local layer spec, as autograd functions.

On a CPU the elementwise parts of a training step are memory-bound, so each saved tensor and
each copy costs about as much as the arithmetic.

RoPE: megatron-core's unfused RoPE (``rope_utils._apply_rotary_pos_emb_bshd``) recomputes cos/sin in
every layer, builds ``rotate_half`` with a negation and a concatenation, concatenates the
(usually empty) pass-through part back on, and lets autograd save the inputs of each of those
ops. On a CPU these memory-bound copies were ~15% of a training step. ``RotaryEmbedding``
computes the same values on the two halves directly and saves only cos/sin for backward.

``utils.patches.rope`` routes megatron-core's common case (half-split, not interleaved, no
multi-latent attention) through ``apply_rotary`` and leaves every other case to megatron-core. Transformer Engine's fused RoPE is
untouched: it is used through ``apply_rope_fusion`` on the TE spec.

SwiGLU: the local MLP chunks fc1's output and multiplies ``silu(gate) * up``; autograd then
concatenates the two halves' gradients (a full copy per layer). ``SwiGLU`` writes both halves
of the gradient into one buffer, saves fc1's output and ``silu(gate)`` (what autograd saves
too) and uses aten's fused silu derivative; for contiguous float32 or bf16 CPU tensors, the fused
C++ kernels (``utils.cpu_kernels``) do each direction in one pass (bf16: computed in float32 and
rounded once, where torch's ops round after silu and after each product) and save only fc1's output. It is plugged in as the MLP's
activation module (``MLPSubmodules.activation_func``), the hook megatron-core provides for
Transformer Engine's activations.

RMSNorm: torch's ``rms_norm`` has no fused CPU kernel; autograd differentiates its composite
(power, mean, reciprocal square root, two products), ~10 passes over the activations per norm.
``RMSNorm`` (a ``torch.nn.RMSNorm`` with the same parameters and state) computes the float32
backward directly in ~6 (one pass each way with the fused CPU kernels, for contiguous CPU
tensors; bf16 CPU tensors too, computed in float32 and rounded once, the weight's gradient summed
in float32); ``use_lean_norms`` switches a built model's norms to it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

_last_tables = None  # (freqs, its version, mscale, dtype, cos, sin) of the latest call


def _halves(freqs: torch.Tensor, mscale: float, dtype: torch.dtype):
    """cos/sin of the first half of ``freqs`` (megatron-core repeats the angles in both halves).

    Every layer's queries and keys get the same ``freqs`` tensor in a forward, so the tables of the
    latest call are reused while it is that same, unmodified tensor (per-token angles of packed
    rollouts make them as large as the activations' heads)."""
    global _last_tables
    # Tables made by the decode loop (inference mode) carry no version counter: never cached.
    cacheable = not freqs.is_inference()
    last = _last_tables
    if (cacheable and last is not None and last[0] is freqs and last[1] == freqs._version and last[2] == mscale
            and last[3] == dtype):
        return last[4], last[5]
    half = freqs[..., : freqs.shape[-1] // 2]
    cos, sin = torch.cos(half), torch.sin(half)
    if mscale != 1.0:
        cos, sin = cos * mscale, sin * mscale
    cos, sin = cos.to(dtype), sin.to(dtype)
    if cacheable:
        _last_tables = (freqs, freqs._version, mscale, dtype, cos, sin)
    return cos, sin


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, sign: float = 1.0) -> torch.Tensor:
    """``[x1*cos - sign*x2*sin, x2*cos + sign*x1*sin]`` over the last dimension's halves."""
    x1, x2 = x.chunk(2, dim=-1)
    out = torch.empty_like(x)
    o1, o2 = out.chunk(2, dim=-1)
    torch.mul(x1, cos, out=o1)
    o1.addcmul_(x2, sin, value=-sign)
    torch.mul(x2, cos, out=o2)
    o2.addcmul_(x1, sin, value=sign)
    return out


class RotaryEmbedding(torch.autograd.Function):
    """``t`` [..., rot] rotated by ``cos``/``sin`` [..., rot/2] (broadcast); backward rotates back."""

    @staticmethod
    def forward(ctx, t, cos, sin):
        ctx.save_for_backward(cos, sin)
        return rotate(t, cos, sin, 1.0)

    @staticmethod
    def backward(ctx, grad):
        cos, sin = ctx.saved_tensors
        return rotate(grad.contiguous(), cos, sin, -1.0), None, None


def rotary_from_tables(t: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE on the first ``2 * cos.shape[-1]`` channels of ``t`` (the rest pass through), from
    ``cos``/``sin`` of one half's angles; differentiable. The decode loop passes tables it built once."""
    rot = 2 * cos.shape[-1]
    # Without autograd (decoding) the function's bookkeeping is pure overhead.
    fn = RotaryEmbedding.apply if torch.is_grad_enabled() and t.requires_grad else rotate
    if rot == t.shape[-1]:
        return fn(t, cos, sin)
    return torch.cat((fn(t[..., :rot], cos, sin), t[..., rot:]), dim=-1)


def apply_rotary(t: torch.Tensor, freqs: torch.Tensor, mscale: float = 1.0) -> torch.Tensor:
    """RoPE on the first ``freqs.shape[-1]`` channels of ``t`` (the rest pass through)."""
    return rotary_from_tables(t, *_halves(freqs, mscale, t.dtype))


def _fused_cpu_kernels(x: torch.Tensor, dtypes=(torch.float32,)):
    """The fused CPU kernels (``utils.cpu_kernels``) for a contiguous CPU tensor of ``dtypes``, else None."""
    if x.device.type != "cpu" or x.dtype not in dtypes or not x.is_contiguous():
        return None
    from nemo_aligner.utils import cpu_kernels

    return cpu_kernels.load()


class _SwiGLUFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        kernels = _fused_cpu_kernels(x, (torch.float32, torch.bfloat16))
        ctx.kernels = kernels
        if kernels is not None:  # one pass each way; only x is saved (silu(gate) is recomputed)
            ctx.save_for_backward(x)
            return kernels.swiglu(x.view(-1, x.shape[-1])).view(*x.shape[:-1], x.shape[-1] // 2)
        gate, up = x.chunk(2, dim=-1)
        activated = torch.nn.functional.silu(gate)
        # silu(gate) is kept (as autograd keeps it for silu(gate) * up): recomputing it in
        # backward costs a pass of exponentials per layer.
        ctx.save_for_backward(x, activated)
        return activated * up

    @staticmethod
    def backward(ctx, grad):
        if ctx.kernels is not None:
            (x,) = ctx.saved_tensors
            flat = x.view(-1, x.shape[-1])
            # explicit sizes: an expert that got no tokens has a [0, ...] gradient
            grad = grad.to(x.dtype).contiguous().view(flat.shape[0], flat.shape[1] // 2)
            return ctx.kernels.swiglu_backward(grad, flat).view_as(x)
        x, activated = ctx.saved_tensors
        gate, up = x.chunk(2, dim=-1)
        out = torch.empty_like(x)
        grad_gate, grad_up = out.chunk(2, dim=-1)
        torch.mul(grad, activated, out=grad_up)
        # aten's fused silu derivative, sigmoid(g) * (1 + g * (1 - sigmoid(g))), in one pass
        # (written out it took six elementwise passes over the activations).
        torch.ops.aten.silu_backward.grad_input(grad * up, gate, grad_input=grad_gate)
        return out


def swiglu(x: torch.Tensor) -> torch.Tensor:
    """``silu(x1) * x2`` over the halves of the last dimension, differentiable (one fused pass each
    way for contiguous float32 and bf16 CPU tensors)."""
    return _SwiGLUFunction.apply(x)


class SwiGLU(torch.nn.Module):
    """``silu(x1) * x2`` over the halves of the last dimension (megatron-core's ``swiglu``)."""

    def __init__(self, config=None):
        super().__init__()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return swiglu(x)

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata=None) -> dict:
        """No parameters: nothing in the (megatron-core) distributed checkpoint."""
        return {}


class _RMSNormFunction(torch.autograd.Function):
    """``x * rsqrt(mean(x^2) + eps) * weight`` over the last dimension; saves the normalised input
    (instead of the input: the same memory, one pass less in backward) and ``rstd``."""

    @staticmethod
    def forward(ctx, x, weight, eps):
        h = x.shape[-1]
        kernels = _fused_cpu_kernels(x, (torch.float32, torch.bfloat16)) if weight.device.type == "cpu" else None
        ctx.kernels = kernels
        if kernels is not None:  # one pass each way; saves the input and rstd
            out, rstd = kernels.rms_norm_forward(x.view(-1, h), weight, eps)
            ctx.save_for_backward(x, weight, rstd)
            return out.view_as(x)
        rstd = torch.linalg.vector_norm(x, dim=-1, keepdim=True).pow_(2).div_(h).add_(eps).rsqrt_()
        normed = x * rstd
        ctx.save_for_backward(normed, weight, rstd)
        return normed * weight

    @staticmethod
    def backward(ctx, grad):
        if ctx.kernels is not None:
            x, weight, rstd = ctx.saved_tensors
            h = x.shape[-1]
            grad = grad.to(x.dtype).contiguous().view(-1, h)
            grad_x, grad_weight = ctx.kernels.rms_norm_backward(grad, x.view(-1, h), weight, rstd)
            # the weight's gradient is summed over rows in float32 and rounded once to its dtype
            return grad_x.view_as(x), grad_weight.to(weight.dtype), None
        normed, weight, rstd = ctx.saved_tensors
        h = normed.shape[-1]
        grad = grad.contiguous()
        grad_weight = (grad * normed).view(-1, h).sum(0)
        grad_normed = grad * weight
        # d/dx of x * rstd: rstd * (g - normed * mean(g * normed))
        mean = torch.linalg.vecdot(grad_normed, normed).unsqueeze(-1).div_(h)
        grad_x = grad_normed.addcmul_(normed, mean, value=-1).mul_(rstd)
        return grad_x, grad_weight, None


class RMSNorm(torch.nn.RMSNorm):
    """``torch.nn.RMSNorm`` whose training forward/backward runs through ``_RMSNormFunction`` for
    float32 inputs and weights, and for bf16 inputs and weights where the fused CPU kernels apply;
    no-grad calls of bf16 CPU inputs and weights run the fused forward too (torch's bf16 norm is a
    composite of several passes). Other calls (mixed dtypes included) use torch's own."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.weight
        if weight is None or len(self.normalized_shape) != 1:
            return super().forward(x)
        eps = self.eps if self.eps is not None else torch.finfo(x.dtype).eps
        training = torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)
        if x.dtype == torch.float32 and weight.dtype == torch.float32 and training:
            return _RMSNormFunction.apply(x, weight, eps)
        if x.dtype == weight.dtype == torch.bfloat16 and weight.device.type == "cpu":
            kernels = _fused_cpu_kernels(x, (torch.bfloat16,))
            if kernels is not None:
                if training:
                    return _RMSNormFunction.apply(x, weight, eps)
                return kernels.rms_norm_forward(x.view(-1, x.shape[-1]), weight, eps)[0].view_as(x)
        return super().forward(x)



def use_lean_norms(module: torch.nn.Module) -> None:
    """Switch every ``torch.nn.RMSNorm`` in ``module`` (megatron-core's local spec builds them) to
    :class:`RMSNorm`, in place; parameters and checkpoints are unchanged."""
    for m in module.modules():
        if type(m) is torch.nn.RMSNorm:
            m.__class__ = RMSNorm


class LayerNorm1P(torch.nn.LayerNorm):
    """NeMo's ``layernorm1p``: LayerNorm whose stored weight is gamma - 1 (zero-centred), so a weight
    of zeros is the identity scale; same parameter names as ``torch.nn.LayerNorm``."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, self.normalized_shape, self.weight + 1, self.bias, self.eps)


def use_zero_centered_layernorms(module: torch.nn.Module) -> None:
    """Switch every ``torch.nn.LayerNorm`` in ``module`` to :class:`LayerNorm1P`, in place; their
    weights start at zero (gamma 1), as NeMo initialises them."""
    for m in module.modules():
        if type(m) is torch.nn.LayerNorm:
            m.__class__ = LayerNorm1P
            if m.weight is not None:
                with torch.no_grad():
                    m.weight.zero_()
