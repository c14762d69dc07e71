"""A pre-imported interpreter that forks the test suite's script runs.

Importing torch, megatron-core and Hydra takes ~2 s of every script run's ~3-5 s on a 2-core
machine; the suite runs hundreds. This server imports them once (no torch op runs, so no thread
pool exists to be lost in a fork), then forks one child per request from ``client.py``: the child
takes the client's stdin/stdout/stderr (passed as file descriptors), environment, working
directory and arguments, and runs the script, ``-m`` module or ``-c`` code as ``python`` would.
The server reports the child's pid and, when it ends, its raw wait status; a client that goes away
first takes its child with it (SIGKILL). Everything but the third-party imports is fresh in each
child: the project's own modules are imported there, under the run's environment.

Usage: ``python server.py SOCKET_PATH`` (``conftest.py`` starts one per pytest worker).
"""

import array
import json
import os
import selectors
import signal
import socket
import struct
import sys

PRELOAD = (
    "numpy", "torch", "torch.distributed", "torch.distributed.launcher.api", "torch.distributed.checkpoint",
    "megatron.core", "megatron.core.models.gpt", "megatron.core.dist_checkpointing", "megatron.core.optimizer",
    "megatron.core.pipeline_parallel", "megatron.core.transformer", "megatron.core.distributed",
    "hydra", "omegaconf", "tqdm", "safetensors", "sentencepiece", "tokenizers", "yaml", "psutil",
)


# Messages both ways: a 4-byte big-endian length, then that many bytes of JSON (client.py uses these).
def recv_exact(conn, size: int):
    """``size`` bytes, or None where the peer closed first."""
    data = b""
    while len(data) < size:
        chunk = conn.recv(size - len(data))
        if not chunk:
            return None
        data += chunk
    return data


def recv_body(conn, head: bytes):
    """The JSON message whose 4-byte length ``head`` has been read, or None."""
    body = recv_exact(conn, struct.unpack("!I", head)[0]) if len(head) == 4 else None
    return None if body is None else json.loads(body)


def recv_message(conn):
    head = recv_exact(conn, 4)
    return None if head is None else recv_body(conn, head)


def recv_request(conn):
    """A client's request and the file descriptors sent with its length."""
    fds = array.array("i")
    head, ancillary, _, _ = conn.recvmsg(4, socket.CMSG_SPACE(16 * fds.itemsize))
    for level, kind, data in ancillary:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.frombytes(data[: len(data) - len(data) % fds.itemsize])
    return recv_body(conn, head), list(fds)


def send_message(conn, message) -> None:
    body = json.dumps(message).encode()
    conn.sendall(struct.pack("!I", len(body)) + body)


def run_child(request, fds, default_threads: int, base_path: list):
    """In the forked child: become the requested ``python`` run (``default_threads``: torch's
    threads where the run sets none; ``base_path``: sys.path after the run's own entries). Returns
    its exit code (or raises as the run does, for the interpreter's own top level to report)."""
    import io
    import runpy

    for target, fd in enumerate(fds[:3]):
        os.dup2(fd, target)
    for fd in fds:
        if fd > 2:
            os.close(fd)
    os.environ.clear()
    os.environ.update(request["env"])
    os.chdir(request["cwd"])
    import tempfile

    tempfile.tempdir = None  # found again from this run's TMPDIR
    unbuffered = request["unbuffered"] or bool(os.environ.get("PYTHONUNBUFFERED"))

    def stream(fd, mode, **kwargs):
        raw = io.FileIO(fd, mode, closefd=False)
        if "r" in mode:
            return io.TextIOWrapper(io.BufferedReader(raw), **kwargs)
        binary = raw if unbuffered and fd == 1 else io.BufferedWriter(raw)
        return io.TextIOWrapper(binary, write_through=unbuffered or fd == 2,
                                line_buffering=fd == 2 or os.isatty(fd), **kwargs)

    sys.stdin = sys.__stdin__ = stream(0, "r")
    sys.stdout = sys.__stdout__ = stream(1, "w")
    sys.stderr = sys.__stderr__ = stream(2, "w", errors="backslashreplace")

    import warnings

    for option in filter(None, os.environ.get("PYTHONWARNINGS", "").split(",")):
        warnings._setoption(option)  # as the interpreter reads them at start-up
    import torch

    threads = os.environ.get("OMP_NUM_THREADS", "")
    torch.set_num_threads(int(threads) if threads.isdigit() and int(threads) > 0 else default_threads)

    # sys.path as ``python`` builds it for this run: its own first entry and PYTHONPATH, then the rest
    extra = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    kind, target, args = request["kind"], request["target"], request["args"]
    first = os.path.dirname(os.path.abspath(target)) if kind == "script" else os.getcwd() if kind == "module" else ""
    sys.path[:] = [first, *extra, *base_path]
    import atexit
    import gc

    def collect_all():  # registered first, so it runs last
        if "triton" in sys.modules:  # its nanobind bindings report the frozen objects as leaks at exit
            gc.unfreeze()

    atexit.register(collect_all)
    if kind == "script":
        sys.argv = [target, *args]
        runpy.run_path(target, run_name="__main__")
    elif kind == "module":
        sys.argv = [target, *args]  # runpy puts the module's file here, as ``python -m`` does
        sys.modules.pop(target, None)  # imported here already: ``python -m`` runs it fresh as __main__
        runpy.run_module(target, run_name="__main__", alter_sys=True)
    else:
        sys.argv = ["-c", *args]
        exec(compile(target, "<string>", "exec"), {"__name__": "__main__", "__builtins__": __builtins__})
    return 0


def serve(path: str):
    """Accept requests until SIGTERM; returns in a forked child with the child's work to do."""
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(64)
    selector = selectors.DefaultSelector()
    selector.register(listener, selectors.EVENT_READ)
    wake_read, wake_write = os.pipe()
    os.set_blocking(wake_read, False)
    os.set_blocking(wake_write, False)
    selector.register(wake_read, selectors.EVENT_READ)
    signal.set_wakeup_fd(wake_write)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    stopping = []
    signal.signal(signal.SIGTERM, lambda *_: stopping.append(True))
    children = {}  # pid -> client connection

    parent = os.getppid()
    while not stopping and os.getppid() == parent:  # ends with the pytest process that started it
        for key, _ in selector.select(timeout=1.0):
            if key.fileobj is listener:
                conn, _ = listener.accept()
                try:
                    request, fds = recv_request(conn)
                except OSError:
                    conn.close()
                    continue
                if request is None:
                    for fd in fds:
                        os.close(fd)
                    conn.close()
                    continue
                sys.stdout.flush()
                sys.stderr.flush()
                pid = os.fork()
                if pid == 0:  # the child: drop the server's state, run the request
                    signal.set_wakeup_fd(-1)
                    for sig in (signal.SIGCHLD, signal.SIGTERM):
                        signal.signal(sig, signal.SIG_DFL)
                    signal.signal(signal.SIGINT, signal.default_int_handler)
                    selector.close()
                    listener.close()
                    for other in children.values():
                        other.close()
                    os.close(wake_read)
                    os.close(wake_write)
                    conn.close()
                    return request, fds
                for fd in fds:
                    os.close(fd)
                children[pid] = conn
                selector.register(conn, selectors.EVENT_READ, pid)
                try:
                    send_message(conn, {"pid": pid})
                except OSError:
                    pass
            elif key.fileobj is wake_read:
                try:
                    while os.read(wake_read, 512):
                        pass
                except BlockingIOError:
                    pass
            else:  # a client wrote or went away: it never writes, so it went away
                pid = key.data
                selector.unregister(key.fileobj)
                if pid in children:
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
        while children:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            conn = children.pop(pid, None)
            if conn is not None:
                try:
                    send_message(conn, {"status": status})
                except OSError:
                    pass
                try:
                    selector.unregister(conn)
                except (KeyError, ValueError):
                    pass
                conn.close()
    for pid in children:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    try:
        os.unlink(path)
    except OSError:
        pass
    return None


def main():
    path = sys.argv[1]
    import importlib
    import warnings

    # numpy's OpenBLAS starts its thread pool on import and rebuilds it after a fork (pthread_atfork);
    # no other thread may exist when the server forks: its state would be lost in the child
    import numpy  # noqa: F401

    allowed = len(os.listdir("/proc/self/task"))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # import-time warnings belong to each run, which imports nothing again
        for name in PRELOAD:
            try:
                importlib.import_module(name)
            except Exception:  # an optional package missing: its runs import it themselves
                pass
    import torch

    default_threads = torch.get_num_threads()  # this server's environment sets none: torch's default
    # sys.path without this file's folder and the server's PYTHONPATH: each run puts its own first
    own = {p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p}
    base_path = [p for p in sys.path[1:] if p not in own]
    threads = len(os.listdir("/proc/self/task"))
    if threads != allowed:
        print(f"zygote: {threads} threads after the imports (numpy's: {allowed}); not serving", file=sys.stderr)
        return 3
    import gc

    gc.freeze()  # the imports' objects: no child's collector walks them (or copies their pages)
    work = serve(path)
    if work is None:
        return 0
    request, fds = work
    del work
    return run_child(request, fds, default_threads, base_path)


if __name__ == "__main__":
    sys.exit(main())
