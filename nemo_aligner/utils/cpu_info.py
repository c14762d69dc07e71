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
