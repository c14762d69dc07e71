"""Start a script's ranks itself for ``trainer.devices=N``, as NeMo (through Lightning) does.

``python train_gpt_sft.py trainer.devices=4 ...`` run by hand (no torchrun, srun or mpirun around
it) re-runs the same command line in 4 worker processes under torch's elastic launcher, the engine
behind ``torchrun``; the first process only supervises them and exits with the workers' status.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
import tempfile
import threading
import uuid
from typing import List, Optional

from nemo_aligner.utils.errors import ConfigError
from nemo_aligner.utils.launch_info import read_launch_info
from nemo_aligner.utils.ports import free_port

logger = logging.getLogger(__name__)


def ranks_to_start(devices, num_nodes, gpus: Optional[int] = None) -> int:
    """How many local ranks ``trainer.devices`` x ``trainer.num_nodes`` asks this process to start;
    1 means run in this process. ``devices`` -1/"auto" means every visible GPU (1 on the CPU)."""
    nodes = 1 if num_nodes in (None, "") else num_nodes
    if isinstance(nodes, bool) or not isinstance(nodes, int) or nodes < 1:
        raise ConfigError(f"trainer.num_nodes={num_nodes!r} must be a positive integer")
    if devices is None or devices == -1 or (isinstance(devices, str) and devices.lower() == "auto"):
        if gpus is None:
            import torch

            gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
        count = max(int(gpus), 1)
    elif isinstance(devices, bool) or not isinstance(devices, int) or devices < 1:
        raise ConfigError(f"trainer.devices={devices!r} must be a positive integer, -1 or auto")
    else:
        count = devices
    if nodes > 1 and count * nodes > 1:
        raise ConfigError(f"trainer.num_nodes={nodes}: start the ranks on every node with srun, torchrun or mpirun "
                          "(a script started by hand starts ranks only on its own node)")
    return count


def set_threads_per_process(processes: int, environ=None) -> None:
    """``OMP_NUM_THREADS`` (torch's intra-op threads) to the available cores over ``processes`` when it
    is not set already, as torchrun does: oversubscribed cores cost more than they overlap."""
    env = os.environ if environ is None else environ
    if not env.get("OMP_NUM_THREADS"):
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        env["OMP_NUM_THREADS"] = str(max(1, cores // max(1, processes)))


def launched_by_a_launcher(environ=None) -> bool:
    """Whether torchrun, srun (more than one task) or mpirun started this process."""
    return read_launch_info(environ).launcher != "single"


def worker_command(argv: Optional[List[str]] = None) -> List[str]:
    """The command each worker runs: this interpreter on the same script and arguments."""
    argv = list(sys.argv if argv is None else argv)
    main = sys.modules.get("__main__")
    spec = getattr(main, "__spec__", None)
    if spec is not None and spec.name and spec.name != "__main__":  # started as ``python -m pkg.module``
        return ["-u", "-m", spec.name, *argv[1:]]
    return ["-u", os.path.abspath(argv[0]), *argv[1:]]


def _child_pids() -> List[int]:
    """The processes this one started (its ranks), from /proc."""
    me, children = os.getpid(), []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat", encoding="utf-8") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):  # gone meanwhile
                continue
            if ppid == me:
                children.append(int(entry))
    return children


# Stop signals the supervising process passes on to the ranks and then keeps waiting for them; the
# ones torch's agent handles (it stops the ranks: the signal passed on, SIGKILL after 30 s).
_PASSED_ON = (signal.SIGTERM, signal.SIGUSR1)
_AGENT_SIGNALS = "SIGINT,SIGHUP,SIGQUIT"


@contextlib.contextmanager
def ranks_finish_their_stop():
    """SIGTERM or SIGUSR1 to the supervising process go on to the ranks, which finish their step, save a
    checkpoint and exit 0; this process keeps waiting for them (however long the save takes) and exits
    with their status, as a single-process run does. A second SIGTERM stops them as torch's agent does
    (the signal passed on, SIGKILL after 30 s). Torch's agent keeps SIGINT/SIGHUP/SIGQUIT (Ctrl-C). Where
    the agent cannot leave SIGTERM alone (a torch that reads neither ``LaunchConfig.signals_to_handle``
    nor ``TORCHELASTIC_SIGNALS_TO_HANDLE``) or /proc is absent, the agent's own handling applies."""
    from torch.distributed.elastic.multiprocessing.api import SignalException

    if not os.path.isdir("/proc") or threading.current_thread() is not threading.main_thread():
        yield
        return
    passed = set()

    def pass_on(signum, frame):
        children = _child_pids()
        if not children or (signum == signal.SIGTERM and signum in passed):  # no ranks (yet), or a second SIGTERM
            raise SignalException(f"Process {os.getpid()} got signal: {signal.Signals(signum)}",
                                  sigval=signal.Signals(signum))
        passed.add(signum)
        for pid in children:
            try:
                os.kill(pid, signum)
            except ProcessLookupError:
                pass

    previous_env = os.environ.get("TORCHELASTIC_SIGNALS_TO_HANDLE")
    os.environ["TORCHELASTIC_SIGNALS_TO_HANDLE"] = _AGENT_SIGNALS
    previous = {sig: signal.signal(sig, pass_on) for sig in _PASSED_ON}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        if previous_env is None:
            os.environ.pop("TORCHELASTIC_SIGNALS_TO_HANDLE", None)
        else:
            os.environ["TORCHELASTIC_SIGNALS_TO_HANDLE"] = previous_env


def agent_takes_signal_list() -> bool:
    """Whether torch's elastic agent takes the signals it handles as a setting (torch 2.9 and newer), so
    that SIGTERM/SIGUSR1 can be left to ``ranks_finish_their_stop``."""
    from torch.distributed.launcher.api import LaunchConfig

    return "signals_to_handle" in LaunchConfig.__dataclass_fields__


def spawn_ranks(nproc: int, argv: Optional[List[str]] = None) -> int:
    """Run ``nproc`` copies of this command under torch's elastic agent on this machine; returns the
    exit status for this (supervising) process: 0, or the first failed worker's code."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    from nemo_aligner.utils.patches.rendezvous_store import stores_bound_to_their_host

    set_threads_per_process(nproc)
    for name in ("torch.distributed.elastic", "torch.distributed.launcher"):
        # The agent's own start-up chatter and, on a failure, its traceback-style summary: a worker
        # that fails has already printed its one-line error.
        logging.getLogger(name).setLevel(logging.CRITICAL)
    os.environ["NEMO_ALIGNER_SPAWNED"] = "1"  # the ranks: start-up warnings were printed here already
    extra = {"local_addr": "127.0.0.1"} if "local_addr" in LaunchConfig.__dataclass_fields__ else {}
    if agent_takes_signal_list():  # else read from the environment
        extra["signals_to_handle"] = _AGENT_SIGNALS
    # The agent's per-rank error files go to a directory removed afterwards (torch's default leaves
    # a /tmp/torchelastic_* directory behind per run); a failed rank has printed its error already.
    logs = tempfile.TemporaryDirectory(prefix="nemo_aligner_ranks_")
    if "logs_specs" in LaunchConfig.__dataclass_fields__:
        from torch.distributed.elastic.multiprocessing.api import DefaultLogsSpecs

        extra["logs_specs"] = DefaultLogsSpecs(log_dir=logs.name)
    config = LaunchConfig(
        **extra,  # the ranks reach the agent's store on 127.0.0.1, where it listens (not this host's name)
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=nproc,
        run_id=f"nemo-aligner-{uuid.uuid4().hex[:12]}",
        rdzv_backend="c10d",
        rdzv_endpoint=f"127.0.0.1:{free_port(bound_at_once=True)}",
        rdzv_configs={"is_host": True},
        max_restarts=0,
        monitor_interval=0.2,
    )
    try:
        with stores_bound_to_their_host() as shared, ranks_finish_their_stop():
            # The agent's store, already listening, is the ranks' MASTER_PORT: no port is chosen,
            # released and bound again later (another process may take it in between).
            if not shared:
                os.environ["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
            # PYTHON_EXEC: the ranks' interpreter, as torchrun reads it
            elastic_launch(config, entrypoint=os.environ.get("PYTHON_EXEC") or sys.executable)(*worker_command(argv))
    except ChildFailedError as err:
        codes = [failure.exitcode for _, failure in sorted(err.failures.items())]
        code = next((c for c in codes if c and c > 0), 1)
        return code
    except SignalException as err:  # SIGTERM/SIGINT/...: the agent passed it on to the ranks (30 s to finish)
        return 128 + int(err.sigval)
    except KeyboardInterrupt:
        return 130
    finally:
        logs.cleanup()
    return 0


def maybe_spawn(trainer_cfg, argv: Optional[List[str]] = None, model_cfg=None) -> Optional[int]:
    """Start the ranks ``trainer.devices`` asks for when no launcher started this process.

    Returns the exit status to leave with when it did (this process only supervised), or None to run
    the job in this process (one rank, or a launcher already started the ranks). ``model_cfg``: its
    TP x PP must divide the ranks' number, checked before any starts."""
    if launched_by_a_launcher():
        return None
    devices = trainer_cfg.get("devices", 1) if trainer_cfg is not None else 1
    num_nodes = trainer_cfg.get("num_nodes", 1) if trainer_cfg is not None else 1
    nproc = ranks_to_start(devices, num_nodes)
    if nproc <= 1:
        return None
    if model_cfg is not None:
        from nemo_aligner.utils.distributed import check_divisible

        sizes = [model_cfg.get(key, 1) for key in ("tensor_model_parallel_size", "pipeline_model_parallel_size")]
        if all(isinstance(size, int) and not isinstance(size, bool) for size in sizes):
            check_divisible(nproc, *(size or 1 for size in sizes), what=f"trainer.devices={devices} ({nproc} ranks)")
    logger.info("starting %d ranks on this machine (trainer.devices=%s)", nproc, devices)
    return spawn_ranks(nproc, argv)
