"""Keep a second set of weights on the CPU and swap it into a module for a while.

PPO uses this for the initial policy (reference log-probs) in the actor and for the reward
model co-located with the critic: one copy of the network on the device, the other in CPU
memory, exchanged in place (parameters keep their identity, so optimizers and DDP buffers are
unaffected).

On a GPU the CPU copies are pinned, and the module's own weights are parked in pinned buffers
allocated once per module: every copy then runs as an asynchronous DMA on the current stream.
Swapping in waits for its copies (the forward needs the weights); swapping back does not, so its
copies overlap with whatever the host does next, and the stream orders them before the module's
next use.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from typing import Dict, Iterator, Optional, Set

import torch

_PARKED = "_swap_parking"  # the module attribute holding its parking buffers


def host_buffer_like(tensor: torch.Tensor) -> torch.Tensor:
    """An empty CPU tensor shaped like ``tensor``: pinned when ``tensor`` is on a GPU (asynchronous
    copies), pageable where pinning fails (a host short of lockable memory)."""
    if tensor.is_cuda:
        try:
            return torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
        except RuntimeError:
            pass
    return torch.empty(tensor.shape, dtype=tensor.dtype)


def cpu_state_copy(module: torch.nn.Module, names: Optional[Set[str]] = None) -> Dict[str, torch.Tensor]:
    """A CPU copy of every tensor in ``module.state_dict()`` (only those in ``names`` when given)."""
    copy = {}
    for k, v in module.state_dict().items():
        if isinstance(v, torch.Tensor) and (names is None or k in names):
            copy[k] = host_buffer_like(v)
            copy[k].copy_(v.detach())
    return copy


def _parking(module: torch.nn.Module, current: Dict[str, torch.Tensor], keys) -> Dict[str, torch.Tensor]:
    parked = getattr(module, _PARKED, None)
    if parked is None or parked.keys() != set(keys):
        parked = {k: host_buffer_like(current[k]) for k in keys}
        object.__setattr__(module, _PARKED, parked)  # a plain attribute: not a buffer, not in the state dict
    return parked


def _sync(tensors) -> None:
    if any(t.is_cuda for t in tensors):
        torch.cuda.current_stream().synchronize()


@contextmanager
def swapped_weights(module: torch.nn.Module, state: Dict[str, torch.Tensor],
                    seconds: Optional[Dict[str, float]] = None) -> Iterator[None]:
    """Copy ``state`` into ``module`` (its current tensors parked on the CPU) and restore them on exit.

    ``seconds``, when given, receives ``swap_in`` (the copies in, waited for) and ``swap_out`` (the
    time to issue the copies back; on a GPU they complete in the background)."""
    current = module.state_dict()
    missing = [k for k in state if k not in current]
    if missing:
        raise KeyError(f"weights to swap in do not match the module: {missing[:3]}")
    parked = _parking(module, current, state.keys())
    start = time.perf_counter()
    with torch.no_grad():
        for k, v in state.items():
            parked[k].copy_(current[k], non_blocking=True)  # the stream orders it before the copy in
            current[k].copy_(v, non_blocking=True)
    _sync(current[k] for k in state)
    if seconds is not None:
        seconds["swap_in"] = time.perf_counter() - start
    try:
        yield
    finally:
        start = time.perf_counter()
        with torch.no_grad():
            for k, v in parked.items():
                current[k].copy_(v, non_blocking=True)
        if seconds is not None:
            seconds["swap_out"] = time.perf_counter() - start
