"""Kept CPU decode buffers (``utils.decode_buffers``): a model's packed weights and KV cache are
reused by its next ``generate`` call, which gives the same tokens as fresh buffers, sees weights
updated in between, and never reads what an earlier call left in the cache."""

import sys

import pytest
import torch

from conftest import TINY_ARCH, TINY_GPT2_ARCH
from nemo_aligner.models.nlp.gpt.generation import KVCacheDecoder, LengthParams, SamplingParams, generate
from nemo_aligner.utils import cpu_gemm, cpu_kernels, decode_buffers
from nemo_aligner.utils.errors import ConfigError
from test_cpu_bf16 import bf16_decode_model
from test_generation import PROMPTS, build

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="CPU decode buffers: a visible GPU holds the model")


@pytest.fixture(scope="module")
def ext():
    module = cpu_kernels.load()
    if module is None:
        pytest.skip("the CPU kernels did not build here (no C++ compiler?)")
    return module


@pytest.fixture
def native(monkeypatch, ext):
    """Our packed float32 GEMM for the decode matmuls (the packs kept buffers hold)."""
    if not cpu_gemm.available("native"):
        pytest.skip("our packed GEMM has no kernel in this build")
    monkeypatch.setenv(cpu_gemm.ENV_VAR, "native")


def _generate(model, texts=PROMPTS, new_tokens=6):
    tok = model.tokenizer
    prompts = [tok.text_to_ids(t) for t in texts]
    return generate(model.module, tok, prompts, SamplingParams(use_greedy=True),
                    LengthParams(max_length=new_tokens, min_length=new_tokens)).tokens


def _kept(model) -> decode_buffers.DecodeBuffers:
    return decode_buffers._KEPT[model.module]


def _pointers(buffers):
    return {key: p.data_ptr() for key, p in buffers._packs.items()}, buffers._cache.data_ptr()


@pytest.mark.parametrize("arch", [TINY_ARCH, TINY_GPT2_ARCH], ids=["fused-step", "python-step"])
def test_kept_buffers_are_reused_and_give_fresh_buffers_tokens(mcore_single, native, monkeypatch, arch):
    model = build(arch, seed=3)
    monkeypatch.setenv(decode_buffers.ENV_VAR, "free")
    fresh = _generate(model)
    assert model.module not in decode_buffers._KEPT
    monkeypatch.setenv(decode_buffers.ENV_VAR, "keep")
    first = _generate(model)
    buffers = _kept(model)
    assert not buffers.in_use and len(buffers._packs) == 4 * arch["num_layers"] + 1  # + the output layer
    packs, cache = _pointers(buffers)
    # what a previous call leaves in the cache must never be read (a call writes each slot before
    # it reads it, padding slots included; a stale NaN would survive even a masked product)
    buffers._cache.view(torch.float32).fill_(float("nan"))
    second = _generate(model)
    assert torch.equal(fresh, first) and torch.equal(fresh, second)
    assert _pointers(buffers) == (packs, cache)  # the same memory
    assert buffers.held_bytes() > 0


@pytest.mark.parametrize("backend", ["amx", "native", "onednn"])
def test_bf16_kept_buffers(mcore_single, monkeypatch, backend):
    """A bf16 model's packs (our AMX or AVX512_BF16 GEMM; oneDNN's are not kept) and bf16 cache."""
    model = bf16_decode_model(monkeypatch, backend, seed=8)
    monkeypatch.setenv(decode_buffers.ENV_VAR, "free")
    fresh = _generate(model)
    monkeypatch.setenv(decode_buffers.ENV_VAR, "keep")
    _generate(model)
    buffers = _kept(model)
    assert len(buffers._packs) == (0 if backend == "onednn" else 4 * TINY_ARCH["num_layers"] + 1)
    pointers = _pointers(buffers)
    buffers._cache.view(torch.bfloat16).fill_(float("nan"))
    assert torch.equal(_generate(model), fresh) and _pointers(buffers) == pointers


def test_weights_updated_between_calls_are_used(mcore_single, native, monkeypatch):
    model = build(TINY_ARCH, seed=4)
    before = _generate(model)
    with torch.no_grad():  # as an optimizer step between rollouts: the same tensors, new values
        for param in model.module.parameters():
            param.mul_(1.5).add_(0.01)
    after = _generate(model)
    monkeypatch.setenv(decode_buffers.ENV_VAR, "free")
    assert torch.equal(after, _generate(model))
    assert not torch.equal(after, before)


def test_a_larger_call_grows_the_cache_and_a_smaller_one_reuses_it(mcore_single, native, monkeypatch):
    model = build(TINY_ARCH, seed=5)
    short = _generate(model, PROMPTS[:2], new_tokens=3)
    small = _kept(model)._cache.numel()
    long = _generate(model, PROMPTS, new_tokens=8)
    grown = _kept(model)._cache
    assert grown.numel() > small
    again = _generate(model, PROMPTS[:2], new_tokens=3)
    assert _kept(model)._cache.data_ptr() == grown.data_ptr()
    monkeypatch.setenv(decode_buffers.ENV_VAR, "free")
    assert torch.equal(short, again) and torch.equal(long, _generate(model, PROMPTS, new_tokens=8))


def test_a_second_live_decoder_gets_its_own_buffers(mcore_single, native):
    model = build(TINY_ARCH, seed=6)
    held = KVCacheDecoder(model.module, 2, 8)
    assert held.buffers.kept and held.buffers.in_use
    other = KVCacheDecoder(model.module, 2, 8)
    assert not other.buffers.kept
    assert all(held.packed[k].data_ptr() != other.packed[k].data_ptr() for k in held.packed)
    assert held.cache.data_ptr() != other.cache.data_ptr()
    held.close()
    assert not _kept(model).in_use
    third = KVCacheDecoder(model.module, 2, 8)
    assert third.buffers is _kept(model)
    del third  # collected without close(): the buffers are given back all the same
    assert not _kept(model).in_use


def test_release_returns_the_buffers(mcore_single, native):
    model = build(TINY_ARCH, seed=7)
    _generate(model)
    held = _kept(model).held_bytes()
    assert held > 0 and decode_buffers.release(model.module) == held
    assert model.module not in decode_buffers._KEPT and decode_buffers.release(model.module) == 0


def test_free_and_bad_values(monkeypatch):
    monkeypatch.setenv(decode_buffers.ENV_VAR, "free")
    assert not decode_buffers.acquire(torch.nn.Linear(2, 2), torch.device("cpu")).kept
    monkeypatch.setenv(decode_buffers.ENV_VAR, "Keep ")
    assert decode_buffers.keep_requested()
    monkeypatch.setenv(decode_buffers.ENV_VAR, "always")
    with pytest.raises(ConfigError, match="NEMO_ALIGNER_DECODE_BUFFERS='always': expected keep or free"):
        decode_buffers.acquire(torch.nn.Linear(2, 2), torch.device("cpu"))


def _rss_bytes() -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int32])
def test_huge_page_zeros(ext, dtype):
    """Zero-filled tensors of the asked shape and dtype; from one 2 MiB page up, on memory aligned
    to 2 MiB (Linux: where madvise can give it huge pages), returned to the system when freed;
    smaller ones are ordinary tensors."""
    big = ext.huge_page_zeros([3, 1024, 700], dtype)
    assert big.shape == (3, 1024, 700) and big.dtype == dtype and big.is_contiguous()
    assert not big.any()
    big.fill_(3)
    assert bool((big == 3).all())
    small = ext.huge_page_zeros([5, 7], dtype)
    assert small.shape == (5, 7) and not small.any()
    assert ext.huge_page_zeros([0, 4], dtype).shape == (0, 4)
    if sys.platform.startswith("linux"):
        assert big.data_ptr() % (2 << 20) == 0
        del big
        before = _rss_bytes()
        for _ in range(40):  # 40 x 8 MiB touched and freed: a leak would keep ~320 MiB
            ext.huge_page_zeros([8 << 20], torch.uint8).fill_(1)
        assert _rss_bytes() - before < 64 << 20


def _packers(ext):
    packers = [("float32", lambda w, **kw: ext.pack_linear(w, **kw), torch.float32)]
    if ext.has_bf16_gemm():
        packers.append(("bf16", lambda w, **kw: ext.pack_linear(w, **kw), torch.bfloat16))
    if ext.has_amx():
        packers.append(("amx", lambda w, **kw: ext.amx_pack(w, **kw), torch.bfloat16))
    return packers


def test_packs_into_reused_or_huge_page_memory_equal_fresh_ones(ext):
    torch.manual_seed(3)
    for name, pack, dtype in _packers(ext):
        weight, other = torch.randn(1400, 768).to(dtype), torch.randn(1400, 768).to(dtype)  # packs > 2 MiB
        fresh = pack(weight)
        huge = pack(weight, huge_pages=True)
        assert torch.equal(huge, fresh), name
        if sys.platform.startswith("linux"):
            assert huge.data_ptr() % (2 << 20) == 0, name
        reused = pack(other, reuse=huge)
        assert reused.data_ptr() == huge.data_ptr() and torch.equal(reused, pack(other)), name
        # another shape (or dtype) cannot reuse it: fresh memory, the old pack untouched
        smaller = pack(other[:, :512].contiguous(), reuse=reused)
        assert smaller.data_ptr() != reused.data_ptr() and torch.equal(smaller, pack(other[:, :512].contiguous())), name
        assert torch.equal(reused, pack(other)), name


@pytest.mark.parametrize("arch", [TINY_ARCH, TINY_GPT2_ARCH], ids=["fused-step", "python-step"])
def test_kept_buffers_work_in_and_out_of_inference_mode(mcore_single, native, arch):
    """generate runs in inference mode; a decoder built and run outside it reuses the same buffers."""
    model = build(arch, seed=9)
    _generate(model)
    pointers = _pointers(_kept(model))
    decoder = KVCacheDecoder(model.module, 2, 8)
    tokens = torch.tensor([[5, 6, 7, 8]] * 2)
    positions, key_mask = torch.arange(4).expand(2, 4), torch.ones(2, 8, dtype=torch.bool)
    with torch.no_grad():
        decoder.forward(tokens, positions, 0, key_mask)
        logits = decoder.forward(tokens[:, :1], positions[:, :1] + 4, 4, key_mask)
    assert torch.isfinite(logits).all() and _pointers(_kept(model)) == pointers
    decoder.close()
    _generate(model)
