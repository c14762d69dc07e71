"""Free TCP ports for servers and rendezvous on one machine."""

from __future__ import annotations

import random
import socket


# Not the global ``random``: training seeds it (``seed_everything``), so every process seeded alike
# would draw the same "free" ports and two of them starting servers at once would collide.
_draws = random.SystemRandom()


def free_port() -> int:
    """A port free on 127.0.0.1 now, drawn below the kernel's ephemeral range (32768+ on Linux).

    A port the kernel hands out for ``bind(0)`` is released again before the server that was told
    to use it binds it; meanwhile another process's ``bind(0)`` (a torch.distributed store, an
    outgoing connection) may be given the same one. Drawing from 20000-32000 keeps clear of those.
    """
    while True:
        port = _draws.randint(20000, 32000)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
