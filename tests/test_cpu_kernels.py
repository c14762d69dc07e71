"""The fused CPU kernels (nemo_aligner/csrc/cpu_kernels.cpp) against torch: each kernel on its own
(odd widths hit the scalar tails), a whole decode step against the Python step, generate() and the
training ops with and without them; the build's fallback and errors."""

import logging
import os
import signal
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from conftest import TINY_ARCH
from nemo_aligner.utils import cpu_kernels
from nemo_aligner.utils.errors import ConfigError
from nemo_aligner.models.nlp.gpt.generation import KVCacheDecoder, LengthParams, SamplingParams, _rotate_in_place, generate
from test_generation import PROMPTS, build


@pytest.fixture(scope="module")
def ext():
    module = cpu_kernels.load()
    # Every dev and CI machine has a compiler: a build failure here is a failure, not a skip.
    assert module is not None, "the fused CPU decode kernels did not build"
    return module


@pytest.mark.parametrize("width", [64, 37])
def test_add_rms_norm(ext, width):
    torch.manual_seed(0)
    x, residual, weight = torch.randn(5, width) * 3, torch.randn(5, width), torch.rand(width) + 0.5
    expected_sum = (x.double() + residual.double())
    expected = expected_sum * torch.rsqrt(expected_sum.pow(2).mean(-1, keepdim=True) + 1e-5) * weight.double()
    out = ext.add_rms_norm(x, residual, weight, 1e-5)
    assert torch.allclose(x.double(), expected_sum, atol=1e-6)  # the residual was added in place
    assert torch.allclose(out.double(), expected, rtol=1e-6, atol=1e-6)
    before = x.clone()
    plain = ext.add_rms_norm(x, None, weight, 1e-5)
    assert torch.equal(x, before)  # no residual: x untouched
    assert torch.allclose(plain, F.rms_norm(x, (width,), weight, 1e-5), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("width", [1024, 45])
def test_swiglu(ext, width):
    torch.manual_seed(1)
    x = torch.randn(7, 2 * width) * 10  # large gates: exp saturates on both sides
    x[0, :4] = torch.tensor([-200.0, 200.0, 0.0, -90.0])
    gate, up = x.chunk(2, dim=-1)
    assert torch.allclose(ext.swiglu(x), F.silu(gate) * up, rtol=2e-6, atol=1e-6)


@pytest.mark.parametrize("rows,width", [(300, 512), (5, 45)])  # two row blocks / odd widths (scalar tails)
def test_swiglu_backward(ext, rows, width):
    torch.manual_seed(8)
    x = (torch.randn(rows, 2 * width) * 4).requires_grad_()
    grad = torch.randn(rows, width)
    gate, up = x.chunk(2, dim=-1)
    (F.silu(gate) * up).backward(grad)
    assert torch.allclose(ext.swiglu_backward(grad, x.detach()), x.grad, rtol=1e-5, atol=2e-6)


@pytest.mark.parametrize("rows,width", [(300, 256), (7, 37)])
def test_rms_norm_forward_and_backward(ext, rows, width):
    torch.manual_seed(9)
    x = (torch.randn(rows, width) * 2).requires_grad_()
    weight = (torch.rand(width) + 0.5).requires_grad_()
    grad = torch.randn(rows, width)
    F.rms_norm(x, (width,), weight, 1e-6).backward(grad)
    out, rstd = ext.rms_norm_forward(x.detach(), weight.detach(), 1e-6)
    assert torch.allclose(out, F.rms_norm(x.detach(), (width,), weight.detach(), 1e-6), rtol=1e-5, atol=1e-6)
    grad_x, grad_weight = ext.rms_norm_backward(grad, x.detach(), weight.detach(), rstd)
    assert torch.allclose(grad_x, x.grad, rtol=1e-5, atol=1e-5)
    assert torch.allclose(grad_weight, weight.grad, rtol=1e-5, atol=1e-4)


def test_training_ops_equal_with_and_without_the_kernels(ext, monkeypatch):
    """lean_ops' SwiGLU and RMSNorm (the training forward's) give the same values and gradients
    through the kernels (float32 CPU) as through torch's ops."""
    from nemo_aligner.models.nlp.gpt import lean_ops

    torch.manual_seed(10)
    x0, h0, w0 = torch.randn(16, 3, 96), torch.randn(16, 3, 48), torch.rand(48) + 0.5
    g_mlp, g_norm = torch.randn(16, 3, 48), torch.randn(16, 3, 48)
    results = {}
    for mode in ("off", "on"):
        monkeypatch.setenv(cpu_kernels.ENV_VAR, mode)
        x, h = x0.clone().requires_grad_(), h0.clone().requires_grad_()
        norm = lean_ops.RMSNorm(48, eps=1e-5)
        norm.weight = torch.nn.Parameter(w0.clone())
        mlp_out, norm_out = lean_ops.SwiGLU()(x), norm(h)
        (mlp_out * g_mlp).sum().add_((norm_out * g_norm).sum()).backward()
        results[mode] = (mlp_out.detach(), norm_out.detach(), x.grad, h.grad, norm.weight.grad)
    for off, on in zip(results["off"], results["on"]):
        assert torch.allclose(off, on, rtol=1e-5, atol=1e-5)


def _layout(batch, groups, per_group, d, length, seed=2):
    g = torch.Generator().manual_seed(seed)
    qkv = torch.randn(batch, groups * (per_group + 2) * d, generator=g)
    cache = torch.randn(batch, groups, 2, length, d, generator=g)
    return qkv, cache


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("per_group,d,rot", [(2, 16, 16), (1, 12, 6), (3, 8, 0)],
                         ids=["gqa", "odd_head_partial_rotary", "no_rope"])
def test_rope_cache_write(ext, per_group, d, rot, cache_dtype):
    """The rotated key and the value land in the slot (a bf16 cache: each rounded once to nearest);
    every other slot is untouched."""
    batch, groups, length, slot = 3, 2, 9, 5
    qkv, cache = _layout(batch, groups, per_group, d, length)
    cache = cache.to(cache_dtype)
    positions = torch.tensor([5, 2, 0])
    table = None
    if rot:
        angles = torch.rand(12, rot // 2) * 6
        table = torch.cat((angles.cos(), angles.sin()), dim=-1)
    expected_qkv = qkv.clone().view(batch, groups, per_group + 2, d)
    if table is not None:
        cos, sin = table[positions, : rot // 2], table[positions, rot // 2 :]
        _rotate_in_place(expected_qkv[:, :, : per_group + 1], cos[:, None, None], sin[:, None, None])
    expected_cache = cache.clone()
    expected_cache[:, :, :, slot] = expected_qkv[:, :, per_group:].to(cache_dtype)
    ext.rope_cache_write(qkv, table, positions, cache, slot, groups, per_group)
    assert torch.allclose(qkv.view_as(expected_qkv), expected_qkv, atol=1e-6)
    others = torch.arange(length) != slot
    assert torch.equal(cache[:, :, :, others], expected_cache[:, :, :, others])
    written, exact = cache[:, :, :, slot].double(), expected_qkv[:, :, per_group:].double()
    if cache_dtype == torch.float32:
        assert torch.allclose(written, exact, atol=1e-6)
    else:  # the float32 result rounded to bf16: within half a bf16 step (one where float32 decides a tie)
        step = torch.pow(2.0, torch.frexp(exact.abs().clamp(min=1e-30))[1] - 8).double()
        assert ((written - exact).abs() <= step * 0.5 + 1e-6).float().mean() > 0.99
        assert ((written - exact).abs() <= step + 1e-6).all()
    with pytest.raises(RuntimeError, match="slot out of range"):
        ext.rope_cache_write(qkv, table, positions, cache, length, groups, per_group)
    if table is not None:  # a position beyond the table (the second row's): refused before any row is changed
        before_qkv, before_cache = qkv.clone(), cache.clone()
        with pytest.raises(RuntimeError, match="out of the RoPE table"):
            ext.rope_cache_write(qkv, table, torch.tensor([5, 12, 0]), cache, slot + 1, groups, per_group)
        assert torch.equal(qkv, before_qkv) and torch.equal(cache, before_cache)


def test_bf16_stores_round_like_torch(ext):
    """The kernels' float32 -> bf16 stores (vector and scalar tails; one instruction where the CPU has
    AVX512_BF16) give torch's bf16 bits: ties to even, just off a tie, the largest float32 (to
    infinity), infinities, signed zeros; a NaN stays a NaN; a float32 denormal gives torch's bits or
    (the one-instruction conversion) a zero of its sign."""
    tie = 2.0 ** -8  # half of bf16's step at 1
    special = [1 + tie, 1 + 3 * tie, 1 + tie * (1 + 2 ** -15), 1 + tie * (1 - 2 ** -15), -(1 + tie), -(1 + 3 * tie),
               3.4028234663852886e38, -3.4028234663852886e38, float("inf"), float("-inf"), 0.0, -0.0,
               1.1754943508222875e-38, 65504.0, -1e-3, 0.1, 7.0, float("nan"), 1e30, -2.5]
    d = 12  # 8 values through the vector store, 4 through the scalar tail

    def stored(values):  # [rows, d] float32 written as the value head of one group (not rotated)
        rows = values.shape[0]
        qkv = torch.randn(rows, 3 * d)
        qkv.view(rows, 3, d)[:, 2] = values
        cache = torch.zeros(rows, 1, 2, 4, d, dtype=torch.bfloat16)
        ext.rope_cache_write(qkv, None, torch.zeros(rows, dtype=torch.long), cache, 1, 1, 1)
        return cache[:, 0, 1, 1]

    rows = -(-len(special) // d)
    values = torch.tensor(special + [0.5] * (rows * d - len(special)), dtype=torch.float32).view(rows, d)
    written, expected = stored(values), values.to(torch.bfloat16)
    nan = expected.isnan()
    assert torch.equal(written.isnan(), nan)
    assert torch.equal(written[~nan].view(torch.int16), expected[~nan].view(torch.int16))
    # float32 denormals: torch's bits, or a zero of their sign with the one-instruction conversion
    tiny = torch.tensor([1e-39, -2e-39] + [0.5] * (d - 2)).view(1, d)
    written, expected = stored(tiny)[0, :2], tiny[0, :2].to(torch.bfloat16)
    zero = torch.tensor([0.0, -0.0], dtype=torch.bfloat16)
    bits = lambda t: t.view(torch.int16)  # noqa: E731
    assert torch.equal(bits(written), bits(expected)) or torch.equal(bits(written), bits(zero))


# Head widths: 64 (one register block of columns), 76 (a block, 8 columns, 4 more), 12 and 16;
# 33 keys: eight groups of four and one more.
ATTENTION_SHAPES = [(2, 16, True), (1, 12, False), (4, 64, True), (1, 76, True)]


@pytest.mark.parametrize("per_group,d,masked", ATTENTION_SHAPES)
def test_decode_attention_over_a_bf16_cache(gemm_ext, per_group, d, masked):
    """A bf16 cache is read as float32: the same result as the float32 kernel over its values."""
    ext = gemm_ext
    batch, groups, length, end = 4, 2, 40, 33
    qkv, cache = _layout(batch, groups, per_group, d, length, seed=5)
    cache = cache.bfloat16()
    mask = torch.arange(length)[None, :] >= torch.tensor([0, 3, 17, 30])[:, None] if masked else None
    out = ext.decode_attention(qkv, cache, end, mask, d ** -0.5, groups, per_group)
    assert out.dtype == torch.float32
    assert torch.equal(out, ext.decode_attention(qkv, cache.float(), end, mask, d ** -0.5, groups, per_group))


@pytest.mark.parametrize("per_group,d,masked", ATTENTION_SHAPES)
def test_decode_attention_equals_sdpa(gemm_ext, per_group, d, masked):
    ext = gemm_ext
    batch, groups, length, end = 4, 2, 40, 33
    qkv, cache = _layout(batch, groups, per_group, d, length, seed=3)
    qkv *= 2  # peaked softmaxes too
    mask = None
    if masked:  # left padding of different lengths, as generate() makes
        mask = torch.arange(length)[None, :] >= torch.tensor([0, 3, 17, 30])[:, None]
    scale = d ** -0.5
    out = ext.decode_attention(qkv, cache, end, mask, scale, groups, per_group)
    q = qkv.view(batch, groups, per_group + 2, d)[:, :, :per_group].reshape(batch, groups * per_group, 1, d)
    keys, values = cache[:, :, 0, :end], cache[:, :, 1, :end]
    sdpa_mask = mask[:, None, None, :end] if mask is not None else None
    expected = F.scaled_dot_product_attention(q, keys, values, attn_mask=sdpa_mask, scale=scale,
                                              enable_gqa=per_group > 1)
    assert torch.allclose(out, expected.reshape(batch, -1), atol=2e-6, rtol=1e-5)


@pytest.fixture(scope="module", params=["this CPU's", "AVX2"])
def gemm_ext(request, ext):
    """The kernels as built for this CPU, and (where that build is AVX-512's) the AVX2 build that
    CPUs without AVX-512 get: both packed GEMMs and both decode attentions are tested on an AVX-512
    machine."""
    if request.param == "AVX2":
        flags = cpu_kernels.compile_flags()
        if "-mavx512f" not in flags:
            pytest.skip("this CPU's build is the AVX2 one")
        flags = [f for f in flags if not f.startswith("-mavx512")]  # the bf16 ones imply AVX-512F
        return cpu_kernels._build_or_import(cpu_kernels._build_name(flags), flags)
    return ext


def test_bf16_store_flags_only_where_the_cpu_and_the_compiler_have_them(monkeypatch):
    """AVX512_BF16 conversions are compiled in where /proc/cpuinfo lists them and the C++ compiler
    takes their flags; an older compiler gets the other flags (no failed build)."""
    monkeypatch.setattr(cpu_kernels.platform, "machine", lambda: "x86_64")
    cpu = "fma avx2 avx512f avx512vl avx512_bf16"
    monkeypatch.setattr(cpu_kernels, "cpuinfo", lambda field: cpu)
    monkeypatch.setenv("CXX", "true")  # a compiler that takes anything
    assert cpu_kernels.compile_flags()[-2:] == ["-mavx512vl", "-mavx512bf16"]
    monkeypatch.setenv("CXX", "false")  # one that refuses the flags
    assert cpu_kernels.compile_flags() == ["-O3", "-fopenmp", "-mavx2", "-mfma", "-mavx512f"]
    monkeypatch.setenv("CXX", "/nonexistent/c++")
    assert "-mavx512bf16" not in cpu_kernels.compile_flags()
    monkeypatch.setenv("CXX", "true")
    cpu = "fma avx2 avx512f avx512vl"  # no bf16 conversions on this CPU
    assert cpu_kernels.compile_flags() == ["-O3", "-fopenmp", "-mavx2", "-mfma", "-mavx512f"]


@pytest.mark.parametrize("n,k", [(96, 64), (37, 19), (16, 1024), (400, 256)])
def test_packed_linear_against_float64(gemm_ext, n, k):
    """Every row count from 1 to two register blocks and one (6 rows with AVX2, 12 with AVX-512,
    and each remainder), columns not a multiple of the panel (16 or 32 columns), with and without
    bias: as close to a float64 product as F.linear is."""
    assert gemm_ext.has_packed_linear()
    block, panel = gemm_ext.packed_gemm_tile()
    assert (block, panel) in ((6, 16), (12, 32))
    torch.manual_seed(11)
    weight, bias = torch.randn(n, k), torch.randn(n)
    packed = gemm_ext.pack_linear(weight)
    assert packed.shape == ((n + panel - 1) // panel, k, panel)
    for rows in range(1, 2 * block + 2):
        x = torch.randn(rows, k)
        for b in (None, bias):
            exact = F.linear(x.double(), weight.double(), b.double() if b is not None else None)
            ours = gemm_ext.packed_linear(x, packed, n, b)
            reference_error = (F.linear(x, weight, b).double() - exact).abs().max()
            assert (ours.double() - exact).abs().max() <= 4 * reference_error + 1e-6, (rows, b is None)
    with pytest.raises(RuntimeError, match="does not match"):
        gemm_ext.packed_linear(torch.randn(2, k + 1), packed, n, None)


@pytest.mark.parametrize("rows,k,n", [(1, 5, 3), (200, 300, 33), (385, 257, 40), (7, 130, 17)])
def test_packed_gemm_variants_against_float64(gemm_ext, rows, k, n):
    """The training GEMM's three products, with row counts over several 192-row blocks (and a
    remainder), k over several 128-step chunks (and a part-chunk), n not a multiple of the panel:
    x @ weight^T + bias (pack_linear), x @ b (pack_matrix), and out += x_t^T @ b with x_t given
    transposed ([k, rows], read in place), as close to float64 as torch's float32 products."""
    torch.manual_seed(5)
    x, weight, b, bias = torch.randn(rows, k), torch.randn(n, k), torch.randn(k, n), torch.randn(n)
    out = torch.randn(rows, n)

    def check(ours, exact, reference):
        assert ours.shape == exact.shape
        assert (ours.double() - exact).abs().max() <= 4 * (reference.double() - exact).abs().max() + 1e-6

    check(gemm_ext.packed_gemm(x, False, gemm_ext.pack_linear(weight), n, bias, None),
          F.linear(x.double(), weight.double(), bias.double()), F.linear(x, weight, bias))
    check(gemm_ext.packed_gemm(x.view(1, rows, k), False, gemm_ext.pack_matrix(b), n, None, None)[0],
          x.double() @ b.double(), x @ b)
    expected, reference = out.double() + x.double() @ b.double(), out + x @ b
    x_t = x.t().contiguous()
    result = gemm_ext.packed_gemm(x_t, True, gemm_ext.pack_matrix(b), n, None, out)
    assert result.data_ptr() == out.data_ptr()  # added into `out`, no new tensor
    check(out, expected, reference)
    with pytest.raises(RuntimeError, match="out"):
        gemm_ext.packed_gemm(x, False, gemm_ext.pack_matrix(b), n, None, torch.zeros(rows, n + 1))
    with pytest.raises(RuntimeError, match="does not match"):
        gemm_ext.packed_gemm(x_t, False, gemm_ext.pack_matrix(b), n, None, None)


def test_kernels_refuse_bad_shapes(ext):
    qkv, cache = _layout(2, 2, 1, 8, 6)
    with pytest.raises(RuntimeError, match="qkv width"):
        ext.decode_attention(qkv[:, :-1].contiguous(), cache, 3, None, 1.0, 2, 1)
    with pytest.raises(RuntimeError, match="float32"):
        ext.swiglu(torch.ones(2, 4, dtype=torch.float64))
    with pytest.raises(RuntimeError, match="cache: expected a float32 or bf16 CPU tensor"):
        ext.decode_attention(qkv, cache.double(), 3, None, 1.0, 2, 1)
    with pytest.raises(RuntimeError, match="qkv: expected a float32 CPU tensor"):
        ext.rope_cache_write(qkv.bfloat16(), None, torch.zeros(2, dtype=torch.long), cache, 0, 2, 1)


def _step_logits(model, decoder_fused: bool, padded_prompts):
    """Logits of a prefill and six decode steps fed the same tokens, fused or Python decode steps."""
    tok = model.tokenizer
    prompts = [tok.text_to_ids(p) for p in padded_prompts]
    longest, steps = max(map(len, prompts)), 6
    total = longest + steps
    pad = torch.tensor([longest - len(p) for p in prompts])
    tokens = torch.full((len(prompts), total), tok.eos_id)
    for b, p in enumerate(prompts):
        tokens[b, pad[b] : longest] = torch.tensor(p)
    tokens[:, longest:] = torch.randint(3, tok.vocab_size, (len(prompts), steps), generator=torch.Generator().manual_seed(4))
    slots = torch.arange(total).unsqueeze(0)
    positions, key_mask = (slots - pad[:, None]).clamp(min=0), slots >= pad[:, None]
    decoder = KVCacheDecoder(model.module, len(prompts), total)
    assert (decoder.fused is not None) or not decoder_fused
    if not decoder_fused:
        decoder.fused = None
    logits = [decoder.forward(tokens[:, :longest], positions[:, :longest], 0, key_mask)]
    for slot in range(longest, total):
        logits.append(decoder.forward(tokens[:, slot : slot + 1], positions[:, slot : slot + 1], slot, key_mask))
    return torch.stack(logits)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the fused CPU decode step: a visible GPU holds the model")
@pytest.mark.parametrize("extra", [{}, {"rotary_percentage": 0.5}, {"num_query_groups": 4},
                                   {"hidden_size": 48, "num_attention_heads": 4, "num_query_groups": 1},
                                   {"activation": "gelu"}],
                         ids=["gqa", "partial_rotary", "mha", "odd_head_dim_mqa", "gelu_not_gated"])
@pytest.mark.parametrize("texts", [PROMPTS, ["sort cba = ", "sort abc = "]], ids=["padded", "unpadded"])
def test_fused_step_equals_python_step(mcore_single, ext, extra, texts):
    model = build(dict(TINY_ARCH, **extra), seed=5)
    fused, python = _step_logits(model, True, texts), _step_logits(model, False, texts)
    assert torch.equal(fused[0], python[0])  # the prefill runs the same Python code either way
    assert torch.allclose(fused, python, atol=2e-5, rtol=1e-5), (fused - python).abs().max()


def test_fused_kernels_not_used_where_they_do_not_apply(mcore_single):
    from conftest import TINY_GPT2_ARCH

    for arch in (TINY_GPT2_ARCH, dict(TINY_ARCH, qk_layernorm=True)):  # LayerNorm; query/key norms
        model = build(arch)
        assert KVCacheDecoder(model.module, 2, 8).fused is None


@pytest.mark.parametrize("use_greedy", [True, False])
def test_generate_same_tokens_with_and_without_the_kernels(mcore_single, monkeypatch, use_greedy):
    model = build(TINY_ARCH, seed=6)
    tok = model.tokenizer
    prompts = [tok.text_to_ids(p) for p in PROMPTS]
    sampling = SamplingParams(use_greedy=use_greedy, temperature=0.7, top_k=0, top_p=0.9)
    runs = {}
    for mode in ("off", "on"):
        monkeypatch.setenv(cpu_kernels.ENV_VAR, mode)
        runs[mode] = generate(model.module, tok, prompts, sampling, LengthParams(max_length=12, min_length=2), seed=7)
    assert torch.equal(runs["on"].tokens, runs["off"].tokens)
    assert torch.equal(runs["on"].response_lengths, runs["off"].response_lengths)
    assert torch.equal(runs["on"].is_end, runs["off"].is_end)


def test_mode_values(monkeypatch):
    monkeypatch.setenv(cpu_kernels.ENV_VAR, "sometimes")
    with pytest.raises(ConfigError, match=cpu_kernels.ENV_VAR):
        cpu_kernels.load()
    monkeypatch.setenv(cpu_kernels.ENV_VAR, "off")
    assert cpu_kernels.load() is None


def test_a_failed_build_falls_back_or_is_an_error(monkeypatch, tmp_path, caplog):
    broken = tmp_path / "broken.cpp"
    broken.write_text('#error "no compiler for this"\n')
    monkeypatch.setattr(cpu_kernels, "SOURCE", str(broken))
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "extensions"))
    cpu_kernels._load.cache_clear()
    try:
        monkeypatch.setenv(cpu_kernels.ENV_VAR, "auto")
        with caplog.at_level(logging.WARNING, logger=cpu_kernels.__name__):
            assert cpu_kernels.load() is None
        assert "decoding with the Python loop" in caplog.text
        monkeypatch.setenv(cpu_kernels.ENV_VAR, "on")
        with pytest.raises(ConfigError, match="could not be built"):
            cpu_kernels.load()
        # nothing half-built is left to be imported later: only the lock file
        assert [p.endswith(".lock") for p in os.listdir(cpu_kernels.cache_root())] == [True]
    finally:
        cpu_kernels._load.cache_clear()  # the real kernels for the tests after this one


def test_a_build_lock_held_by_a_killed_process_does_not_block(ext, tmp_path):
    """A run killed while building (Ctrl-C, kill -9, a fault-injection test) holds the build lock
    only while it lives: the next run imports (or builds) at once instead of waiting forever."""
    flags = cpu_kernels.compile_flags()
    name = cpu_kernels._build_name(flags)
    lock_path = os.path.join(cpu_kernels.cache_root(), name + ".lock")
    holder = subprocess.Popen([sys.executable, "-c", (
        "import fcntl, sys, time\n"
        f"f = open({lock_path!r}, 'w'); fcntl.flock(f, fcntl.LOCK_EX); print('locked', flush=True); time.sleep(600)")],
        stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        os.kill(holder.pid, signal.SIGKILL)
        holder.wait(timeout=30)
        module = cpu_kernels._build_or_import(name, flags)
        assert module.swiglu(torch.zeros(1, 2)).shape == (1, 1)
    finally:
        if holder.poll() is None:
            holder.kill()
            holder.wait()


def test_a_build_finished_elsewhere_meanwhile_is_kept(ext, monkeypatch, tmp_path):
    """On a network file system flock may lock one node only, so another node can finish the same
    build first: its build stays, ours is used from memory, and no scratch directory is left."""
    import shutil

    from torch.utils import cpp_extension

    flags = cpu_kernels.compile_flags()
    name = cpu_kernels._build_name(flags)
    built = os.path.join(cpu_kernels.cache_root(), name, name + ".so")
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    final = os.path.join(cpu_kernels.cache_root(), name)

    def build_while_another_node_finishes(name, sources, build_directory, **kwargs):
        os.makedirs(final)
        shutil.copy(built, os.path.join(final, name + ".so"))  # the other node's build
        shutil.copy(built, os.path.join(build_directory, name + ".so"))
        return cpu_kernels._import(name, os.path.join(build_directory, name + ".so"))

    monkeypatch.setattr(cpp_extension, "load", build_while_another_node_finishes)
    module = cpu_kernels._build_or_import(name, flags)
    assert module.swiglu(torch.zeros(1, 2)).shape == (1, 1)
    assert sorted(os.listdir(cpu_kernels.cache_root())) == [name, name + ".lock"]
