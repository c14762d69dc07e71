"""The local spec's lean RoPE, SwiGLU and RMSNorm equal megatron-core's and torch's own (values and gradients)."""

import pytest
import torch

from nemo_aligner.models.nlp.gpt import lean_ops
from nemo_aligner.utils.patches import rope


def _reference_rope(t, freqs, mscale):
    cos, sin = torch.cos(freqs) * mscale, torch.sin(freqs) * mscale
    rot = freqs.shape[-1]
    x, rest = t[..., :rot], t[..., rot:]
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x * cos + torch.cat((-x2, x1), dim=-1) * sin, rest), dim=-1)


@pytest.mark.stack
def test_rope_matches_megatron_core_values_and_gradients():
    from megatron.core.models.common.embeddings import rope_utils

    rope.install(lean_ops.apply_rotary)
    original = rope.original()  # megatron-core's own implementation, kept by install()
    assert original is not None and rope_utils._apply_rotary_pos_emb_bshd is rope._apply_rotary_pos_emb_bshd
    torch.manual_seed(0)
    for rot, mscale in [(64, 1.0), (32, 0.7)]:  # full and partial rotation, YaRN-style scale
        t = torch.randn(12, 3, 4, 64, dtype=torch.float64, requires_grad=True)
        half = torch.randn(12, 1, 1, rot // 2, dtype=torch.float64)
        freqs = torch.cat((half, half), dim=-1)
        ours = lean_ops.apply_rotary(t, freqs, mscale)
        for ref in (original(t, freqs, mscale=mscale), _reference_rope(t, freqs, mscale)):
            grad = torch.randn_like(ref)
            g_ours, = torch.autograd.grad(ours, t, grad, retain_graph=True)
            g_ref, = torch.autograd.grad(ref, t, grad)
            torch.testing.assert_close(ours, ref, rtol=0, atol=1e-12)
            torch.testing.assert_close(g_ours, g_ref, rtol=0, atol=1e-12)


def test_rope_leaves_interleaved_to_megatron_core():
    torch.manual_seed(1)
    t = torch.randn(4, 2, 2, 8, dtype=torch.float64)
    freqs = torch.randn(4, 1, 1, 8, dtype=torch.float64)
    rope.install(lean_ops.apply_rotary)
    out = rope._apply_rotary_pos_emb_bshd(t, freqs, rotary_interleaved=True)
    torch.testing.assert_close(out, rope.original()(t, freqs, rotary_interleaved=True))


def test_swiglu_matches_chunked_silu_and_passes_gradcheck():
    torch.manual_seed(2)
    x = torch.randn(6, 2, 10, dtype=torch.float64, requires_grad=True)
    gate, up = x.chunk(2, dim=-1)
    ref = torch.nn.functional.silu(gate) * up
    ours = lean_ops.SwiGLU()(x)
    torch.testing.assert_close(ours, ref)
    assert torch.autograd.gradcheck(lean_ops.SwiGLU(), (x,))
    assert lean_ops.SwiGLU().sharded_state_dict("mlp.") == {}


def test_rmsnorm_matches_torch_values_and_gradients():
    torch.manual_seed(3)
    for eps in (1e-5, None):
        ref = torch.nn.RMSNorm(48, eps=eps)
        with torch.no_grad():
            ref.weight.uniform_(0.5, 1.5)
        ours = torch.nn.RMSNorm(48, eps=eps)
        ours.load_state_dict(ref.state_dict())
        lean_ops.use_lean_norms(ours)
        assert type(ours) is lean_ops.RMSNorm and ours.state_dict().keys() == ref.state_dict().keys()
        x = (torch.randn(7, 3, 48) * 3).requires_grad_()
        y_ref, y = ref(x), ours(x)
        grad = torch.randn_like(y)
        gx_ref, gw_ref = torch.autograd.grad(y_ref, (x, ref.weight), grad)
        gx, gw = torch.autograd.grad(y, (x, ours.weight), grad)
        torch.testing.assert_close(y, y_ref, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(gx, gx_ref, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(gw, gw_ref, rtol=1e-5, atol=1e-5)
    # float64 and no-grad calls take torch's own path; the function passes gradcheck in float64.
    x = torch.randn(5, 6, dtype=torch.float64, requires_grad=True)
    w = torch.rand(6, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda a, b: lean_ops._RMSNormFunction.apply(a, b, 1e-6), (x, w))


def test_rope_tables_are_reused_only_for_the_same_unmodified_angles():
    """Each layer gets the same angles in a forward: their cos/sin are computed once, and again
    when the tensor changes in place or is another one. Angles made under inference mode (the
    decode loop's, cached by megatron-core's RotaryEmbedding) have no version counter: computed
    every time, never an error."""
    freqs = torch.randn(6, 1, 1, 8)
    cos, sin = lean_ops._halves(freqs, 1.0, torch.float32)
    again = lean_ops._halves(freqs, 1.0, torch.float32)
    assert again[0] is cos and again[1] is sin
    torch.testing.assert_close(cos, torch.cos(freqs[..., :4]))
    freqs.mul_(2.0)
    cos2, _ = lean_ops._halves(freqs, 1.0, torch.float32)
    assert cos2 is not cos
    torch.testing.assert_close(cos2, torch.cos(freqs[..., :4]))
    assert lean_ops._halves(freqs.clone(), 1.0, torch.float32)[0] is not cos2
    assert lean_ops._halves(freqs, 0.5, torch.float32)[0] is not cos2  # mscale is part of the key
    with torch.inference_mode():
        frozen = torch.randn(6, 1, 1, 8)
    first, _ = lean_ops._halves(frozen, 1.0, torch.float32)
    second, _ = lean_ops._halves(frozen, 1.0, torch.float32)
    torch.testing.assert_close(first, torch.cos(frozen[..., :4]))
    torch.testing.assert_close(second, first)
