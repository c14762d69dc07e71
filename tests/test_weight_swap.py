"""Swapping a second set of weights into a module: the swapped-in weights are used inside the block,
the module's own come back after it (also after an error), parameters keep their identity, the
parking buffers are allocated once, and the swap reports its times."""

import pytest
import torch

from nemo_aligner.utils.weight_swap import cpu_state_copy, swapped_weights


def test_swap_in_use_and_restore_keeps_parameters_and_parking():
    torch.manual_seed(0)
    module = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    x = torch.randn(5, 4)
    own = cpu_state_copy(module)
    before = module(x).detach()
    other = {k: torch.randn_like(v) for k, v in own.items()}
    reference = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    reference.load_state_dict(other)
    params = [id(p) for p in module.parameters()]
    seconds = {}
    with swapped_weights(module, other, seconds):
        torch.testing.assert_close(module(x), reference(x), rtol=0, atol=0)
    assert set(seconds) == {"swap_in", "swap_out"} and all(v >= 0 for v in seconds.values())
    torch.testing.assert_close(module(x).detach(), before, rtol=0, atol=0)
    assert [id(p) for p in module.parameters()] == params
    parked = module._swap_parking
    with pytest.raises(ValueError):
        with swapped_weights(module, other):
            raise ValueError("a failing forward")
    torch.testing.assert_close(module(x).detach(), before, rtol=0, atol=0)  # restored after the error
    assert module._swap_parking is parked  # allocated once
    assert "_swap_parking" not in module.state_dict()
    # a subset (LoRA's trained tensors): only those swap, and the parking follows the keys
    with swapped_weights(module, {"1.bias": torch.zeros(2)}):
        assert torch.equal(module[1].bias, torch.zeros(2)) and torch.equal(module[0].weight, own["0.weight"])
    assert set(module._swap_parking) == {"1.bias"}
    torch.testing.assert_close(module(x).detach(), before, rtol=0, atol=0)


def test_weights_that_do_not_match_are_refused():
    module = torch.nn.Linear(2, 2)
    with pytest.raises(KeyError, match="do not match the module"):
        with swapped_weights(module, {"nope": torch.zeros(1)}):
            pass


@pytest.mark.skipif(not torch.cuda.is_available(), reason="pinned buffers and asynchronous copies: a GPU")
def test_gpu_swap_uses_pinned_buffers_and_restores():
    module = torch.nn.Linear(64, 64).cuda()
    own = cpu_state_copy(module)
    assert all(v.is_pinned() for v in own.values())
    other = {k: torch.randn_like(v).pin_memory() for k, v in own.items()}
    x = torch.randn(3, 64, device="cuda")
    before = module(x).detach()
    for _ in range(3):  # back-to-back swaps reuse the parking buffers while copies may be in flight
        with swapped_weights(module, other):
            torch.testing.assert_close(module.weight.cpu(), other["weight"], rtol=0, atol=0)
    assert all(v.is_pinned() for v in module._swap_parking.values())
    torch.testing.assert_close(module(x).detach(), before, rtol=0, atol=0)
