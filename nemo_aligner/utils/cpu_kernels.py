"""Fused float32 CPU kernels (``nemo_aligner/csrc/cpu_kernels.cpp``), compiled on first use.

- Decode steps: each layer's glue (residual add + RMSNorm, RoPE + cache write, attention over the
  cache, SwiGLU) runs in four kernel calls instead of ~45 small torch ops; the matmuls stay with
  torch (``generation.KVCacheDecoder``).
- Decode matmuls: ``pack_linear``/``packed_linear``, an AVX2/FMA (or AVX-512) GEMM for a few dozen rows
  (``cpu_gemm``'s ``native`` backend).
- Training: SwiGLU and RMSNorm forward and backward in one pass each (``lean_ops``).

See benchmarks/README.md for measurements. The extension is built once per machine and flag set
with ``torch.utils.cpp_extension`` (a C++ compiler and the Python headers; ~30-60 s) into
:func:`cache_root`.

``NEMO_ALIGNER_CPU_KERNELS``: ``auto`` (default: use them where they build, else torch's ops with
one warning), ``on`` (an error where they cannot build), ``off``.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import logging
import os
import platform
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from types import ModuleType
from typing import Optional

try:
    import fcntl
except ImportError:  # not a POSIX system: no build lock, so no build (torch's ops are used)
    fcntl = None

from nemo_aligner.utils.cpu_info import cpuinfo
from nemo_aligner.utils.errors import ConfigError

ENV_VAR = "NEMO_ALIGNER_CPU_KERNELS"
MODES = ("auto", "on", "off")
SOURCE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "csrc", "cpu_kernels.cpp")

log = logging.getLogger(__name__)


def mode() -> str:
    """``NEMO_ALIGNER_CPU_KERNELS`` (``auto`` when unset); an unknown value is an error naming it."""
    value = os.environ.get(ENV_VAR, "auto").strip().lower() or "auto"
    if value not in MODES:
        raise ConfigError(f"{ENV_VAR}={value!r}: expected one of {', '.join(MODES)}")
    return value


def compile_flags() -> list:
    """Optimisation flags for this CPU: AVX2 + FMA kernels where the CPU has both (checked in
    ``/proc/cpuinfo``, not ``-march=native``, so a shared extension cache never holds code for a
    CPU other than the one its flags name), portable scalar code elsewhere."""
    flags = ["-O3", "-fopenmp"]
    cpu_flags = set(cpuinfo("flags").split())
    if platform.machine().lower() in ("x86_64", "amd64") and {"avx2", "fma"} <= cpu_flags:
        flags += ["-mavx2", "-mfma"]
        if "avx512f" in cpu_flags:  # the packed GEMM's 32-column panels
            flags.append("-mavx512f")
            bf16 = ["-mavx512vl", "-mavx512bf16"]  # float32 -> bf16 stores in one instruction
            if {"avx512_bf16", "avx512vl"} <= cpu_flags and _compiler_accepts(bf16):
                flags += bf16
                amx = ["-mamx-tile", "-mamx-bf16"]  # the decode steps' bf16 GEMM on AMX tiles
                if {"amx_tile", "amx_bf16"} <= cpu_flags and _compiler_accepts(amx):
                    flags += amx
    return flags


def _compiler_accepts(flags: list) -> bool:
    """Whether the C++ compiler torch builds extensions with (``$CXX``, else ``c++``) takes ``flags``
    (an older one lacks the newer instruction sets')."""
    try:
        return subprocess.run([os.environ.get("CXX", "c++"), *flags, "-fsyntax-only", "-x", "c++", os.devnull],
                              capture_output=True, timeout=60).returncode == 0
    except (OSError, subprocess.SubprocessError):
        return False


def _build_name(flags: list) -> str:
    # One build per source, flag set, torch and Python: an edited source, another CPU kind or a
    # torch upgrade gets its own.
    import torch

    with open(SOURCE, "rb") as f:
        key = f.read() + " ".join(flags + [torch.__version__, sys.version]).encode()
    return f"nemo_aligner_cpu_kernels_{hashlib.sha1(key).hexdigest()[:12]}"


def cache_root() -> str:
    """Where builds are kept: ``$TORCH_EXTENSIONS_DIR/nemo_aligner``, else
    ``~/.cache/torch_extensions/nemo_aligner``."""
    base = os.environ.get("TORCH_EXTENSIONS_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "torch_extensions")
    return os.path.join(base, "nemo_aligner")


def _import(name: str, path: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _build_or_import(name: str, flags: list) -> ModuleType:
    """Import the build ``name``, building it first where it is missing. Builds go to a private
    temporary directory that is renamed into place when complete, under an exclusive ``flock``
    (the kernel releases it if the process dies, so an interrupted build never blocks later runs,
    and a half-written build is never imported)."""
    from torch.utils import cpp_extension

    if fcntl is None:
        raise RuntimeError("building the kernels needs fcntl (a POSIX system)")
    root = cache_root()
    os.makedirs(root, exist_ok=True)
    final = os.path.join(root, name)
    library = os.path.join(final, name + ".so")
    with open(os.path.join(root, name + ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one build per machine; others wait for it, then import
        if os.path.exists(library):
            return _import(name, library)
        log.info("building the fused CPU kernels into %s (once per machine, ~30-60 s)", final)
        if shutil.which("ninja") is None:
            # torch runs `ninja` from PATH; the `ninja` package puts it beside this interpreter,
            # which is not on PATH when a venv's python is run without activating the venv.
            os.environ["PATH"] = os.pathsep.join([sysconfig.get_path("scripts"), os.environ.get("PATH", "")])
        scratch = tempfile.mkdtemp(prefix=name + ".building-", dir=root)
        try:
            # -fopenmp at compile time: the kernels' at::parallel_for then runs on the OpenMP
            # runtime torch already loaded (the same libgomp.so.1), not a second thread pool.
            module = cpp_extension.load(name=name, sources=[SOURCE], extra_cflags=flags, extra_ldflags=["-fopenmp"],
                                        build_directory=scratch, verbose=False)
            try:
                os.rename(scratch, final)
            except OSError:
                if not os.path.exists(library):
                    raise
                # another machine sharing this directory finished first (flock may be local to a
                # node on network file systems): keep its build, ours stays loaded from memory
                shutil.rmtree(scratch, ignore_errors=True)
        except BaseException:
            shutil.rmtree(scratch, ignore_errors=True)
            raise
        return module


@functools.lru_cache(maxsize=None)
def _load(requested: str) -> Optional[ModuleType]:
    if requested == "off":
        return None
    try:
        flags = compile_flags()
        return _build_or_import(_build_name(flags), flags)
    except Exception as error:  # a missing compiler or headers: the Python loop still works
        if requested == "on":
            raise ConfigError(f"{ENV_VAR}=on, but the fused CPU kernels could not be built: {error}") from error
        log.warning("the fused CPU kernels could not be built (%s); decoding with the Python loop and "
                    "training with torch's ops "
                    "(set %s=off to skip the attempt)", (str(error).strip().splitlines() or [repr(error)])[-1], ENV_VAR)
        return None


def load() -> Optional[ModuleType]:
    """The compiled kernels module, or None where ``NEMO_ALIGNER_CPU_KERNELS`` is ``off`` or (in
    ``auto``) they cannot be built. Built once per machine, imported once per process."""
    return _load(mode())
