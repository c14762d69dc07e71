"""Free TCP ports for servers and rendezvous on one machine."""

from __future__ import annotations

import errno
import os
import random
import socket
import time
from typing import Dict, Optional

from nemo_aligner.utils.errors import ConfigError


# Not the global ``random``: training seeds it (``seed_everything``), so every process seeded alike
# would draw the same "free" ports and two of them starting servers at once would collide.
_draws = random.SystemRandom()
# Two disjoint ranges below the kernel's ephemeral ports (32768+ on Linux). A port told to another
# process can stay unbound for minutes (a server loads its model before it listens); a draw for a
# port bound within seconds (a process's own rendezvous store, its tritonserver) must not land on it.
_TOLD = (20000, 27999)
_BOUND_AT_ONCE = (28000, 32000)
# Ports this process has handed out: ports drawn for several servers before any of them binds must
# differ among themselves.
_handed_out: set = set()
_REMEMBERED = 4000
# Ports handed out by this user's other processes on this machine (a file per port, made with
# O_EXCL): two processes drawing at once (two launchers, two test workers) must not hand out the same
# port either. A claim older than _CLAIM_TTL_S is void: its server has bound the port long since, or
# never will.
REGISTRY_ROOT = "/tmp"
_CLAIM_TTL_S = 600.0
_CLAIM_TRIES = 2000  # then the registry is passed over (a range all claimed within the TTL)


def _registry() -> Optional[str]:
    """This user's claim directory, or None where it cannot be had (read-only /tmp, another owner)."""
    path = os.path.join(REGISTRY_ROOT, f"nemo_aligner_ports_{os.getuid()}")
    try:
        os.makedirs(path, mode=0o700, exist_ok=True)
        if os.lstat(path).st_uid != os.getuid() or os.path.islink(path):
            return None
    except OSError:
        return None
    return path


def _claim(port: int, registry: Optional[str]) -> bool:
    """Claim ``port`` among this user's processes; False when another holds a live claim."""
    if registry is None:
        return True
    path = os.path.join(registry, str(port))
    for _ in range(2):
        try:
            os.close(os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600))
            return True
        except FileExistsError:
            try:
                if time.time() - os.stat(path).st_mtime < _CLAIM_TTL_S:
                    return False
                os.unlink(path)  # a void claim: take the port over
            except FileNotFoundError:
                pass
            except OSError:
                return False
        except OSError:  # the directory went or filled up: this process's own memory still holds
            return True
    return False


def free_port(bound_at_once: bool = False) -> int:
    """A port free on 127.0.0.1 now, none this process handed out before (it remembers up to 4000,
    then starts afresh) and none another process of this user on this machine handed out in the last
    10 minutes (a claim file per port under ``/tmp/nemo_aligner_ports_<uid>``).

    ``bound_at_once``: the port is bound within seconds by this process or one it starts now (drawn
    from 28000-32000); otherwise it is told to a process that may bind it much later, such as a
    server loading a model (20000-27999). A port the kernel hands out for ``bind(0)`` is released
    again before the server that was told to use it binds it; meanwhile another process's
    ``bind(0)`` (a torch.distributed store, an outgoing connection) may be given the same one:
    drawing below the kernel's range keeps clear of those.
    """
    low, high = _BOUND_AT_ONCE if bound_at_once else _TOLD
    registry, tries = _registry(), 0
    while True:
        port = _draws.randint(low, high)
        if port in _handed_out:
            continue
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
        tries += 1
        if tries <= _CLAIM_TRIES and not _claim(port, registry):
            continue
        if len(_handed_out) >= _REMEMBERED:
            _handed_out.clear()
        _handed_out.add(port)
        return port


def check_bindable(host: str, ports: Dict[str, int], key: str = "") -> None:
    """Refuse, naming the key, a host that is not this machine's or a port already in use, before a
    server spends minutes loading a model (``ports``: key name -> port; ``key``: their section)."""
    name_of = lambda name: f"{key}.{name}" if key else name  # noqa: E731
    bind_host = "0.0.0.0" if host in ("0.0.0.0", "") else host
    try:
        socket.getaddrinfo(bind_host, None)
    except (socket.gaierror, UnicodeError) as err:
        raise ConfigError(f"{name_of('host')}={host!r} is not an address of this machine "
                          f"({getattr(err, 'strerror', None) or err}); use 127.0.0.1, 0.0.0.0 (every interface) or "
                          "this machine's name or IP") from None
    for name, port in ports.items():
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                sock.bind((bind_host, port))
            except OSError as err:
                if err.errno == errno.EADDRNOTAVAIL:
                    raise ConfigError(f"{name_of('host')}={host!r} is not an address of this machine "
                                      f"({err.strerror}); use 127.0.0.1, 0.0.0.0 or one of its own") from None
                raise ConfigError(f"{name_of(name)}={port} on {host} is already in use ({err.strerror}); "
                                  "choose another port") from None
