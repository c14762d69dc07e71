"""Rank 0 hosts the server; every other rank follows its broadcast signals."""

from __future__ import annotations

import enum
from typing import Any, Callable, Dict

import torch
import torch.distributed as dist

from nemo_aligner.utils.distributed import comm_device


class ServerSignal(enum.IntEnum):
    """What rank 0 asks the other ranks to do next."""

    EXIT = 0
    FORWARD = 1
    TRAIN = 2
    SAVE = 3


def broadcast_signal(signal: ServerSignal) -> None:
    """Rank 0: tell every rank what comes next (no-op with one process)."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.broadcast(torch.tensor([int(signal)], dtype=torch.long, device=comm_device()), src=0)


def receive_signal() -> ServerSignal:
    value = torch.zeros(1, dtype=torch.long, device=comm_device())
    dist.broadcast(value, src=0)
    return ServerSignal(int(value.item()))


def follow(handlers: Dict[ServerSignal, Callable[[], Any]]) -> None:
    """Ranks other than 0: run the handler of each signal rank 0 broadcasts, until EXIT.

    SIGTERM/SIGINT are noted but do not stop a follower: launchers (torchrun, Slurm) signal
    every rank at once, and rank 0 then broadcasts EXIT; a follower that died first would
    make rank 0's shutdown fail. If rank 0 is gone, the launcher's SIGKILL ends the rest.
    """
    import logging
    import signal as os_signal

    def note(signum, frame):
        logging.getLogger(__name__).info("signal %d: waiting for rank 0 to stop the server", signum)

    previous = {sig: os_signal.signal(sig, note) for sig in (os_signal.SIGTERM, os_signal.SIGINT)}
    try:
        while True:
            signal = receive_signal()
            if signal == ServerSignal.EXIT:
                return
            handlers[signal]()
    finally:
        for sig, handler in previous.items():
            os_signal.signal(sig, handler)
