"""bf16 on the CPU: where a CPU has bf16 matmul units, training's weight gradients run as bf16 GEMMs,
short attention runs in float32, and decode steps keep their glue in float32 around bf16 matmuls.
Each choice is checked against its exact definition and against a float32 reference, on every
machine (the hardware check is patched where a test needs one answer)."""

import pytest
import torch
import torch.nn.functional as F

from conftest import TINY_ARCH
from nemo_aligner.models.nlp.gpt import generation
from nemo_aligner.utils import cpu_gemm, sdpa
from nemo_aligner.utils.patches import cpu_compat
from test_cpu_kernels import _step_logits
from test_generation import PROMPTS, build


@pytest.mark.stack
@pytest.mark.parametrize("fast", [True, False], ids=["bf16-units", "no-bf16-units"])
def test_wgrad_accumulation_of_bf16_activations(monkeypatch, fast):
    """main_grad += grad_output^T @ input: one bf16 GEMM added to main_grad where the CPU has bf16
    units (megatron-core's unfused rounding), a float32 GEMM elsewhere (the fused CUDA kernel's)."""
    monkeypatch.setattr(cpu_compat, "has_fast_bf16_matmul", lambda: fast)
    torch.manual_seed(0)
    total_input, grad_output = torch.randn(96, 40).bfloat16(), torch.randn(96, 24).bfloat16()
    main_grad = torch.randn(24, 40)
    before = main_grad.clone()
    cpu_compat._WgradAccumulation.wgrad_gemm_accum_fp32(total_input, grad_output, main_grad)
    if fast:
        expected = before + torch.mm(grad_output.t(), total_input).float()
    else:
        expected = before.addmm(grad_output.t().float(), total_input.float())
    assert torch.equal(main_grad, expected)
    exact = before.double() + grad_output.double().t() @ total_input.double()
    product = (exact - before.double()).abs().max()
    # one rounding of the product to bf16 at most (relative 2^-8), or float32 sums
    assert (main_grad.double() - exact).abs().max() <= product * (2 ** -8 if fast else 1e-6)


def _qkv(keys, dtype, grad=True):
    torch.manual_seed(1)
    return [torch.randn(2, 3, keys, 16, dtype=dtype).requires_grad_(grad) for _ in range(3)]


@pytest.mark.parametrize("keys", [78, 300])
@pytest.mark.parametrize("fast", [True, False], ids=["bf16-units", "no-bf16-units"])
def test_sdpa_runs_short_bf16_training_attention_in_float32(monkeypatch, keys, fast):
    monkeypatch.setattr(sdpa, "has_fast_bf16_matmul", lambda: fast)
    q, k, v = _qkv(keys, torch.bfloat16)
    mask = torch.ones(keys, keys, dtype=torch.bool).tril()
    out = sdpa.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=0.3)
    widened = keys <= sdpa.FLOAT32_MAX_KEYS or not fast
    if widened:
        expected = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=mask, scale=0.3).bfloat16()
    else:
        expected = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=0.3)
    assert out.dtype == torch.bfloat16 and torch.equal(out, expected)
    out.float().square().sum().backward()
    assert q.grad.dtype == torch.bfloat16 and torch.isfinite(q.grad).all()
    # the float64 reference: gradients within bf16 rounding
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref = F.scaled_dot_product_attention(q64, k64, v64, attn_mask=mask, scale=0.3)
    ref.square().sum().backward()
    assert torch.allclose(out.double(), ref, atol=2e-2, rtol=2e-2)
    assert torch.allclose(q.grad.double(), q64.grad, atol=5e-2 * q64.grad.abs().max().item())


def test_sdpa_runs_fp16_training_attention_in_float32_at_any_length(monkeypatch):
    monkeypatch.setattr(sdpa, "has_fast_bf16_matmul", lambda: True)  # bf16 units do not make fp16 fast
    q, k, v = _qkv(300, torch.float16)
    out = sdpa.scaled_dot_product_attention(q, k, v, is_causal=True)
    expected = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=True).half()
    assert out.dtype == torch.float16 and torch.equal(out, expected)


def test_sdpa_unchanged_outside_bf16_training(monkeypatch):
    monkeypatch.setattr(sdpa, "has_fast_bf16_matmul", lambda: True)
    q, k, v = _qkv(78, torch.float32)
    assert torch.equal(sdpa.scaled_dot_product_attention(q, k, v, is_causal=True),
                       F.scaled_dot_product_attention(q, k, v, is_causal=True))
    q, k, v = _qkv(78, torch.bfloat16, grad=False)  # inference: bf16 kernels
    assert torch.equal(sdpa.scaled_dot_product_attention(q, k, v, is_causal=True),
                       F.scaled_dot_product_attention(q, k, v, is_causal=True))
    q, k, v = _qkv(78, torch.bfloat16)
    with torch.no_grad():
        assert torch.equal(sdpa.scaled_dot_product_attention(q, k, v, is_causal=True),
                           F.scaled_dot_product_attention(q, k, v, is_causal=True))


@pytest.mark.skipif(torch.cuda.is_available(), reason="the fused CPU decode step: a visible GPU holds the model")
@pytest.mark.parametrize("texts", [PROMPTS, ["sort cba = ", "sort abc = "]], ids=["padded", "unpadded"])
def test_bf16_decode_steps_widen_the_glue(mcore_single, monkeypatch, texts):
    """A bf16 model's decode steps through the float32 kernels (the cache in bf16, as the model's own
    attention keeps it) land nearer a float32 run of the same (bf16-valued) weights than the
    all-bf16 Python step does; the prefill runs in bf16 either way."""
    model = build(TINY_ARCH, seed=5)
    with torch.no_grad():
        for p in model.module.parameters():
            p.copy_(p.bfloat16().float())  # the bf16 weights, exactly, in float32
    reference = _step_logits(model, True, texts)
    model.module.to(torch.bfloat16)
    monkeypatch.setattr(generation, "has_fast_bf16_matmul", lambda: False)
    plain = _step_logits(model, False, texts)
    monkeypatch.setattr(generation, "has_fast_bf16_matmul", lambda: True)
    decoder = generation.KVCacheDecoder(model.module, len(texts), 8)
    assert decoder.fused is not None and decoder.cache.dtype == torch.bfloat16
    widened = _step_logits(model, True, texts)
    assert torch.equal(widened[0], plain[0])
    # the decode steps (the prefill, step 0, is the same bf16 computation in both)
    widened_error = (widened[1:] - reference[1:]).abs().max()
    plain_error = (plain[1:] - reference[1:]).abs().max()
    assert widened_error < plain_error, (widened_error, plain_error)
    assert torch.allclose(widened, reference, atol=3e-2 * reference.abs().max().item())
    # the Python step (the fallback) over the same bf16 cache: the plain step exactly
    fallback = _step_logits(model, False, texts)
    assert torch.equal(fallback, plain)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU prefill")
def test_bf16_prefill_norms_and_swiglu_are_the_models_own(mcore_single):
    """A bf16 prefill (the decode loop's Python step) runs the model's own RMSNorm and SwiGLU (the
    fused kernels: float32 maths, one rounding), bit for bit, not torch's bf16 norm or a silu and a
    product each rounded to bf16 (which differs); with torch 2.13 the whole prefill's logits then
    equal the model's bf16 forward."""
    from nemo_aligner.utils import cpu_kernels

    if cpu_kernels.load() is None:
        pytest.skip("the fused CPU kernels do not build here")
    model = build(TINY_ARCH, seed=5)
    model.module.to(torch.bfloat16)
    layer = model.module.decoder.layers[0]
    torch.manual_seed(6)
    with torch.no_grad():  # trained-looking norm weights (the built ones are all 1)
        for norm in (layer.input_layernorm, layer.pre_mlp_layernorm):
            norm.weight.copy_(torch.rand_like(norm.weight) + 0.5)
    x = (torch.randn(13, 2, TINY_ARCH["hidden_size"]) * 3).bfloat16()
    h = (torch.randn(13, 2, layer.mlp.linear_fc1.weight.shape[0]) * 3).bfloat16()
    with torch.inference_mode():
        decoder = generation.KVCacheDecoder(model.module, 2, 16)
        plan = decoder.layers[0]
        for norm, module in ((plan["norm1"], layer.input_layernorm), (plan["norm2"], layer.pre_mlp_layernorm)):
            assert torch.equal(norm(x), module(x))  # (newer torch's own bf16 norm rounds once too; slower)
        assert torch.equal(decoder._activation(h), layer.mlp.activation_func(h))
        gate, up = h.chunk(2, dim=-1)
        assert not torch.equal(decoder._activation(h), F.silu(gate) * up)


def bf16_decode_model(monkeypatch, backend: str, seed: int):
    """A tiny bf16 model whose decode matmuls run on ``backend``'s bf16 GEMM, as on a CPU with bf16
    matmul units (skips where this machine lacks that GEMM)."""
    if not cpu_gemm.available(backend) or (backend == "native" and not cpu_gemm.native_packs_bf16()):
        pytest.skip(f"this machine has no {backend} bf16 GEMM")
    monkeypatch.setattr(generation, "has_fast_bf16_matmul", lambda: True)
    monkeypatch.setattr(cpu_gemm, "has_fast_bf16_matmul", lambda: True)
    monkeypatch.setenv(cpu_gemm.ENV_VAR, backend)
    model = build(TINY_ARCH, seed=seed)
    model.module.to(torch.bfloat16)
    return model


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU decode GEMMs")
@pytest.mark.parametrize("backend", ["onednn", "native", "amx"])
@pytest.mark.parametrize("fused", [True, False], ids=["fused-step", "python-step"])
def test_bf16_decode_matmuls_run_on_packed_bf16_weights(mcore_single, monkeypatch, fused, backend):
    """Where the CPU has bf16 matmul units a bf16 model's decode steps multiply through packed bf16
    weights (oneDNN's, our AVX512_BF16 GEMM or our AMX GEMM): the same logits as ``F.linear``'s bf16
    matmuls to bf16 rounding; oneDNN's and the AMX GEMM's prefill (more rows than packed for:
    ``F.linear``) identical."""
    model = bf16_decode_model(monkeypatch, backend, seed=5)
    decoder = generation.KVCacheDecoder(model.module, len(PROMPTS), 8)
    assert decoder.gemm_backend == backend
    assert len(decoder.packed) == 4 * TINY_ARCH["num_layers"] + 1  # every layer's four matrices and the output
    packed = _step_logits(model, fused, PROMPTS)
    monkeypatch.setenv(cpu_gemm.ENV_VAR, "plain")
    plain = _step_logits(model, fused, PROMPTS)
    if backend in ("onednn", "amx"):
        assert torch.equal(packed[0], plain[0])
    assert torch.allclose(packed, plain, atol=3e-2 * plain.abs().max().item())
    assert (packed[1:].argmax(-1) == plain[1:].argmax(-1)).float().mean() > 0.9


def _bf16_ulp(t: torch.Tensor) -> torch.Tensor:
    """The spacing of bf16 values at each element of ``t`` (float64)."""
    exponent = torch.frexp(t.abs().clamp(min=1e-30))[1]
    return torch.pow(2.0, (exponent - 8).double())


@pytest.mark.parametrize("width", [1024, 45])  # vector body; odd width (scalar tail)
def test_swiglu_kernels_in_bf16(width):
    """The fused SwiGLU kernels on bf16 tensors: float32 maths rounded once, so each output is the
    exact value rounded to bf16 (within one bf16 step where float32's exp decides a tie)."""
    from nemo_aligner.utils import cpu_kernels

    ext = cpu_kernels.load()
    assert ext is not None, "the fused CPU kernels did not build"
    torch.manual_seed(2)
    x = (torch.randn(37, 2 * width) * 4).bfloat16()
    x[0, :3] = torch.tensor([float("nan"), 300.0, -300.0])
    gate, up = x.double().chunk(2, dim=-1)
    exact = gate * torch.sigmoid(gate) * up
    out = ext.swiglu(x)
    assert out.dtype == torch.bfloat16 and out.shape == (37, width)
    assert torch.isnan(out[0, 0])
    finite = ~torch.isnan(exact)
    error = (out.double() - exact).abs()[finite]
    assert (error <= _bf16_ulp(exact)[finite] * 0.5 + 1e-30).float().mean() > 0.99  # rounded to nearest
    assert (error <= _bf16_ulp(exact)[finite]).all()
    grad = (torch.randn(37, width) * 2).bfloat16()
    s = torch.sigmoid(gate)
    g = grad.double()
    exact_dx = torch.cat((g * up * s * (1 + gate * (1 - s)), g * gate * s), dim=-1)
    dx = ext.swiglu_backward(grad, x)
    assert dx.dtype == torch.bfloat16
    finite = ~torch.isnan(exact_dx)
    assert (((dx.double() - exact_dx).abs() <= _bf16_ulp(exact_dx))[finite]).all()
    with pytest.raises(RuntimeError, match="one dtype"):
        ext.swiglu_backward(grad.float(), x)


def test_lean_swiglu_in_bf16_matches_torch(mcore_single):
    """lean_ops.SwiGLU on bf16 (the fused kernels) against torch's ops in float64, forward and backward."""
    from nemo_aligner.models.nlp.gpt.lean_ops import SwiGLU

    torch.manual_seed(3)
    x = (torch.randn(6, 5, 2 * 96) * 3).bfloat16().requires_grad_()
    out = SwiGLU()(x)
    out.backward(torch.ones_like(out))
    x64 = x.detach().double().requires_grad_()
    gate, up = x64.chunk(2, dim=-1)
    ref = F.silu(gate) * up
    ref.backward(torch.ones_like(ref))
    assert out.dtype == torch.bfloat16 and x.grad.dtype == torch.bfloat16
    assert torch.allclose(out.double(), ref, rtol=2 ** -8, atol=1e-6)
    assert torch.allclose(x.grad.double(), x64.grad, rtol=2 ** -7, atol=1e-6)


@pytest.mark.parametrize("width", [256, 45])  # vector body; odd width (scalar tail)
@pytest.mark.parametrize("weight_dtype", [torch.bfloat16, torch.float32])
def test_rms_norm_kernels_in_bf16(width, weight_dtype):
    """The fused RMSNorm kernels on bf16 activations: float32 maths rounded once, so each output is
    the exact value (float64, from the same bf16 inputs) rounded to bf16; the weight's gradient is
    a float32 sum over rows; rstd is float32."""
    from nemo_aligner.utils import cpu_kernels

    ext = cpu_kernels.load()
    assert ext is not None, "the fused CPU kernels did not build"
    torch.manual_seed(4)
    rows, eps = 300, 1e-5
    x = (torch.randn(rows, width) * 3 + 0.5).bfloat16()
    x[1] = 0  # a zero row: rstd = 1/sqrt(eps), output 0
    weight = (torch.rand(width) + 0.5).to(weight_dtype)
    grad = (torch.randn(rows, width) * 2).bfloat16()
    x64, w64, g64 = x.double(), weight.double(), grad.double()
    rstd64 = (x64.pow(2).mean(-1, keepdim=True) + eps).rsqrt()
    normed = x64 * rstd64
    exact = normed * w64
    out, rstd = ext.rms_norm_forward(x, weight, eps)
    assert out.dtype == torch.bfloat16 and rstd.dtype == torch.float32
    assert torch.allclose(rstd.double(), rstd64.squeeze(-1), rtol=1e-6)
    error = (out.double() - exact).abs()
    assert (error <= _bf16_ulp(exact) * 0.5 + 1e-30).float().mean() > 0.99  # rounded to nearest
    assert (error <= _bf16_ulp(exact) + 1e-30).all()
    gn = g64 * w64
    exact_dx = rstd64 * (gn - normed * (gn * normed).mean(-1, keepdim=True))
    exact_dw = (g64 * normed).sum(0)
    dx, dw = ext.rms_norm_backward(grad, x, weight, rstd)
    assert dx.dtype == torch.bfloat16 and dw.dtype == torch.float32
    # dx's mean term cancels: allow float32's error on top of one bf16 rounding
    assert ((dx.double() - exact_dx).abs() <= _bf16_ulp(exact_dx) + 1e-5 * exact_dx.abs().max()).all()
    assert torch.allclose(dw.double(), exact_dw, rtol=1e-5, atol=1e-4)
    with pytest.raises(RuntimeError, match="one dtype"):
        ext.rms_norm_backward(grad.float(), x, weight, rstd)


def test_lean_rms_norm_in_bf16_matches_float64(mcore_single):
    """lean_ops.RMSNorm with bf16 weights and activations (the fused kernels): forward, input and
    weight gradients against float64 from the same bf16 values, nearer than torch's own bf16 norm;
    under no_grad the same forward values."""
    from nemo_aligner.models.nlp.gpt.lean_ops import RMSNorm, use_lean_norms
    from nemo_aligner.utils import cpu_kernels

    assert cpu_kernels.load() is not None, "the fused CPU kernels did not build"
    torch.manual_seed(5)
    torch_norm = torch.nn.RMSNorm(96, eps=1e-5)
    with torch.no_grad():
        torch_norm.weight.copy_(torch.rand(96) + 0.5)
    torch_norm = torch_norm.bfloat16()
    lean = torch.nn.RMSNorm(96, eps=1e-5).bfloat16()
    lean.load_state_dict(torch_norm.state_dict())
    use_lean_norms(lean)
    assert type(lean) is RMSNorm
    x = (torch.randn(6, 5, 96) * 3).bfloat16()
    grad = torch.randn(6, 5, 96).bfloat16()
    x64 = x.double().requires_grad_()
    w64 = torch_norm.weight.detach().double().requires_grad_()
    ref = F.rms_norm(x64, (96,), w64, 1e-5)
    ref.backward(grad.double())
    results = {}
    for name, norm in (("lean", lean), ("torch", torch_norm)):
        xi = x.clone().requires_grad_()
        out = norm(xi)
        out.backward(grad)
        assert out.dtype == xi.grad.dtype == norm.weight.grad.dtype == torch.bfloat16
        results[name] = [(out.double() - ref).abs().max(), (xi.grad.double() - x64.grad).abs().max(),
                         (norm.weight.grad.double() - w64.grad).abs().max()]
    lean_err, torch_err = results["lean"], results["torch"]
    assert lean_err[0] <= 2 ** -8 * ref.abs().max() and lean_err[1] <= 2 ** -7 * x64.grad.abs().max()
    assert lean_err[2] <= 2 ** -8 * w64.grad.abs().max()
    assert lean_err[0] <= torch_err[0] and lean_err[2] <= torch_err[2], (lean_err, torch_err)
    with torch.no_grad():
        assert torch.equal(lean(x), lean(x.clone().requires_grad_()).detach())
