"""A model's CPU decode buffers (packed weights, the KV cache), kept from one ``generate`` call to
the next.

A CPU decode step streams every packed weight and the whole KV cache from memory once, so these
buffers sit on 2 MiB pages where the system allows (``huge_page_zeros`` in ``utils.cpu_kernels``;
with 4 KiB pages nearly every page they read misses the TLB). Fresh memory costs page faults on
every call (~0.25 s per GB with 4 KiB pages, 0.7-1.3 s with 2 MiB pages on a 2 vCPU Xeon VM), so
the buffers are kept, as an inference engine keeps its KV cache: each call re-packs the current
weights into the same memory (weights updated between rollouts are always current) and reuses the
cache as it is (a call writes every slot it reads first); a larger call grows them.

``NEMO_ALIGNER_DECODE_BUFFERS``: ``keep`` (default) or ``free`` (each call allocates its own, on
ordinary pages, and returns them when it ends: less memory between calls, e.g. while training).
What ``keep`` holds between calls: one copy of the packed weights plus the largest KV cache used so
far; it is returned when the model is garbage collected, or by :func:`release`.
"""

from __future__ import annotations

import math
import os
import weakref
from typing import Dict, Hashable, Optional, Sequence

import torch

from nemo_aligner.utils import cpu_gemm
from nemo_aligner.utils.errors import ConfigError

ENV_VAR = "NEMO_ALIGNER_DECODE_BUFFERS"
_KEPT: "weakref.WeakKeyDictionary[torch.nn.Module, DecodeBuffers]" = weakref.WeakKeyDictionary()


def keep_requested() -> bool:
    """``NEMO_ALIGNER_DECODE_BUFFERS`` is ``keep`` (or unset); an unknown value is an error naming it."""
    value = os.environ.get(ENV_VAR, "keep").strip().lower() or "keep"
    if value not in ("keep", "free"):
        raise ConfigError(f"{ENV_VAR}={value!r}: expected keep or free")
    return value == "keep"


def _huge_page_bytes(size: int) -> torch.Tensor:
    """``size`` zero bytes, on 2 MiB pages where the CPU kernels build."""
    from nemo_aligner.utils import cpu_kernels  # imported here: building the kernels is costly

    kernels = cpu_kernels.load()
    if kernels is None:
        return torch.zeros(size, dtype=torch.uint8)
    return kernels.huge_page_zeros([size], torch.uint8)


class DecodeBuffers:
    """One decoder's packed weights and KV cache memory: kept ones (``kept=True``, the model's,
    reused by its next decoder) or this decoder's own."""

    def __init__(self, kept: bool):
        self.kept = kept
        self.in_use = False
        self._packs: Dict[Hashable, torch.Tensor] = {}
        self._cache: Optional[torch.Tensor] = None  # flat bytes the KV cache is viewed from

    def pack(self, key: Hashable, weight: torch.Tensor, rows: int, backend: str) -> Optional[torch.Tensor]:
        """``cpu_gemm.pack(weight, rows, backend)``; kept buffers write our kernels' packs into the
        memory of the previous pack under ``key`` where the shape is the same."""
        kept = self.kept and backend in cpu_gemm.REUSABLE_PACKS
        with torch.inference_mode(False):  # kept memory serves decoders in and out of inference mode
            packed = cpu_gemm.pack(weight, rows, backend, reuse=self._packs.get(key), huge_pages=kept)
        if kept:
            if packed is None:
                self._packs.pop(key, None)
            else:
                self._packs[key] = packed
        return packed

    def cache(self, shape: Sequence[int], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A tensor of ``shape`` and ``dtype`` on ``device`` for the KV cache: zeros where fresh,
        else what the previous call left (the decoder writes every slot before it reads it)."""
        if not self.kept:  # (kept buffers are CPU ones, see acquire)
            return torch.zeros(tuple(shape), dtype=dtype, device=device)
        size = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        if self._cache is not None and self._cache.numel() >= size:
            return self._cache[:size].view(dtype).view(tuple(shape))
        self._cache = None  # returned before the larger one is taken
        with torch.inference_mode(False):
            self._cache = _huge_page_bytes(size)
        return self._cache.view(dtype).view(tuple(shape))

    def held_bytes(self) -> int:
        """Bytes held between calls (packs and cache)."""
        held = sum(p.numel() * p.element_size() for p in self._packs.values())
        return held + (self._cache.numel() if self._cache is not None else 0)

    def clear(self) -> None:
        self._packs.clear()
        self._cache = None


def acquire(module: torch.nn.Module, device: torch.device) -> DecodeBuffers:
    """Buffers for a new decoder of ``module``: the model's kept ones on the CPU when keeping is on
    and no other decoder of it holds them, else the decoder's own. Give kept ones back with
    :func:`give_back` when the decoder is done."""
    if device.type != "cpu" or not keep_requested():
        return DecodeBuffers(kept=False)
    buffers = _KEPT.get(module)
    if buffers is None:
        buffers = _KEPT[module] = DecodeBuffers(kept=True)
    if buffers.in_use:  # another decoder of this model is alive: it must not see its memory reused
        return DecodeBuffers(kept=False)
    buffers.in_use = True
    return buffers


def give_back(buffers: DecodeBuffers) -> None:
    buffers.in_use = False


def release(module: torch.nn.Module) -> int:
    """Return ``module``'s kept decode buffers to the system now; the bytes they held."""
    buffers = _KEPT.pop(module, None)
    if buffers is None:
        return 0
    held = buffers.held_bytes()
    buffers.clear()
    return held
