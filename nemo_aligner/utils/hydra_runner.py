"""``@hydra_runner``: Hydra's entry point the NeMo way, plus one-line reports of user errors."""

from __future__ import annotations

import functools
import logging
import os
import signal
import sys
import time
from typing import Callable, List, Optional, Tuple

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import MissingMandatoryValue

from nemo_aligner.utils.errors import AlignerError, ConfigError
from nemo_aligner.utils.self_launch import maybe_spawn

# NeMo's config resolvers, so NeMo yaml files and overrides resolve unchanged.
OmegaConf.register_new_resolver("multiply", lambda x, y: x * y, replace=True)
OmegaConf.register_new_resolver("int_div", lambda x, y: x // y, replace=True)
OmegaConf.register_new_resolver("subtract", lambda x, y: x - y, replace=True)

# Run in the current directory and leave no .hydra/ folders or Hydra log files behind.
_HYDRA_DEFAULTS = ["hydra.run.dir=.", "hydra.output_subdir=null", "hydra/job_logging=none", "hydra/hydra_logging=none"]


_OTHER_RANK_EXIT_DELAY_S = 3.0


def _rank() -> Optional[int]:
    import torch.distributed as dist

    if dist.is_initialized():
        return dist.get_rank()
    return int(os.environ["RANK"]) if os.environ.get("RANK", "").isdigit() else None


def report_interrupt() -> None:
    """Ctrl-C (SIGINT): one line from rank 0, no traceback, exit status 130 (128 + SIGINT) on every
    rank. Nothing is saved; SIGTERM is the signal that stops a trainer after its step with a checkpoint."""
    try:  # a second Ctrl-C (or a launcher passing it on) while leaving
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    except ValueError:  # not the main thread
        pass
    if _rank() in (None, 0):
        print("interrupted (Ctrl-C): stopped without saving; to stop a trainer after its current step with a "
              "checkpoint, send SIGTERM instead (kill <pid>)", file=sys.stderr, flush=True)
    _leave(130)


def report_user_error(err: Exception) -> None:
    """Print ``error: ...`` without a traceback and exit 1 (all ranks, so torchrun stops the job)."""
    rank = _rank()
    prefix = f"[rank {rank}] " if rank not in (None, 0) else ""
    print(f"{prefix}error: {err}", file=sys.stderr, flush=True)
    _leave(1, rank)


def _leave(status: int, rank: Optional[int] = None) -> None:
    import torch.distributed as dist

    if dist.is_initialized() and dist.get_world_size() > 1:
        # Other ranks may be waiting in a collective; leave so the launcher tears the job down. A rank
        # other than 0 waits a moment first: rank 0 usually meets the same error a little later (it
        # alone sets up the loggers), and the launcher stops every rank as soon as one exits, which
        # would leave only the "[rank N]" line.
        sys.stdout.flush()
        if rank not in (None, 0):
            time.sleep(_OTHER_RANK_EXIT_DELAY_S)
        os._exit(status)
    sys.exit(status)


def run_cli(main: Callable[[], object]) -> None:
    """Run an argparse script's ``main()``; a user error becomes one ``error:`` line and exit status 1."""
    try:
        main()
    except AlignerError as err:
        report_user_error(err)
    except KeyboardInterrupt:
        report_interrupt()


# Hydra's command-line flags and whether each takes a value (``--cfg`` and ``--info`` may or may not).
_FLAGS_WITH_VALUE = {"--config-path", "-cp", "--config-name", "-cn", "--config-dir", "-cd", "--package", "-p",
                     "--experimental-rerun"}
_FLAGS_OPTIONAL_VALUE = {"--cfg": {"job", "hydra", "all"}, "-c": {"job", "hydra", "all"},
                         "--info": {"all", "config", "defaults", "defaults-tree", "plugins", "searchpath"},
                         "-i": {"all", "config", "defaults", "defaults-tree", "plugins", "searchpath"}}


def split_hydra_flags(args: List[str]) -> Tuple[List[str], List[str]]:
    """Separate Hydra's ``--flags`` (with their values) from the ``key=value`` overrides, keeping each
    group's order, so they can be passed as ``flags + overrides`` whatever order the user wrote."""
    flags: List[str] = []
    overrides: List[str] = []
    i = 0
    while i < len(args):
        arg = args[i]
        if not arg.startswith("-"):  # an override (``key=value``, ``++key=value``, ``~key``)
            overrides.append(arg)
        else:
            flags.append(arg)
            nxt = args[i + 1] if i + 1 < len(args) else None
            if "=" not in arg and nxt is not None and (
                    arg in _FLAGS_WITH_VALUE or nxt in _FLAGS_OPTIONAL_VALUE.get(arg, ())):
                flags.append(nxt)
                i += 1
        i += 1
    return flags, overrides


def prepare_config(cfg: DictConfig, config_name: str, args: List[str], extra_keys=(),
                   config_dir: Optional[str] = None) -> DictConfig:
    """NeMo-Aligner's keys on the composed config: a user's own config file gets this project's
    shipped config of the same script underneath (keys it lacks take our defaults); aliases are
    resolved; near misses of real keys are refused and keys nothing reads are warned about (once:
    rank 0, and not again in the ranks ``trainer.devices`` starts). ``config_dir``: the script's config
    directory (default: examples/nlp/gpt/conf)."""
    from nemo_aligner.utils import config_keys, cpu_gemm, cpu_kernels, decode_buffers
    from nemo_aligner.utils.exp_manager import setup_console_logging

    setup_console_logging()
    # The CPU kernel settings are read deep inside the first forward: refuse a bad one before any work.
    cpu_kernels.mode()
    cpu_gemm.requested_backend()
    decode_buffers.keep_requested()
    flags, overrides = split_hydra_flags(args)
    try:
        shipped = config_keys.load_shipped(config_name, config_dir)
    except (OSError, ValueError):  # no shipped config of that name (an installed copy without examples)
        shipped = None
    if shipped is not None and any(f.split("=")[0] in ("--config-path", "-cp", "--config-dir", "-cd", "--config-name",
                                                       "-cn") for f in flags):
        OmegaConf.set_struct(shipped, False)
        OmegaConf.set_struct(cfg, False)
        cfg = OmegaConf.merge(shipped, cfg)
        OmegaConf.set_struct(cfg, True)
    config_keys.resolve_aliases(cfg)
    from nemo_aligner.utils.launch_info import read_launch_info

    warn = os.environ.get("NEMO_ALIGNER_SPAWNED") != "1" and read_launch_info().rank == 0
    config_keys.check_keys(cfg, config_name, overrides, warn=warn, shipped=shipped, extra_keys=extra_keys)
    from nemo_aligner.utils.model_config import record_command_line

    record_command_line(config_keys.override_keys(overrides))
    return cfg


def release_process_group() -> None:
    """Tear down the process group of a finished run before the interpreter exits, as torch asks
    (NCCL warns otherwise): one left to the exit's teardown can abort a rank after its work is done
    ("terminate called without an active exception", exit status -6)."""
    from nemo_aligner.utils.distributed import destroy

    try:
        destroy()
    except Exception as err:  # the run's work is done and saved: say so, and exit 0
        logging.getLogger(__name__).warning("could not tear down the process group: %s", err)


def hydra_runner(config_path: str, config_name: str, extra_keys=()) -> Callable:
    """Decorate ``main(cfg)``; call it with no argument to parse the command line with Hydra,
    or with a ``DictConfig`` to run it directly (tests, Python API). ``extra_keys``: top-level keys
    the script reads beyond its config (given as ``+key=value``, as NeMo's data scripts take them)."""

    def decorator(task: Callable[[DictConfig], object]) -> Callable:
        command_line: List[str] = []  # the arguments as given, for the ranks started by trainer.devices

        def config_dir() -> str:
            """``config_path`` next to the script (read when a command line is parsed, not at import)."""
            caller_dir = os.path.dirname(os.path.abspath(sys.modules[task.__module__].__file__))
            return config_path if os.path.isabs(config_path) else os.path.join(caller_dir, config_path)

        @functools.wraps(task)
        def guarded(cfg: DictConfig):
            try:
                cfg = prepare_config(cfg, config_name, command_line[1:], extra_keys, config_dir())
                spawned = maybe_spawn(cfg.get("trainer"), argv=command_line, model_cfg=cfg.get("model"))
                if spawned is not None:  # this process started the ranks and waited for them
                    sys.exit(spawned)
                result = task(cfg)
                release_process_group()
                return result
            except AlignerError as err:
                report_user_error(err)
            except MissingMandatoryValue as err:  # a '???' in the yaml that the command line did not set
                report_user_error(ConfigError(f"{err.full_key or err} is required"))
            except KeyboardInterrupt:
                report_interrupt()

        @functools.wraps(task)
        def wrapper(cfg: Optional[DictConfig] = None):
            if cfg is not None:
                return task(cfg)
            import hydra

            command_line[:] = list(sys.argv)
            given = sys.argv[1:]
            extra = [d for d in _HYDRA_DEFAULTS if d.split("=")[0] not in " ".join(given)]
            flags, overrides = split_hydra_flags(given)
            # Hydra's flags first, then every override: argparse refuses overrides on both sides of a
            # flag, and NeMo-Aligner's commands put --config-path/--config-name first.
            sys.argv = [sys.argv[0]] + flags + extra + overrides
            return hydra.main(config_path=config_dir(), config_name=config_name, version_base=None)(guarded)()

        return wrapper

    return decorator
