"""Fields of ``/proc/cpuinfo``."""

from __future__ import annotations

import functools


@functools.lru_cache(maxsize=None)
def cpuinfo(field: str) -> str:
    """The first CPU's ``field`` in ``/proc/cpuinfo`` (``vendor_id``, ``model name``, ...), or ""
    where there is no such file or field."""
    try:
        with open("/proc/cpuinfo") as info:
            for line in info:
                name, sep, value = line.partition(":")
                if sep and name.strip() == field:
                    return value.strip()
    except OSError:
        pass
    return ""


@functools.lru_cache(maxsize=None)
def has_fast_bf16_matmul() -> bool:
    """Whether the CPU multiplies bf16 matrices in hardware (AMX or AVX512_BF16), so that bf16 GEMMs
    outrun float32 ones; elsewhere oneDNN emulates them, several times slower than float32."""
    flags = set(cpuinfo("flags").split())
    return bool(flags & {"amx_bf16", "avx512_bf16"})
