"""Rank 0 hosts the server; every other rank follows its broadcast signals."""

from __future__ import annotations

import enum
from typing import Any, Callable, Dict

import torch
import torch.distributed as dist


class ServerSignal(enum.IntEnum):
    """What rank 0 asks the other ranks to do next."""

    EXIT = 0
    FORWARD = 1
    TRAIN = 2
    SAVE = 3


def broadcast_signal(signal: ServerSignal) -> None:
    """Rank 0: tell every rank what comes next (no-op with one process)."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.broadcast(torch.tensor([int(signal)], dtype=torch.long), src=0)


def receive_signal() -> ServerSignal:
    value = torch.zeros(1, dtype=torch.long)
    dist.broadcast(value, src=0)
    return ServerSignal(int(value.item()))


def follow(handlers: Dict[ServerSignal, Callable[[], Any]]) -> None:
    """Ranks other than 0: run the handler of each signal rank 0 broadcasts, until EXIT."""
    while True:
        signal = receive_signal()
        if signal == ServerSignal.EXIT:
            return
        handlers[signal]()
