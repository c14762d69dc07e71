"""The decode loop's packed CPU matmuls equal ``F.linear``, and the backend is chosen by CPU vendor
unless ``NEMO_ALIGNER_DECODE_GEMM`` names one."""

import pytest
import torch
import torch.nn.functional as F

from nemo_aligner.utils import cpu_gemm
from nemo_aligner.utils.errors import ConfigError

AVAILABLE = [b for b in cpu_gemm.BACKENDS if cpu_gemm.available(b)]


@pytest.mark.parametrize("backend", AVAILABLE)
@pytest.mark.parametrize("with_bias", [False, True])
def test_packed_linear_equals_f_linear(backend, with_bias):
    torch.manual_seed(0)
    weight, bias = torch.randn(96, 64), torch.randn(96) if with_bias else None
    rows = 8
    packed = cpu_gemm.pack(weight, rows, backend)
    assert (packed is None) == (backend in ("plain", "amx"))  # the AMX GEMM multiplies bf16 only
    call = cpu_gemm.linear(weight, bias, packed, rows, backend)
    # a decode step's [1, rows, in], a smaller batch, a prefill's [S, rows, in], a strided input,
    # and row counts around our kernel's 6-row blocks
    for x in (torch.randn(1, rows, 64), torch.randn(3, 64), torch.randn(16, rows, 64), torch.randn(1, rows, 128)[..., ::2],
              torch.randn(5, 64), torch.randn(7, 64), torch.randn(1, 64)):
        with torch.inference_mode():
            out = call(x)
        assert torch.allclose(out, F.linear(x, weight, bias), rtol=1e-5, atol=1e-5)


def test_which_matrices_each_backend_packs():
    """CPU matrices: float32 by every backend but the AMX one, bf16 by oneDNN, the AMX GEMM and
    (built with AVX512_BF16) our GEMM; never fp16 or vectors."""
    backends = [b for b in AVAILABLE if b != "plain"]
    if not backends:
        pytest.skip("this torch build has no packed GEMM")
    for backend in backends:
        packed_bf16 = cpu_gemm.pack(torch.randn(4, 4, dtype=torch.bfloat16), 2, backend)
        packs_bf16 = backend in ("onednn", "amx") or (backend == "native" and cpu_gemm.native_packs_bf16())
        assert (packed_bf16 is not None) == packs_bf16, backend
        if backend == "native":  # our bf16 GEMM takes pairs of inputs: an odd width is not packed
            assert cpu_gemm.pack(torch.randn(4, 5, dtype=torch.bfloat16), 2, backend) is None
        assert cpu_gemm.pack(torch.randn(4, 4, dtype=torch.float16), 2, backend) is None
        assert cpu_gemm.pack(torch.randn(4), 2, backend) is None
        assert (cpu_gemm.pack(torch.randn(4, 4), 2, backend) is not None) == (backend != "amx")


@pytest.mark.skipif(not cpu_gemm.available("onednn"), reason="this torch build has no oneDNN packed GEMM")
@pytest.mark.parametrize("with_bias", [False, True])
def test_packed_bf16_linear_equals_f_linear(with_bias):
    """oneDNN's packed bf16 matmul: float32 sums of the bf16 products, rounded once to bf16, as
    ``F.linear`` on the same bf16 tensors (within one bf16 step: the sums' order differs)."""
    torch.manual_seed(1)
    weight = torch.randn(96, 64).bfloat16()
    bias = torch.randn(96).bfloat16() if with_bias else None
    rows = 8
    call = cpu_gemm.linear(weight, bias, cpu_gemm.pack(weight, rows, "onednn"), rows, "onednn")
    for x in (torch.randn(1, rows, 64), torch.randn(3, 64), torch.randn(16, rows, 64)):
        x = x.bfloat16()
        with torch.inference_mode():
            out = call(x)
        exact = F.linear(x.double(), weight.double(), bias.double() if bias is not None else None)
        assert out.dtype == torch.bfloat16 and out.shape == exact.shape
        step = torch.pow(2.0, torch.frexp(exact.abs().clamp(min=1e-30))[1] - 8).double()  # one bf16 ulp
        assert ((out.double() - exact).abs() <= step + 1e-6).all()
        assert torch.allclose(out.float(), F.linear(x, weight, bias).float(), rtol=2 ** -7, atol=1e-2)


def _check_bf16_gemm(call, weight, bias, x, where) -> torch.Tensor:
    """``call.float_output(x)``: float32 sums of the bf16 products, as close to a float64 product of
    the same bf16 values as float32 sums get; ``call`` on the bf16 input: those sums rounded once to
    bf16. Returns the float32 sums."""
    xb = x.bfloat16()
    exact = F.linear(xb.double(), weight.double(), bias.double() if bias is not None else None)
    wide = call.float_output(x)
    assert wide.dtype == torch.float32 and wide.shape == exact.shape
    scale = (xb.double().abs() @ weight.double().abs().t()).max()
    assert (wide.double() - exact).abs().max() <= 1e-6 * scale, where
    out = call(xb)
    assert out.dtype == torch.bfloat16 and torch.equal(out, wide.to(torch.bfloat16))
    return wide


needs_native_bf16 = pytest.mark.skipif(not cpu_gemm.available("native") or not cpu_gemm.native_packs_bf16(),
                                       reason="our packed GEMM is built without AVX512_BF16 on this machine")


@needs_native_bf16
@pytest.mark.parametrize("with_bias", [False, True])
def test_native_bf16_linear_against_float64(with_bias):
    """Our AVX512_BF16 GEMM: float32 sums of the bf16 products, as close to a float64 product of the
    same bf16 values as float32 sums get (``float_output``), and those sums rounded once to bf16
    (the call itself). Row counts around the 12-row register blocks and the 192-row blocks, a width
    past one 32-column panel and not a multiple of it, and inner widths over one k chunk."""
    torch.manual_seed(11)
    for out_features, in_features in ((40, 24), (96, 512), (33, 258)):
        weight = torch.randn(out_features, in_features).bfloat16()
        bias = torch.randn(out_features).bfloat16() if with_bias else None
        call = cpu_gemm.linear(weight, bias, cpu_gemm.pack(weight, 8, "native"), 8, "native")
        for rows in (1, 5, 12, 13, 64, 200, 385):
            _check_bf16_gemm(call, weight, bias, torch.randn(rows, in_features).bfloat16(),
                             (out_features, in_features, rows))
        x3 = torch.randn(2, 3, in_features).bfloat16()  # [S, B, K] inputs keep their leading shape
        assert call(x3).shape == (2, 3, out_features)


@needs_native_bf16
def test_native_bf16_gemm_refusals():
    """The kernel refuses what it does not compute, naming it, before any work."""
    ext = cpu_gemm._kernels()
    weight = torch.randn(64, 32).bfloat16()
    packed = ext.pack_linear(weight)
    assert packed.dtype == torch.int32 and packed.shape == (2, 16, 32)
    with pytest.raises(RuntimeError, match="K even"):
        ext.pack_linear(torch.randn(64, 31).bfloat16())
    x = torch.randn(4, 32).bfloat16()
    with pytest.raises(RuntimeError, match="row-major into a new tensor"):
        ext.packed_gemm(x.t().contiguous(), True, packed, 64, None, None)
    with pytest.raises(RuntimeError, match="does not match"):
        ext.packed_gemm(torch.randn(4, 30).bfloat16(), False, packed, 64, None, None)
    with pytest.raises(RuntimeError, match="takes a bf16 weight packed"):
        ext.packed_gemm(x, False, ext.pack_linear(torch.randn(64, 32)), 64, None, None)
    with pytest.raises(RuntimeError, match="bias"):
        ext.packed_gemm(x, False, packed, 64, torch.randn(64).bfloat16(), None)


needs_amx = pytest.mark.skipif(not cpu_gemm.available("amx"),
                               reason="no AMX tiles here (a CPU without amx_bf16, or our kernels built without them)")


@needs_amx
@pytest.mark.parametrize("with_bias", [False, True])
def test_amx_linear_against_float64(with_bias):
    """The AMX GEMM: float32 sums of the bf16 products, as close to a float64 product of the same
    bf16 values as float32 sums get (``float_output``), those sums rounded once to bf16 (the call);
    a float32 input is rounded to bf16 first, exactly as a cast. Row counts around the 16-row tiles
    and 32-row passes, widths not a multiple of the 16-column tiles (an odd count of them), inner
    widths not a multiple of the 32-deep tiles (odd too)."""
    torch.manual_seed(12)
    for out_features, in_features in ((40, 24), (96, 512), (33, 258), (16, 31), (2304, 768)):
        weight = torch.randn(out_features, in_features).bfloat16()
        bias = torch.randn(out_features).bfloat16() if with_bias else None
        rows = 64
        call = cpu_gemm.linear(weight, bias, cpu_gemm.pack(weight, rows, "amx"), rows, "amx")
        for n in (1, 5, 16, 17, 32, 33, 48, 64):
            x = torch.randn(n, in_features)
            wide = _check_bf16_gemm(call, weight, bias, x, (out_features, in_features, n))
            assert torch.equal(call.float_output(x.bfloat16()), wide)  # the kernel's rounding is the cast's
        x3 = torch.randn(2, 3, in_features).bfloat16()  # [S, B, K] inputs keep their leading shape
        assert call(x3).shape == (2, 3, out_features)
        # more rows than packed for (a prefill): torch's bf16 matmul
        big = torch.randn(3 * rows, in_features).bfloat16()
        assert torch.equal(call(big), F.linear(big, weight, bias))


@needs_amx
def test_amx_gemm_refusals():
    """The AMX kernel refuses what it does not compute, naming it, before any work."""
    ext = cpu_gemm._kernels()
    weight = torch.randn(40, 50).bfloat16()
    packed = ext.amx_pack(weight)
    assert packed.dtype == torch.bfloat16 and packed.shape == (3, 2, 16, 32)
    with pytest.raises(RuntimeError, match="contiguous bf16 CPU"):
        ext.amx_pack(torch.randn(40, 50))
    with pytest.raises(RuntimeError, match="contiguous bf16 CPU"):
        ext.amx_pack(weight.t())
    x = torch.randn(4, 50)
    with pytest.raises(RuntimeError, match="does not match"):
        ext.amx_linear(torch.randn(4, 66), packed, 40, None)
    with pytest.raises(RuntimeError, match="does not match"):
        ext.amx_linear(x, packed, 60, None)
    with pytest.raises(RuntimeError, match="from amx_pack"):
        ext.amx_linear(x, ext.pack_linear(torch.randn(40, 50)) if cpu_gemm.available("native") else weight, 40, None)
    with pytest.raises(RuntimeError, match="bias"):
        ext.amx_linear(x, packed, 40, torch.randn(39))
    with pytest.raises(RuntimeError, match="float32 or bf16|x"):
        ext.amx_linear(x.half(), packed, 40, None)
    # an empty inner dimension: the bias (or zeros), as F.linear
    empty = ext.amx_pack(torch.randn(40, 0).bfloat16())
    bias = torch.randn(40)
    assert torch.equal(ext.amx_linear(torch.randn(3, 0), empty, 40, bias), bias.expand(3, 40))
    assert torch.equal(ext.amx_linear(torch.randn(3, 0), empty, 40, None), torch.zeros(3, 40))
    assert ext.amx_linear(torch.randn(0, 50), packed, 40, None).shape == (0, 40)


@pytest.mark.parametrize("machine,vendor,avx512,expected,without_native", [
    ("x86_64", "GenuineIntel", True, "native", "mkl"),
    ("x86_64", "GenuineIntel", False, "mkl", "mkl"),
    ("x86_64", "AuthenticAMD", True, "native", "onednn"),
    ("x86_64", "AuthenticAMD", False, "native", "onednn"),
    ("x86_64", "", False, "native", "onednn"),
    ("aarch64", "", False, "plain", "plain"),
])
def test_auto_choice_follows_the_cpu(monkeypatch, machine, vendor, avx512, expected, without_native):
    monkeypatch.delenv(cpu_gemm.ENV_VAR, raising=False)
    monkeypatch.setattr(cpu_gemm.platform, "machine", lambda: machine)
    monkeypatch.setattr(cpu_gemm, "cpu_vendor", lambda: vendor)
    monkeypatch.setattr(cpu_gemm, "native_is_avx512", lambda: avx512)
    monkeypatch.setattr(cpu_gemm, "available", lambda b: True)
    assert cpu_gemm.decode_gemm_backend() == expected
    # where our kernels do not build (no compiler, no AVX2), oneDNN as before
    monkeypatch.setattr(cpu_gemm, "available", lambda b: b != "native")
    assert cpu_gemm.decode_gemm_backend() == without_native
    # a build without the preferred library falls back to plain matmuls
    monkeypatch.setattr(cpu_gemm, "available", lambda b: b == "plain")
    assert cpu_gemm.decode_gemm_backend() == "plain"


@pytest.mark.parametrize("fast,amx,native_bf16,onednn,expected", [
    (True, False, True, True, "native"),   # AVX512_BF16 (Zen 4): our GEMM
    (True, True, True, True, "amx"),       # AMX tiles: our AMX GEMM
    (True, "no-amx-build", True, True, "onednn"),  # AMX tiles, our kernels built without them: oneDNN's
    (True, False, False, True, "onednn"),  # our kernels built without the bf16 GEMM
    (False, False, True, True, "plain"),   # no bf16 units: oneDNN would emulate bf16
    (True, False, False, False, "plain"),
])
def test_auto_choice_for_bf16_models(monkeypatch, fast, amx, native_bf16, onednn, expected):
    """A bf16 model decodes through packed bf16 weights where the CPU has bf16 matmul units: our
    AVX512_BF16 GEMM, our AMX GEMM where the CPU has AMX tiles, or oneDNN's where our GEMM is not
    built; elsewhere
    oneDNN emulates bf16, slower than ``F.linear``'s path gains. The setting still wins; bf16
    training matmuls stay on oneDNN unless another backend is named."""
    monkeypatch.delenv(cpu_gemm.ENV_VAR, raising=False)
    monkeypatch.setattr(cpu_gemm, "_TRAINING_CHOICE", {})
    monkeypatch.setattr(cpu_gemm.platform, "machine", lambda: "x86_64")
    monkeypatch.setattr(cpu_gemm, "cpu_vendor", lambda: "AuthenticAMD")
    monkeypatch.setattr(cpu_gemm, "cpuinfo", lambda field: "avx2 avx512f avx512_bf16" + (" amx_bf16" if amx else ""))
    monkeypatch.setattr(cpu_gemm, "has_fast_bf16_matmul", lambda: fast)
    monkeypatch.setattr(cpu_gemm, "native_packs_bf16", lambda: native_bf16)
    monkeypatch.setattr(cpu_gemm, "available", lambda b: (b != "onednn" or onednn) and (b != "amx" or amx is True))
    assert cpu_gemm.decode_gemm_backend(torch.bfloat16) == expected
    assert cpu_gemm.decode_gemm_backend(torch.float32) == "native"
    assert cpu_gemm.bf16_training_on_onednn() == (expected != "plain")
    monkeypatch.setattr(cpu_gemm, "_TRAINING_CHOICE", {})
    monkeypatch.setenv(cpu_gemm.ENV_VAR, "native")
    assert cpu_gemm.decode_gemm_backend(torch.bfloat16) == "native"
    assert not cpu_gemm.bf16_training_on_onednn()


def test_environment_override_and_its_errors(monkeypatch):
    for backend in AVAILABLE:
        monkeypatch.setenv(cpu_gemm.ENV_VAR, backend.upper())
        assert cpu_gemm.decode_gemm_backend() == backend
    monkeypatch.setenv(cpu_gemm.ENV_VAR, "blas")
    with pytest.raises(ConfigError, match="NEMO_ALIGNER_DECODE_GEMM='blas'.*auto, native, mkl, onednn, amx, plain"):
        cpu_gemm.decode_gemm_backend()
    monkeypatch.setenv(cpu_gemm.ENV_VAR, "mkl")
    monkeypatch.setattr(cpu_gemm, "available", lambda b: b != "mkl")
    with pytest.raises(ConfigError, match="no mkl packed GEMM"):
        cpu_gemm.decode_gemm_backend()


def test_cpuinfo_fields_of_this_machine():
    vendor = cpu_gemm.cpu_vendor()
    try:
        lines = open("/proc/cpuinfo").read().splitlines()
    except OSError:
        assert vendor == "" and cpu_gemm.cpuinfo("model name") == ""
        return
    first = {}
    for line in lines:
        name, sep, value = line.partition(":")
        if sep:
            first.setdefault(name.strip(), value.strip())
    assert vendor == first.get("vendor_id", "")
    assert cpu_gemm.cpuinfo("model name") == first.get("model name", "")
    assert cpu_gemm.cpuinfo("no such field") == ""


NATIVE = cpu_gemm.available("native")
needs_native = pytest.mark.skipif(not NATIVE or torch.cuda.is_available(),
                                  reason="our CPU GEMM needs AVX2 + FMA and the built kernels (and no GPU holding the model)")


def _float64_linear(x, weight, bias, grad):
    x64, w64, b64 = (t.detach().double().requires_grad_() for t in (x, weight, bias))
    out = F.linear(x64, w64, b64)
    out.backward(grad.double())
    return out, x64.grad, w64.grad, b64.grad


@needs_native
@pytest.mark.parametrize("out_features", [24, 1024])  # 1024 rows of weight gradient: the padded transposed read
def test_native_linear_forward_and_gradients_against_float64(out_features):
    """NativeLinear's output, input, weight and bias gradients, for a strided [S, B, K] input, are as
    close to float64 as torch's float32 linear layer."""
    torch.manual_seed(2)
    x = torch.randn(3, 13, 40).transpose(0, 1).requires_grad_()  # [13, 3, 40], not contiguous
    weight, bias = torch.randn(out_features, 40, requires_grad=True), torch.randn(out_features, requires_grad=True)
    grad = torch.randn(13, 3, out_features)
    ours = cpu_gemm.NativeLinear.apply(x, weight, bias, None)
    ours.backward(grad)
    ours = (ours.detach(), x.grad, weight.grad, bias.grad)
    for t in (x, weight, bias):
        t.grad = None
    reference = F.linear(x, weight, bias)
    reference.backward(grad)
    reference = (reference.detach(), x.grad, weight.grad, bias.grad)
    exact = _float64_linear(x, weight, bias, grad)
    for name, a, r, e in zip(("output", "input grad", "weight grad", "bias grad"), ours, reference, exact):
        assert a.shape == e.shape, name
        assert (a.double() - e.detach()).abs().max() <= 4 * (r.double() - e.detach()).abs().max() + 1e-6, name


@needs_native
def test_native_linear_adds_the_weight_gradient_into_main_grad():
    """With megatron-core's ``main_grad`` the weight gradient is added into it (no gradient in a new
    tensor); a parameter with ``grad_added_to_main_grad`` gets a dummy gradient (zeros with
    ``zero_out_wgrad``) and the flag set, as megatron-core's own linear layer does."""
    torch.manual_seed(3)
    x, grad = torch.randn(37, 40, requires_grad=True), torch.randn(37, 24)
    weight = torch.randn(24, 40, requires_grad=True)
    before = torch.randn(24, 40)
    weight.main_grad = before.clone()
    weight.grad_added_to_main_grad, weight.zero_out_wgrad = False, True
    cpu_gemm.NativeLinear.apply(x, weight, None, weight.main_grad).backward(grad)
    expected = before.double() + grad.double().t() @ x.detach().double()
    assert torch.allclose(weight.main_grad.double(), expected, atol=1e-4)
    assert weight.grad_added_to_main_grad is True
    assert torch.equal(weight.grad, torch.zeros(24, 40))
    assert torch.allclose(x.grad, grad @ weight.detach(), atol=1e-5)


@needs_native
def test_megatron_linear_calls_go_to_native_only_where_it_applies(monkeypatch):
    """The wrapper around megatron-core's linear functions runs our GEMM for float32 CPU calls without
    communication, and hands everything else to megatron-core's function unchanged."""
    seen = []

    def original(input, weight, *args, **kwargs):
        seen.append(kwargs)
        return F.linear(input, weight, kwargs.get("bias"))

    linear = cpu_gemm.native_linear_or(original)
    torch.manual_seed(4)
    x, weight, bias = torch.randn(5, 2, 16), torch.randn(8, 16), torch.randn(8)
    plain = dict(bias=bias, gradient_accumulation_fusion=False, allreduce_dgrad=False, sequence_parallel=False,
                 grad_output_buffer=None, wgrad_deferral_limit=None, tp_group=None)
    monkeypatch.setenv(cpu_gemm.ENV_VAR, "native")
    monkeypatch.setattr(cpu_gemm, "_TRAINING_CHOICE", {})
    monkeypatch.setattr(cpu_gemm, "large_matmuls_on_torch", lambda: False)
    assert torch.allclose(linear(x, weight, **plain), F.linear(x, weight, bias), atol=1e-5)
    assert seen == []
    for change in ({"sequence_parallel": True}, {"allreduce_dgrad": True}, {"grad_output_buffer": []},
                   {"gtp_remat_size": 2}, {"a_newer_megatron_core_argument": 1}):
        linear(x, weight, **dict(plain, **change))
        assert len(seen) == 1 and seen.pop() == dict(plain, **change), change
    linear(x.double(), weight.double(), **dict(plain, bias=bias.double()))
    assert len(seen) == 1
    seen.clear()
    monkeypatch.setenv(cpu_gemm.ENV_VAR, "plain")  # torch's matmuls where our GEMM is not the choice
    linear(x, weight, **plain)
    assert len(seen) == 1
    seen.clear()
    # an Intel CPU: training keeps torch's (MKL's) matmuls even where decode steps use our GEMM
    monkeypatch.setenv(cpu_gemm.ENV_VAR, "native")
    monkeypatch.setattr(cpu_gemm, "_TRAINING_CHOICE", {})
    monkeypatch.setattr(cpu_gemm, "large_matmuls_on_torch", lambda: True)
    linear(x, weight, **plain)
    assert len(seen) == 1


@needs_native
@pytest.mark.parametrize("intel", [True, False])
def test_native_decode_linear_hands_large_inputs_to_torch_on_intel(monkeypatch, intel):
    """The decode loop's native linear runs our GEMM up to the row count it was packed for; beyond
    it (a prefill), F.linear on Intel CPUs (MKL is faster there), our GEMM elsewhere."""
    real = cpu_gemm._kernels()
    rows_seen = []

    class Counting:
        def __getattr__(self, name):
            return getattr(real, name)

        def packed_linear(self, x, *args):
            rows_seen.append(x.shape[0])
            return real.packed_linear(x, *args)

    monkeypatch.setattr(cpu_gemm, "_kernels", lambda: Counting())
    monkeypatch.setattr(cpu_gemm, "large_matmuls_on_torch", lambda: intel)
    torch.manual_seed(6)
    weight, bias = torch.randn(40, 24), torch.randn(40)
    call = cpu_gemm.linear(weight, bias, cpu_gemm.pack(weight, 8, "native"), 8, "native")
    for rows in (8, 5, 64):
        x = torch.randn(rows, 24)
        with torch.inference_mode():
            assert torch.allclose(call(x), F.linear(x, weight, bias), rtol=1e-5, atol=1e-5)
    assert rows_seen == ([8, 5] if intel else [8, 5, 64])


def _actor_step_per_backend(monkeypatch, function, backends, precision="32"):
    """A GRPO/PPO actor's log-probs, then its loss and every main_grad (DDP's gradient buffers), with
    each ``NEMO_ALIGNER_DECODE_GEMM`` value of ``backends``; and how often ``function`` ran."""
    from test_ppo_actor import build_actor, rollouts
    from nemo_aligner.utils.ppo_utils import create_mask

    model = build_actor(lr=1e-3, precision=precision)
    out = rollouts(model)
    mask = create_mask(out.prompt_lengths, out.response_lengths, out.tokens.shape[1] - 1)
    batch = {"tokens": out.tokens, "advantages": torch.randn(4, 1) * mask, "mask": mask,
             "is_end": torch.ones(4, dtype=torch.bool), "logprobs": None,
             "init_logprobs": model.get_init_policy_logprobs(out.tokens)}
    calls = []
    monkeypatch.setattr(cpu_gemm, "_TRAINING_CHOICE", {})
    apply = function.apply
    monkeypatch.setattr(function, "apply", lambda *a: calls.append(1) or apply(*a))
    results = {}
    for backend in backends:
        monkeypatch.setenv(cpu_gemm.ENV_VAR, backend)
        calls.clear()
        logprobs = model.get_logprobs(out.tokens)
        model.prepare_for_training_step()
        loss, _ = model.get_loss_and_metrics(batch, forward_only=False)
        results[backend] = dict(loss=loss, grads=[p.main_grad.clone() for p in model.module.parameters()],
                                logprobs=logprobs, calls=len(calls))
    return results


@needs_native
def test_training_step_through_native_equals_torchs(mcore_single, monkeypatch):
    """A GRPO/PPO actor's loss and every main_grad (DDP's gradient buffers, filled in the GEMM) are
    the same with the linear layers on our GEMM as on torch's matmuls, and our GEMM did run."""
    monkeypatch.setattr(cpu_gemm, "large_matmuls_on_torch", lambda: False)  # training on our GEMM (not Intel)
    results = _actor_step_per_backend(monkeypatch, cpu_gemm.NativeLinear, ("plain", "native"))
    plain, native = results["plain"], results["native"]
    assert plain["calls"] == 0 and native["calls"] > 0
    assert native["loss"] == pytest.approx(plain["loss"], rel=1e-5)
    assert sum(float(g.abs().sum()) for g in native["grads"]) > 0
    for a, b in zip(plain["grads"], native["grads"]):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-6)


@needs_native
def test_native_linear_output_can_be_modified_in_place():
    """Layers add the residual into a linear layer's output in place; autograd refuses that for a
    custom function's output that is a view."""
    x, weight = torch.randn(4, 2, 8, requires_grad=True), torch.randn(6, 8, requires_grad=True)
    out = cpu_gemm.NativeLinear.apply(x, weight, None, None)
    out.add_(1.0).sum().backward()
    assert torch.allclose(weight.grad, x.detach().reshape(-1, 8).sum(0).expand(6, 8), atol=1e-5)


needs_onednn = pytest.mark.skipif(not cpu_gemm.available("onednn") or torch.cuda.is_available(),
                                  reason="this torch build has no oneDNN packed GEMM (or a GPU holds the model)")


def _bf16_linear_errors(function, x, weight, bias, grad):
    """Output, input, weight and bias gradients of ``function`` (an autograd linear) on bf16 tensors,
    each as its largest distance from float64."""
    out = function(x, weight, bias)
    out.backward(grad)
    ours = (out.detach(), x.grad, weight.grad, bias.grad)
    for t in (x, weight, bias):
        t.grad = None
    exact = _float64_linear(x, weight, bias, grad)
    return [(a.double() - e.detach()).abs().max().item() for a, e in zip(ours, exact)], ours


@needs_onednn
@pytest.mark.parametrize("out_features", [24, 640])
def test_onednn_linear_forward_and_gradients_against_float64(out_features):
    """bf16 OneDNNLinear (packed weights, forward and input gradient): output and every gradient of a
    strided [S, B, K] input as close to float64 as torch's own bf16 linear layer (same bf16 inputs)."""
    torch.manual_seed(7)
    x = torch.randn(3, 13, 40).transpose(0, 1).bfloat16().requires_grad_()  # [13, 3, 40], not contiguous
    weight = torch.randn(out_features, 40).bfloat16().requires_grad_()
    bias = torch.randn(out_features).bfloat16().requires_grad_()
    grad = torch.randn(13, 3, out_features).bfloat16()
    ours, values = _bf16_linear_errors(lambda *a: cpu_gemm.OneDNNLinear.apply(*a, None), x, weight, bias, grad)
    torchs, _ = _bf16_linear_errors(F.linear, x, weight, bias, grad)
    assert all(v.dtype == torch.bfloat16 for v in values)
    for name, a, r in zip(("output", "input grad", "weight grad", "bias grad"), ours, torchs):
        # one bf16 rounding of the result either way: within two of torch's own error
        assert a <= 2 * r + 1e-3, (name, a, r)
        assert a > 0 or r == 0, name


@needs_onednn
def test_onednn_linear_adds_the_weight_gradient_into_main_grad():
    """With a float32 ``main_grad`` the bf16 weight gradient is added into it; a parameter with
    ``grad_added_to_main_grad`` gets a dummy bf16 gradient (zeros with ``zero_out_wgrad``)."""
    torch.manual_seed(8)
    x = torch.randn(37, 40).bfloat16().requires_grad_()
    grad = torch.randn(37, 24).bfloat16()
    weight = torch.randn(24, 40).bfloat16().requires_grad_()
    before = torch.randn(24, 40)
    weight.main_grad = before.clone()
    weight.grad_added_to_main_grad, weight.zero_out_wgrad = False, True
    cpu_gemm.OneDNNLinear.apply(x, weight, None, weight.main_grad).backward(grad)
    expected = before.double() + grad.double().t() @ x.detach().double()
    assert torch.allclose(weight.main_grad.double(), expected, atol=0.3)  # the bf16 gradient's rounding
    assert not torch.allclose(weight.main_grad, before, atol=0.3)
    assert weight.grad_added_to_main_grad is True
    assert weight.grad.dtype == torch.bfloat16 and torch.equal(weight.grad, torch.zeros(24, 40, dtype=torch.bfloat16))
    exact_input_grad = grad.double() @ weight.detach().double()
    assert torch.allclose(x.grad.double(), exact_input_grad, rtol=1e-2, atol=0.1)


@needs_onednn
def test_weight_layouts_are_kept_only_while_weights_are_unchanged():
    """Inside ``weights_unchanged`` a weight is laid out once (and its transpose once); outside, each
    call lays it out afresh, so a weight changed through ``.data`` (which no version counter sees,
    as optimizers write it) is used as it is now. The kept layouts go on exit."""
    torch.manual_seed(9)
    weight = torch.randn(16, 8).bfloat16()
    x = torch.randn(4, 8).bfloat16()
    with cpu_gemm.weights_unchanged():
        first = cpu_gemm._onednn_pack(weight, 4, transposed=False)
        with cpu_gemm.weights_unchanged():  # nested: the same store
            assert cpu_gemm._onednn_pack(weight, 4, transposed=False) is first
        assert cpu_gemm._onednn_pack(weight, 4, transposed=True) is not first
        assert cpu_gemm._onednn_pack(weight.clone(), 4, transposed=False) is not first  # another tensor
        assert cpu_gemm._onednn_pack(weight, 4, transposed=False) is first
        with torch.no_grad():  # an in-place change autograd sees (a swap through the state dict)
            weight.copy_(weight * 2)
        assert cpu_gemm._onednn_pack(weight, 4, transposed=False) is not first
    assert cpu_gemm._KEPT.packs is None
    assert cpu_gemm._onednn_pack(weight, 4, transposed=False) is not cpu_gemm._onednn_pack(weight, 4, transposed=False)
    before = cpu_gemm.OneDNNLinear.apply(x, weight, None, None)
    weight.data.copy_(torch.randn(16, 8).bfloat16())
    after = cpu_gemm.OneDNNLinear.apply(x, weight, None, None)
    exact = x.double() @ weight.double().t()
    assert (after.double() - exact).abs().max() < 0.05 * exact.abs().max()
    assert not torch.allclose(before, after)


@needs_onednn
def test_megatron_linear_calls_go_to_onednn_for_bf16_where_chosen(monkeypatch):
    """bf16 CPU calls run on oneDNN's packed weights where that is the choice for bf16; mixed dtypes,
    autocast and a choice of plain matmuls go to megatron-core's function."""
    seen = []

    def original(input, weight, *args, **kwargs):
        seen.append(input.dtype)

    linear = cpu_gemm.native_linear_or(original)
    torch.manual_seed(10)
    x, weight, bias = (torch.randn(5, 2, 16).bfloat16(), torch.randn(8, 16).bfloat16(), torch.randn(8).bfloat16())
    applied = []
    apply = cpu_gemm.OneDNNLinear.apply
    monkeypatch.setattr(cpu_gemm.OneDNNLinear, "apply", lambda *a: applied.append(1) or apply(*a))
    monkeypatch.setattr(cpu_gemm, "_TRAINING_CHOICE", {})
    monkeypatch.setenv(cpu_gemm.ENV_VAR, "onednn")
    out = linear(x, weight, bias=bias, gradient_accumulation_fusion=False)
    assert applied == [1] and seen == []
    assert torch.allclose(out.float(), F.linear(x, weight, bias).float(), atol=0.1)
    linear(x, weight, bias=bias.float())
    linear(x.float(), weight)  # mixed dtypes
    with torch.autocast("cpu", dtype=torch.bfloat16):
        linear(x, weight)
    assert applied == [1] and len(seen) == 3
    monkeypatch.setenv(cpu_gemm.ENV_VAR, "plain")
    linear(x, weight)
    assert applied == [1] and len(seen) == 4


@needs_onednn
def test_bf16_training_step_through_onednn_equals_torchs(mcore_single, monkeypatch):
    """A bf16 GRPO/PPO actor's loss, every main_grad and its log-probs are the same (to bf16 rounding)
    with the linear layers on oneDNN's packed weights as on torch's matmuls, and they did run there."""
    results = _actor_step_per_backend(monkeypatch, cpu_gemm.OneDNNLinear, ("plain", "onednn"), precision="bf16")
    plain, onednn = results["plain"], results["onednn"]
    assert plain["calls"] == 0 and onednn["calls"] > 0
    assert onednn["loss"] == pytest.approx(plain["loss"], rel=2e-2, abs=1e-3)
    torch.testing.assert_close(onednn["logprobs"], plain["logprobs"], rtol=0, atol=0.1)
    total = sum(float(g.abs().sum()) for g in plain["grads"])
    assert total > 0
    difference = sum(float((a - b).abs().sum()) for a, b in zip(plain["grads"], onednn["grads"]))
    assert difference <= 0.05 * total
