"""Keep a second set of weights on the CPU and swap it into a module for a while.

PPO uses this for the initial policy (reference log-probs) in the actor and for the reward
model co-located with the critic: one copy of the network on the device, the other in CPU
memory, exchanged in place (parameters keep their identity, so optimizers and DDP buffers are
unaffected).
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Dict, Iterator, Optional, Set

import torch


def cpu_state_copy(module: torch.nn.Module, names: Optional[Set[str]] = None) -> Dict[str, torch.Tensor]:
    """A CPU copy of every tensor in ``module.state_dict()`` (only those in ``names`` when given)."""
    return {k: v.detach().to("cpu", copy=True) for k, v in module.state_dict().items()
            if isinstance(v, torch.Tensor) and (names is None or k in names)}


@contextmanager
def swapped_weights(module: torch.nn.Module, state: Dict[str, torch.Tensor]) -> Iterator[None]:
    """Copy ``state`` into ``module`` (its current tensors parked on the CPU) and restore them on exit."""
    current = module.state_dict()
    missing = [k for k in state if k not in current]
    if missing:
        raise KeyError(f"weights to swap in do not match the module: {missing[:3]}")
    parked = {k: current[k].detach().to("cpu", copy=True) for k in state}
    with torch.no_grad():
        for k, v in state.items():
            current[k].copy_(v)
    try:
        yield
    finally:
        with torch.no_grad():
            for k, v in parked.items():
                current[k].copy_(v)
