"""No stack dumps on SIGINT/SIGTERM from megatron-core's inference coordinator.

Importing ``megatron.core.inference.data_parallel_inference_coordinator`` (which its inference engines
import, and the CPU patches import those) registers :mod:`faulthandler` on SIGTERM and SIGINT: every
Ctrl-C or ``kill`` then writes the stack of the running thread to stderr before the process's own
handler runs (a trainer's SIGTERM checkpoint, the one-line "interrupted" of Ctrl-C). Only those two
registrations are undone; faulthandler's dumps on crashes (SIGSEGV, SIGABRT, ...) stay.
"""

from __future__ import annotations

import faulthandler
import signal
import sys
import threading

COORDINATOR = "megatron.core.inference.data_parallel_inference_coordinator"


def install() -> None:
    """Undo the coordinator's registrations if it was imported (main thread only: the Python-level
    handlers are put back with ``signal.signal``)."""
    if COORDINATOR not in sys.modules or threading.current_thread() is not threading.main_thread():
        return
    for sig in (signal.SIGINT, signal.SIGTERM):
        handler = signal.getsignal(sig)
        # unregister restores the C-level action saved at registration, which may predate the
        # Python handler installed since; installing that handler again makes them agree.
        faulthandler.unregister(sig)
        if handler is not None:
            signal.signal(sig, handler)
