"""Hosting PyTriton models safely: library path, ports, workspace, signals, clean shutdown."""

from __future__ import annotations

import importlib.util
import logging
import os
import re
import shutil
import signal
import sysconfig
import tempfile
import threading
import time
import warnings
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from typing import Callable, Dict, Iterator, Optional

from nemo_aligner.servers.request_guard import ModelLimits, RequestGuard
from nemo_aligner.utils.errors import AlignerError, ConfigError, ServerError
from nemo_aligner.utils.ports import check_bindable

logger = logging.getLogger(__name__)


@dataclass
class ServerAddress:
    """Where a server listens: ``host`` and its HTTP, gRPC and metrics ports."""

    host: str
    http_port: int
    grpc_port: int
    metrics_port: int

    @property
    def url(self) -> str:
        return f"{self.host}:{self.http_port}"


def server_address(cfg, key: str) -> ServerAddress:
    """``<key>.{host, port, grpc_port, metrics_port}``; unset gRPC/metrics ports are ``port + 1000/2000``."""
    host = str(cfg.get("host") or "127.0.0.1")
    if cfg.get("port") is None:
        raise ConfigError(f"{key}.port is required")
    port = int(cfg.port)
    grpc = int(cfg.get("grpc_port") or port + 1000)
    metrics = int(cfg.get("metrics_port") or port + 2000)
    ports = {"port": port, "grpc_port": grpc, "metrics_port": metrics}
    if len(set(ports.values())) != 3:
        raise ConfigError(f"{key}: port, grpc_port and metrics_port must differ, got {ports}")
    for name, value in ports.items():
        if not 0 < value < 65536:
            raise ConfigError(f"{key}.{name}={value} is not a valid port")
    return ServerAddress(host, port, grpc, metrics)


def check_ports_free(address: ServerAddress, key: str) -> None:
    """Fail at once, naming the port, instead of PyTriton's misleading error ~7 s later."""
    check_bindable(address.host, {"port": address.http_port, "grpc_port": address.grpc_port,
                                  "metrics_port": address.metrics_port}, key)


def prepare_library_path() -> None:
    """Put this Python's LIBDIR and PyTriton's bundled libraries first on ``LD_LIBRARY_PATH``.

    Under pyenv (and other non-system Pythons) the backend otherwise loads the system
    libpython and every model load fails with an RLock attribute error.
    """
    wanted = [d for d in (sysconfig.get_config_var("LIBDIR"), pytriton_libs_dir()) if d]
    current = [d for d in os.environ.get("LD_LIBRARY_PATH", "").split(os.pathsep) if d]
    if current[:len(wanted)] != wanted:
        os.environ["LD_LIBRARY_PATH"] = os.pathsep.join(wanted + [d for d in current if d not in wanted])


def pytriton_libs_dir() -> Optional[str]:
    """The libraries PyTriton's wheel bundles (``nvidia_pytriton.libs`` beside ``pytriton``), or None.

    PyTriton looks for them only when it is installed in one of this Python's site-packages; installed
    elsewhere (``pip install --target``, a directory on ``PYTHONPATH``) it takes itself for a source
    checkout, and ``tritonserver`` fails to load libcudart."""
    spec = importlib.util.find_spec("pytriton")
    if spec is None or not spec.submodule_search_locations:
        return None
    libs = os.path.join(os.path.dirname(list(spec.submodule_search_locations)[0]), "nvidia_pytriton.libs")
    return libs if os.path.isdir(libs) else None


# PyTriton puts unix sockets in its workspace; their paths must stay under ~108 bytes.
_MAX_WORKSPACE_PATH = 60


@contextmanager
def workspace(base_dir: Optional[str]) -> Iterator[str]:
    """A fresh PyTriton workspace (and ``PYTRITON_HOME``) under ``base_dir``, removed on exit."""
    if base_dir:
        os.makedirs(base_dir, exist_ok=True)
        if len(os.path.abspath(base_dir)) > _MAX_WORKSPACE_PATH:
            logger.warning("workspace_dir %s is too long for PyTriton's sockets; using %s instead",
                           base_dir, tempfile.gettempdir())
            base_dir = None
    # The pid in the name lets a later server tell a killed one's workspace (servers/leftovers.py).
    parent = tempfile.mkdtemp(prefix=f"pytriton_{os.getpid()}_", dir=base_dir)
    previous = os.environ.get("PYTRITON_HOME")
    os.environ["PYTRITON_HOME"] = os.path.join(parent, "home")
    try:
        yield os.path.join(parent, "workspace")
    finally:
        if previous is None:
            os.environ.pop("PYTRITON_HOME", None)
        else:
            os.environ["PYTRITON_HOME"] = previous
        shutil.rmtree(parent, ignore_errors=True)


LOOPBACK = "127.0.0.1"


@contextmanager
def _guarded(address: ServerAddress, backend_port: int, limits: Dict[str, ModelLimits], key: str) -> Iterator[None]:
    try:
        guard = RequestGuard(address.host or "0.0.0.0", address.http_port, backend_port, limits).start()
    except OSError as err:
        raise ConfigError(f"{key}.port={address.http_port} on {address.host}: cannot listen ({err.strerror})") from None
    try:
        yield
    finally:
        guard.close()


@dataclass
class StopSignal:
    """Whether a stop signal arrived (as opposed to serving ending because Triton died), and
    whether serving has begun (from then on a signal only sets ``received``)."""

    received: bool = False
    serving: bool = False


@contextmanager
def stop_on_signals(stop_on_sigterm: Optional[Callable[[], bool]] = None) -> Iterator[StopSignal]:
    """Note SIGTERM and SIGINT in the returned :class:`StopSignal`, which ends :func:`serve_until_stopped`.

    Before serving begins, the first signal also raises ``KeyboardInterrupt``, so a start-up stops at
    once. Once serving, nothing is raised: an exception raised from a signal handler lands in
    whatever runs at that moment (a finalizer, the shutdown's clean-up), where it is lost or cuts
    the clean-up short. Signals after the first are ignored for the same reason (the shutdown is
    under way). ``stop_on_sigterm``: asked on SIGTERM whether to stop now; False leaves the stop to
    the caller (which then sends SIGINT).
    """

    state = StopSignal()

    def note(signum, frame):
        if state.received:
            return
        if signum == signal.SIGTERM and stop_on_sigterm is not None and not stop_on_sigterm():
            return
        state.received = True
        if not state.serving:
            raise KeyboardInterrupt(f"signal {signum}")

    previous = {sig: signal.signal(sig, note) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield state
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def serve_until_stopped(triton, stop: StopSignal, poll_s: float = 0.2) -> None:
    """Serve until ``stop`` notes a signal or tritonserver or a model proxy dies (what
    ``Triton.serve()`` waits for, without its need of a ``KeyboardInterrupt`` to return)."""
    stop.serving = True
    while not stop.received and triton.is_alive():
        time.sleep(poll_s)


# The modules whose ``wait_for_server_ready`` PyTriton 0.7 calls (waiting up to 120 s for tritonserver
# to become ready) while starting it and while binding models (the model manager's ``ModelClient``, and
# ``wait_for_model_ready``, which waits 60 s for the bound models).
_READINESS_WAIT_MODULES = ("pytriton.triton", "pytriton.models.manager", "pytriton.client.client",
                           "pytriton.client.utils")


def _exited_tritonserver(triton, wait_s: float = 0.0):
    """``triton``'s tritonserver process when it was started and has exited since (waiting up to
    ``wait_s`` for it to go), else None (also where this PyTriton keeps it under other names: the
    check then never fires)."""
    server = getattr(triton, "_triton_server", None)
    if getattr(server, "_tritonserver_running_cmd", None) is None:
        return None
    deadline = time.monotonic() + wait_s
    while server.is_alive():
        if time.monotonic() >= deadline:
            return None
        time.sleep(0.05)
    return server


# Error records tritonserver writes on every CPU start, whatever follows: never the reason it exited.
_TRITON_NOISE = ("CudaDriverHelper has not been initialized", "Failed to set config modification time",
                 "Failed to initialize NVML")


def _exit_reason(server, log_file: str, lines: int = 3) -> str:
    """The error lines of an exited tritonserver (its log file, then its output), for one message."""
    text = ""
    try:
        with open(log_file, errors="replace") as f:
            text = f.read()[-20000:]
    except OSError:
        pass
    try:
        text += "\n" + (server.logs() or "")[-20000:]
    except Exception:  # its output is a courtesy in the message, never a second error
        pass
    found = [line.strip() for line in text.splitlines() if line.strip() and not any(n in line for n in _TRITON_NOISE)
             and not re.match(r"\s*\d+# ", line)]  # nor the frames of the backtrace it prints on a crash
    # Triton's own error records first (the first is the cause), then its command-line complaints and
    # what it says on a crash (an uncaught C++ exception, the signal)
    logged = [line for line in found if re.match(r"E\d{4} ", line)][:lines]
    said = [line for line in found if re.match(
        r"(error|bad option|fail|terminate called|what\(\)|signal \(\d+\) received)", line, re.I)][-lines:]
    picked = [line[:300] for line in (logged or said or found[-lines:])]
    return ": " + " | ".join(picked) if picked else ""


def _exit_code(server) -> Optional[int]:
    """An exited tritonserver's exit code (negative: the signal that killed it), where known."""
    try:
        code = server._tritonserver_running_cmd.process.exit_code
    except Exception:  # another PyTriton or sh keeps it elsewhere
        return None
    return code if isinstance(code, int) else None


def _exit_status(server) -> str:
    """`` (killed by signal N)`` or `` (exit status N)`` of an exited tritonserver, where known."""
    code = _exit_code(server)
    if not code:
        return ""
    return f" (killed by signal {-code})" if code < 0 else f" (exit status {code})"


def _exit_details(server, log_file: str, log_note: str) -> str:
    """An exited tritonserver's status, where its log is kept, and its error lines, for one message."""
    return f"{_exit_status(server)}{log_note}{_exit_reason(server, log_file)}"


class CrashedWhileStarting(ServerError):
    """tritonserver crashed (aborted, segfaulted) while starting or loading the models."""


# Crashes a second start may not repeat: the Python backend aborts now and then when several model
# processes start on a few busy cores (boost::interprocess::lock_exception while finalizing a model
# instance whose stub missed its health check). Not SIGKILL (the OOM killer, a user) nor SIGTERM/SIGINT.
_TRANSIENT_CRASH_SIGNALS = (signal.SIGABRT, signal.SIGSEGV, signal.SIGBUS)


def _start_failure(server, description: str, log_file: str, log_note: str) -> ServerError:
    """The one-line error for a tritonserver that exited while starting."""
    code = _exit_code(server)
    kind = CrashedWhileStarting if code is not None and -code in _TRANSIENT_CRASH_SIGNALS else ServerError
    return kind(f"{description}: tritonserver exited while starting{_exit_details(server, log_file, log_note)}")


@contextmanager
def fail_fast_on_triton_exit(triton, description: str, log_file: str, log_note: str = "") -> Iterator[None]:
    """While ``Triton`` starts and binds models: a tritonserver that exits (a bad option, a missing
    library, a port taken in the meantime, a crash while loading a model) ends PyTriton's readiness
    wait within a second, or the model load whose connection it closed, with a :class:`ServerError`
    quoting its errors (from ``log_file`` and its output; ``log_note`` names a log that outlives the
    server), instead of after PyTriton's 120 s timeout or with the HTTP client's traceback."""
    from pytriton.client.exceptions import PyTritonClientTimeoutError
    from pytriton.client.warnings import NotSupportedTimeoutWarning

    patched = []
    for module_name in _READINESS_WAIT_MODULES:
        module = importlib.import_module(module_name)
        original = getattr(module, "wait_for_server_ready", None)
        if original is None:
            continue

        def wait(client, timeout_s=None, headers=None, _original=original):
            deadline = time.monotonic() + (timeout_s if timeout_s is not None else 120.0)
            while True:
                remaining = deadline - time.monotonic()
                try:
                    with warnings.catch_warnings():  # it warns when a step is shorter than the client's timeout
                        warnings.simplefilter("ignore", NotSupportedTimeoutWarning)
                        return _original(client, timeout_s=max(0.0, min(1.0, remaining)), headers=headers)
                except PyTritonClientTimeoutError:
                    server = _exited_tritonserver(triton)
                    if server is not None:
                        raise _start_failure(server, description, log_file, log_note) from None
                    if remaining <= 1.0:
                        raise

        module.wait_for_server_ready = wait
        patched.append((module, original))
    try:
        yield
    except AlignerError:  # ours, already one line (a bad model binding, the readiness wait above)
        raise
    except Exception:
        # a request to a tritonserver that died under it fails as it goes (connection closed or refused)
        server = _exited_tritonserver(triton, wait_s=1.0)
        if server is None:
            raise
        raise _start_failure(server, description, log_file, log_note) from None
    finally:
        for module, original in patched:
            module.wait_for_server_ready = original


@contextmanager
def on_tritonserver_exit(triton, action: Callable[[], object], poll_s: float = 0.1) -> Iterator[None]:
    """Run ``action`` once, from a watcher thread, as soon as ``triton``'s tritonserver has exited.

    A tritonserver that crashes can leave its Python-backend stubs running; they hold its sockets, so a
    request in flight (a model load) would wait for the client's 60 s timeout instead of failing."""
    done = threading.Event()

    def watch():
        while not done.wait(poll_s):
            if _exited_tritonserver(triton) is not None:
                action()
                return

    watcher = threading.Thread(target=watch, name="tritonserver-exit-watch", daemon=True)
    watcher.start()
    try:
        yield
    finally:
        done.set()
        watcher.join()


def _quiet_tritonserver_output(triton) -> None:
    """Keep tritonserver's stdout/stderr out of ours (PyTriton prints every line by default).

    Its log records go to its log file; what it prints besides is noise on every start on a machine
    without a GPU (``Error: Failed to initialize NVML``), ``Signal (2) received.`` at every stop, and
    a crash's backtrace, whose message lines the server's error quotes (PyTriton still keeps the
    output for that)."""
    init = getattr(triton, "_initialize_server", None)
    if init is None or getattr(triton, "_triton_server", None) is not None:
        return  # another PyTriton: its output stays as it is
    init()
    if hasattr(triton._triton_server, "_verbose"):
        triton._triton_server._verbose = False


def _ignore_workspace_cleanup_warnings() -> None:
    """PyTriton warns when it cannot empty its workspace: after a failed start, and when tritonserver
    exits by itself, where PyTriton's exit callback stops it from another thread (outside any
    ``catch_warnings`` block, hence a process-wide filter). :func:`workspace` removes the whole
    directory either way, so the warning would only trail the server's own one-line error."""
    warnings.filterwarnings("ignore", message="Could not clean workspace")


def serve_forever(address: ServerAddress, bind, description: str, key: str, limits: Dict[str, ModelLimits],
                  workspace_dir: Optional[str] = None, triton_log_file: Optional[str] = None,
                  stop_on_sigterm: Optional[Callable[[], bool]] = None) -> None:
    """Rank 0: start Triton, ``bind(triton)`` the models, serve until SIGTERM/SIGINT (see
    :func:`stop_on_signals` for ``stop_on_sigterm``).

    HTTP requests reach ``address`` through a :class:`RequestGuard` that refuses requests beyond
    ``limits`` (per model name); tritonserver's own HTTP, gRPC and metrics ports listen on
    127.0.0.1 only (gRPC and metrics on the configured ports). A tritonserver that crashes while
    starting (:class:`CrashedWhileStarting`) is started once more, in a fresh workspace, with a warning.

    Returns after a clean shutdown; the workspace is removed. The caller tells the other
    ranks to stop (``ServerSignal.EXIT``) afterwards.
    """
    from nemo_aligner.servers.leftovers import remove_stale

    check_ports_free(address, key)
    remove_stale([workspace_dir] if workspace_dir else [])
    prepare_library_path()
    _ignore_workspace_cleanup_warnings()
    with stop_on_signals(stop_on_sigterm) as stop:
        try:
            _start_and_serve(address, bind, description, key, limits, workspace_dir, triton_log_file, stop)
            return
        except CrashedWhileStarting as crash:
            logger.warning("%s; starting it once more", crash)
        _start_and_serve(address, bind, description, key, limits, workspace_dir, triton_log_file, stop)


def _start_and_serve(address: ServerAddress, bind, description: str, key: str, limits: Dict[str, ModelLimits],
                     workspace_dir: Optional[str], triton_log_file: Optional[str], stop: StopSignal) -> None:
    """One start of tritonserver in a fresh workspace, serving until ``stop`` (see :func:`serve_forever`)."""
    from pytriton.triton import Triton, TritonConfig

    from nemo_aligner.servers.leftovers import kill_stubs_under
    from nemo_aligner.utils.ports import free_port

    backend_port = free_port(bound_at_once=True)  # tritonserver starts next
    with workspace(workspace_dir) as ws:
        # the default log lives in the workspace, removed on exit: messages quote it instead of naming it
        log_file = triton_log_file or os.path.join(os.path.dirname(ws), "tritonserver.log")
        log_note = f" (log: {triton_log_file})" if triton_log_file else ""
        config = TritonConfig(http_address=LOOPBACK, http_port=backend_port, grpc_address=LOOPBACK,
                              grpc_port=address.grpc_port, metrics_address=LOOPBACK,
                              metrics_port=address.metrics_port, log_verbose=0, log_file=log_file,
                              exit_timeout_secs=5)
        with ExitStack() as stack:
            stubs_left = lambda: kill_stubs_under(os.path.dirname(ws))  # noqa: E731  (of a crashed tritonserver)
            stack.callback(stubs_left)
            triton = Triton(config=config, workspace=ws)
            _quiet_tritonserver_output(triton)
            stack.callback(triton.stop)  # its __exit__; also after a failed start
            stack.enter_context(on_tritonserver_exit(triton, stubs_left))
            with fail_fast_on_triton_exit(triton, description, log_file, log_note):
                triton.__enter__()  # starts tritonserver
                stack.enter_context(_guarded(address, backend_port, limits, key))
                bind(triton)
            stop.serving = True  # from here a signal only ends serving (no KeyboardInterrupt)
            print(f"{description} ready on {address.url} (grpc {address.grpc_port}, metrics {address.metrics_port})",
                  flush=True)
            serve_until_stopped(triton, stop)
            if not stop.received:
                raise ServerError(f"{description} on {address.url}: Triton stopped serving without a stop signal "
                                  f"(its process died)"
                                  f"{_exit_details(getattr(triton, '_triton_server', None), log_file, log_note)}")
