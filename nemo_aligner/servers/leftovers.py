"""What a killed PyTriton server leaves on a node, found and removed.

A server stopped cleanly removes everything it made. One killed together with its helper processes
(Slurm's SIGKILL after ``KillWait``, the OOM killer, ``kill -9`` of a process group) leaves:
PyTriton's shared-memory blocks (``/dev/shm/pytrtion<pid>-*`` and ``/dev/shm/psm_*``), Triton's
Python-backend model and execution-environment folders (``/tmp/folderXXXXXX``,
``/tmp/python_env_XXXXXX``) and our PyTriton workspace (``<tmp>/pytriton_<pid>_*``). Servers
remove stale ones when they start; ``python -m nemo_aligner.servers.leftovers [--dry-run]`` does it
by hand.

A tritonserver that crashes (an abort in its Python backend) can also leave its Python-backend stub
processes running, holding its sockets and those files: a server kills its own tritonserver's stubs
when that tritonserver exits (:func:`kill_stubs_under`), and a starting server kills any whose
PyTriton process (named in their shared-memory argument) is gone.

Only this user's files and processes are touched, and only files no running process has open,
mapped, or names on its command line or as its directory; ``/dev/shm/psm_*`` and Triton's folders,
whose names do not say who made them, must also be older than a minute. ``python_env_*`` folders, which nothing
holds open while their server lives, go only when empty and while no tritonserver of this user runs.
"""

from __future__ import annotations

import glob
import logging
import os
import re
import shutil
import tempfile
import time
from typing import Iterable, List, Set, Tuple

import psutil

logger = logging.getLogger(__name__)

SHM_DIR = "/dev/shm"
SYSTEM_TMP = "/tmp"  # where Triton makes its model folders, whatever TMPDIR says
MIN_AGE_S = 60.0
_PID_NAMED = (re.compile(r"^pytrtion(\d+)-"), re.compile(r"^pytriton_(\d+)_"))


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def paths_in_use() -> Set[str]:
    """Every path a running process has open, mapped, as its directory or on its command line."""
    used: Set[str] = set()
    for proc in glob.glob("/proc/[0-9]*"):
        for fd in glob.glob(os.path.join(proc, "fd", "*")):
            try:
                used.add(os.readlink(fd))
            except OSError:
                pass
        try:
            used.add(os.readlink(os.path.join(proc, "cwd")))
        except OSError:
            pass
        try:
            with open(os.path.join(proc, "maps"), encoding="utf-8", errors="replace") as f:
                for line in f:
                    parts = line.split(None, 5)
                    if len(parts) == 6 and parts[5].startswith("/"):
                        used.add(parts[5].strip().replace(" (deleted)", ""))
        except OSError:
            pass
        try:
            with open(os.path.join(proc, "cmdline"), "rb") as f:
                used.update(arg.decode(errors="replace") for arg in f.read().split(b"\0") if arg.startswith(b"/"))
        except OSError:
            pass
    return used


def _used(path: str, used: Set[str]) -> bool:
    prefix = path.rstrip("/") + "/"
    return any(u == path or u.startswith(prefix) for u in used)


def _is_triton_model_folder(path: str) -> bool:
    return os.path.isfile(os.path.join(path, "config.pbtxt")) and os.path.isfile(os.path.join(path, "1", "model.py"))


def _is_empty_triton_env_folder(path: str) -> bool:
    try:
        return os.path.isdir(path) and not os.path.islink(path) and not os.listdir(path)
    except OSError:
        return False


def _processes_named(uid: int, name: str, attrs: Tuple[str, ...] = ()) -> List[psutil.Process]:
    """``uid``'s processes named ``name`` on this node, with ``attrs`` read into their ``info``."""
    found = []
    for proc in psutil.process_iter(["name", "uids", *attrs]):
        uids = proc.info["uids"]
        if uids is not None and uids.effective == uid and proc.info["name"] == name:
            found.append(proc)
    return found


def tritonserver_pids(uid: int) -> List[int]:
    """The processes of ``uid`` named tritonserver on this node."""
    return [proc.pid for proc in _processes_named(uid, "tritonserver")]


def stub_processes(uid: int) -> List[Tuple[int, str, List[str]]]:
    """``(pid, executable, argv)`` of ``uid``'s Triton Python-backend stubs on this node."""
    stubs = _processes_named(uid, "triton_python_backend_stub", ("exe", "cmdline"))
    return [(proc.pid, proc.info["exe"], proc.info["cmdline"]) for proc in stubs
            if proc.info["exe"] and proc.info["cmdline"] is not None]


def _running(proc: psutil.Process) -> bool:
    """Not exited (a zombie has let go of its files and sockets too)."""
    try:
        return proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _kill(pids: List[int], wait_s: float = 5.0) -> List[int]:
    """SIGKILL ``pids`` and wait (up to ``wait_s``) until they are gone; returns those signalled."""
    killed = []
    for pid in pids:
        try:
            proc = psutil.Process(pid)
            proc.kill()
            killed.append(proc)
        except psutil.Error:
            pass
    deadline = time.monotonic() + wait_s
    while any(_running(proc) for proc in killed) and time.monotonic() < deadline:
        time.sleep(0.02)
    return [proc.pid for proc in killed]


def kill_stubs_under(root: str) -> List[int]:
    """SIGKILL this user's Python-backend stubs whose executable lies under ``root`` (the workspace of a
    tritonserver that has exited); returns their pids."""
    prefix = os.path.abspath(root).rstrip("/") + "/"
    return _kill([pid for pid, exe, _ in stub_processes(os.getuid()) if exe.startswith(prefix)])


def orphaned_stubs() -> List[int]:
    """This user's Python-backend stubs whose PyTriton process (``pytrtion<pid>-`` in their arguments)
    has exited."""
    orphans = []
    for pid, _, argv in stub_processes(os.getuid()):
        owner = next((m for m in (_PID_NAMED[0].match(arg) for arg in argv) if m), None)
        if owner is not None and not _pid_alive(int(owner.group(1))):
            orphans.append(pid)
    return orphans


def kill_orphaned_stubs() -> List[int]:
    """SIGKILL :func:`orphaned_stubs`; returns their pids."""
    return _kill(orphaned_stubs())


def stale_leftovers(tmp_dirs: Iterable[str] = (), now: float = None) -> List[str]:
    """The stale files and directories (see the module docstring)."""
    now = time.time() if now is None else now
    uid = os.getuid()
    used = paths_in_use()
    candidates = []
    env_folders_free = not tritonserver_pids(uid)
    for path in glob.glob(os.path.join(SHM_DIR, "pytrtion*")) + glob.glob(os.path.join(SHM_DIR, "psm_*")):
        candidates.append((path, os.path.basename(path).startswith("psm_")))
    for tmp in dict.fromkeys([*tmp_dirs, tempfile.gettempdir(), SYSTEM_TMP]):
        candidates += [(p, False) for p in glob.glob(os.path.join(tmp, "pytriton_*_*"))]
        candidates += [(p, True) for p in glob.glob(os.path.join(tmp, "folder??????")) if _is_triton_model_folder(p)]
        if env_folders_free:
            candidates += [(p, True) for p in glob.glob(os.path.join(tmp, "python_env_??????"))
                           if _is_empty_triton_env_folder(p)]
    stale = []
    for path, needs_age in candidates:
        try:
            st = os.lstat(path)
        except OSError:
            continue
        if st.st_uid != uid or _used(path, used):
            continue
        match = next((m for m in (p.match(os.path.basename(path)) for p in _PID_NAMED) if m), None)
        if match is not None:
            if _pid_alive(int(match.group(1))):
                continue
        elif not needs_age or now - st.st_mtime < MIN_AGE_S:
            continue
        stale.append(path)
    return stale


def remove_stale(tmp_dirs: Iterable[str] = ()) -> List[str]:
    """Stop the :func:`orphaned_stubs`, remove the :func:`stale_leftovers`; returns what was removed."""
    stubs = kill_orphaned_stubs()
    if stubs:
        logger.info("stopped %d Python-backend stub(s) of exited PyTriton servers", len(stubs))
    removed = []
    for path in stale_leftovers(tmp_dirs):
        try:
            if os.path.isdir(path) and not os.path.islink(path):
                shutil.rmtree(path)
            else:
                os.unlink(path)
            removed.append(path)
        except OSError as err:
            logger.debug("could not remove %s: %s", path, err)
    if removed:
        logger.info("removed %d leftover(s) of PyTriton servers (shared memory, workspaces, Triton's model "
                    "and environment folders)", len(removed))
    return removed


def main() -> None:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dry-run", action="store_true", help="list what would be removed or stopped")
    parser.add_argument("--tmp-dir", action="append", default=[], help="another temporary directory to look in")
    args = parser.parse_args()
    if args.dry_run:
        for pid in orphaned_stubs():
            print(f"process {pid} (a Python-backend stub of an exited server)")
    paths = stale_leftovers(args.tmp_dir) if args.dry_run else remove_stale(args.tmp_dir)
    for path in paths:
        print(path)


if __name__ == "__main__":
    main()
