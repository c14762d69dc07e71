"""Rendezvous stores that listen on their host's address only.

torch's ``TCPStore`` server listens on every interface (``*:port``), unauthenticated, for the life
of the job. Given a socket already bound to the rendezvous address (``master_listen_fd``) it listens
there instead; :func:`listening_store` does that, and :func:`stores_bound_to_their_host` makes the
elastic agent that starts ``trainer.devices=N`` ranks do the same for its stores.
"""

from __future__ import annotations

import errno
import ipaddress
import logging
import socket
from contextlib import contextmanager
from datetime import timedelta
from typing import Iterator, Optional, Tuple

import torch.distributed as dist

from nemo_aligner.utils.errors import ConfigError

logger = logging.getLogger(__name__)


def is_loopback(host: str) -> bool:
    """Whether ``host`` (a name or an address) resolves to a loopback address."""
    try:
        return all(ipaddress.ip_address(info[4][0]).is_loopback
                   for info in socket.getaddrinfo(host, None, type=socket.SOCK_STREAM))
    except (socket.gaierror, ValueError):
        return False


def preferred_address(host: str) -> str:
    """The address a name stands for here: its first IPv4 address, else its first (``localhost``
    is often both 127.0.0.1 and ::1; a store listens on one of them)."""
    infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    ipv4 = [info for info in infos if info[0] == socket.AF_INET]
    return (ipv4 or infos)[0][4][0]


def bound_socket_fd(host: str, port: int, what: str) -> Tuple[int, int]:
    """A listening socket on ``host:port`` (its :func:`preferred_address`, which must be this
    machine's), detached to a file descriptor; returns the descriptor and the port (the one the
    kernel chose for port 0)."""
    family, _, _, _, address = socket.getaddrinfo(preferred_address(host), port, type=socket.SOCK_STREAM)[0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
        sock.listen(2048)
    except OSError as err:
        sock.close()
        if err.errno == errno.EADDRINUSE:
            raise ConfigError(f"{what}: port {port} on {host} is already in use; choose another MASTER_PORT") from None
        raise ConfigError(f"{what}: cannot listen on {host}:{port} ({err.strerror})") from None
    bound_port = sock.getsockname()[1]
    return sock.detach(), bound_port


def listening_store(host: str, port: int, world_size: Optional[int], timeout: timedelta,
                    what: str = "rendezvous store", **kwargs) -> dist.TCPStore:
    """A ``TCPStore`` server on ``host:port`` that listens on that address only (port 0: one the
    kernel chooses, the store's ``port``)."""
    fd, port = bound_socket_fd(host, port, what)
    try:
        return dist.TCPStore(host, port, world_size, is_master=True, timeout=timeout, master_listen_fd=fd, **kwargs)
    except (RuntimeError, TypeError, ValueError):
        # a torch whose libuv store cannot take a listening socket: its older store can
        return dist.TCPStore(host, port, world_size, is_master=True, timeout=timeout, master_listen_fd=fd,
                             use_libuv=False, **kwargs)


@contextmanager
def stores_bound_to_their_host() -> Iterator[bool]:
    """While inside, the elastic agent's stores listen on their address only: the c10d rendezvous
    backend's, and the one the agent shares with its ranks as their ``MASTER_ADDR:MASTER_PORT``.

    Yields whether the shared store is covered (a torch that creates it through
    ``DynamicRendezvousHandler._create_tcp_store_server``); where it is not, the caller turns sharing
    off (``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``) and rank 0 hosts the ranks' store instead, on a
    port the agent chose and released."""
    from torch.distributed.elastic.rendezvous import c10d_rendezvous_backend as backend
    from torch.distributed.elastic.rendezvous import dynamic_rendezvous

    original = backend.TCPStore
    handler = dynamic_rendezvous.DynamicRendezvousHandler
    original_shared = getattr(handler, "_create_tcp_store_server", None)

    def store(host_name, port, world_size=None, is_master=False, timeout=timedelta(seconds=300), **kwargs):
        if not is_master or kwargs.get("master_listen_fd") is not None:
            return original(host_name, port, world_size, is_master=is_master, timeout=timeout, **kwargs)
        return listening_store(host_name, port, world_size, timeout, what="elastic agent store", **kwargs)

    def shared_store(self, *args):
        # (master_addr, master_port) in current torch; (bootstrap_store_info) in torch 2.4-2.5
        addr, port = (args[0].master_addr, args[0].master_port) if len(args) == 1 else args
        return listening_store(addr, port, None, timedelta(seconds=300), what="elastic agent store",
                               multi_tenant=True)

    backend.TCPStore = store
    if original_shared is not None:
        handler._create_tcp_store_server = shared_store
    try:
        yield original_shared is not None
    finally:
        backend.TCPStore = original
        if original_shared is not None:
            handler._create_tcp_store_server = original_shared
