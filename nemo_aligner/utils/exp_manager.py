"""NeMo's ``exp_manager`` section: log directory, loggers, checkpoint callback and resume."""

from __future__ import annotations

import importlib
import logging
import os
import socket
import sys
import time
from dataclasses import dataclass
from typing import Optional

from omegaconf import DictConfig, OmegaConf

from nemo_aligner.utils.checkpoint_callback import (CheckpointCallback, incomplete_checkpoints, latest_checkpoint,
                                                    list_checkpoints, nemo_written_checkpoints)
from nemo_aligner.utils.checkpoint_io import checkpoint_dir_named, recover_interrupted_saves
from nemo_aligner.utils.distributed import barrier, get_rank, is_global_rank_zero
from nemo_aligner.utils.errors import CheckpointError, ConfigError
from nemo_aligner.utils.loggers import MetricLogger

logger = logging.getLogger(__name__)


@dataclass
class Experiment:
    """What ``exp_manager`` set up for a run."""

    log_dir: str
    checkpoint_dir: str
    logger: MetricLogger
    checkpoint_callback: Optional[CheckpointCallback]
    resume_from: Optional[str]


def _log_dir(exp_cfg, name: str) -> str:
    if exp_cfg.get("explicit_log_dir"):
        return os.path.abspath(str(exp_cfg.explicit_log_dir))
    base = exp_cfg.get("exp_dir") or os.path.join(os.getcwd(), "nemo_experiments")
    return os.path.abspath(os.path.join(str(base), str(exp_cfg.get("name") or name)))


def setup_console_logging(log_dir: Optional[str] = None) -> None:
    """INFO to stdout on rank 0 (warnings elsewhere) and a per-rank log file in ``log_dir``."""
    root = logging.getLogger()
    level = logging.INFO if is_global_rank_zero() else logging.WARNING
    fmt = logging.Formatter("[%(asctime)s %(levelname)s %(name)s] %(message)s", "%H:%M:%S")
    if not any(getattr(h, "_nemo_aligner", False) for h in root.handlers):
        handler = logging.StreamHandler(sys.stdout)
        handler.setFormatter(fmt)
        handler._nemo_aligner = True
        root.addHandler(handler)
    root.setLevel(level)
    if log_dir:
        os.makedirs(log_dir, exist_ok=True)
        path = os.path.join(log_dir, f"nemo_log_globalrank-{get_rank()}.txt")
        if not any(getattr(h, "baseFilename", None) == path for h in root.handlers):
            file_handler = logging.FileHandler(path)
            file_handler.setFormatter(fmt)
            file_handler.setLevel(logging.INFO)
            root.addHandler(file_handler)


_LOCKS: dict = {}  # log dir -> the open lock file this process holds for it


def lock_log_dir(log_dir: str) -> None:
    """Hold ``<log_dir>/.lock`` (an advisory lock, released when the process ends) for this run: a
    second live run on the same directory would mix both runs' checkpoints and metrics."""
    import fcntl

    if log_dir in _LOCKS:
        return
    path = os.path.join(log_dir, ".lock")
    handle = open(path, "a+", encoding="utf-8")
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        handle.seek(0)
        holder = handle.read().strip() or "another process"
        handle.close()
        raise ConfigError(f"exp_manager.explicit_log_dir={log_dir} is in use by a running job ({holder}); give "
                          "this run another log directory, or stop that job first") from None
    except OSError as err:  # a file system without locks (some network mounts): go on unguarded
        logger.warning("could not lock %s (%s): two runs sharing this log directory would not be noticed", path, err)
        handle.close()
        return
    handle.seek(0)
    handle.truncate()
    handle.write(f"pid {os.getpid()} on {socket.gethostname()}\n")
    handle.flush()
    _LOCKS[log_dir] = handle


_LOGGER_DEFAULTS = {"create_tensorboard_logger": True, "create_wandb_logger": False}


def _logger_on(exp_cfg, key: str) -> bool:
    return bool(exp_cfg.get(key, _LOGGER_DEFAULTS[key]))


def _check_exp_config(exp_cfg, log_dir: str) -> None:
    if os.path.exists(log_dir) and not os.path.isdir(log_dir):
        raise ConfigError(f"the log directory {log_dir} (exp_manager.explicit_log_dir, or exp_dir/name) is a file")
    params = exp_cfg.get("checkpoint_callback_params") or {}
    filename = params.get("filename")
    if filename is not None:
        name = str(filename)
        if "/" in name or name.endswith((".tmp", ".tmpdir")) or ".before-" in name:
            raise ConfigError(f"exp_manager.checkpoint_callback_params.filename={name!r}: a checkpoint name must not "
                              "contain '/' or end in .tmp/.tmpdir (names kept for checkpoints being written)")
    top_k = params.get("save_top_k")
    if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < -1):
        raise ConfigError(f"exp_manager.checkpoint_callback_params.save_top_k={top_k!r} must be an integer: -1 (keep "
                          "all), 0 or more")
    mode = params.get("mode")
    if mode is not None and str(mode) not in ("min", "max"):
        raise ConfigError(f"exp_manager.checkpoint_callback_params.mode={mode!r} must be 'min' or 'max'")
    # A logger whose package is missing would fail only once the model is built, with a traceback.
    for key, module, package in (("create_tensorboard_logger", "torch.utils.tensorboard", "tensorboard"),
                                 ("create_wandb_logger", "wandb", "wandb")):
        if _logger_on(exp_cfg, key):
            try:
                importlib.import_module(module)
            except ImportError as err:
                raise ConfigError(f"exp_manager.{key}=True needs the {package} package ({err}): install it "
                                  f"(pip install {package}) or set exp_manager.{key}=False") from None


def set_aside_earlier_checkpoints(checkpoint_dir: str) -> Optional[str]:
    """A run that does not resume starts with its own checkpoint directory: an earlier run's
    checkpoints there are moved, whole, to ``checkpoints.before-<UTC time>`` (pruning, the best
    checkpoint and a later resume would otherwise mix the two runs, and pruning would delete the new
    run's checkpoints in favour of the old run's better ones). Returns where they went."""
    if not list_checkpoints(checkpoint_dir) and not nemo_written_checkpoints(checkpoint_dir):
        return None
    target = f"{checkpoint_dir}.before-{time.strftime('%Y%m%d-%H%M%S', time.gmtime())}"
    while os.path.exists(target):
        target += "_"
    os.replace(checkpoint_dir, target)
    os.makedirs(checkpoint_dir)
    logger.warning("%s held an earlier run's checkpoints and this run does not resume "
                   "(exp_manager.resume_if_exists=False): they were moved to %s", checkpoint_dir, target)
    return target


def exp_manager(exp_cfg: DictConfig, full_cfg: DictConfig, default_name: str = "megatron_gpt") -> Experiment:
    """Create the log directory, loggers and checkpoint callback; find the checkpoint to resume.

    ``resume_if_exists`` resumes from the newest complete checkpoint in
    ``<log_dir>/checkpoints``; with ``resume_ignore_no_checkpoint=False`` a missing
    checkpoint is an error.
    """
    if exp_cfg is None:
        # NeMo: `exp_manager=null` turns the experiment manager off (no checkpoints, no loggers; NeMo-Aligner's
        # CI runs so). The console log and metrics.jsonl still go to NeMo's default directory.
        logger.info("exp_manager is null: no checkpoints, no .nemo and no tensorboard/wandb loggers")
        exp_cfg = OmegaConf.create({"create_checkpoint_callback": False, "create_tensorboard_logger": False,
                                    "create_wandb_logger": False})
    name = str(exp_cfg.get("name") or full_cfg.get("name") or default_name)
    log_dir = _log_dir(exp_cfg, name)
    checkpoint_dir = os.path.join(log_dir, "checkpoints")
    _check_exp_config(exp_cfg, log_dir)
    setup_console_logging(log_dir)
    if is_global_rank_zero():
        lock_log_dir(log_dir)
    fresh = not exp_cfg.get("resume_if_exists", False) and not exp_cfg.get("resume_from_checkpoint")
    if is_global_rank_zero():
        os.makedirs(checkpoint_dir, exist_ok=True)
        recover_interrupted_saves(checkpoint_dir)
        if fresh:
            set_aside_earlier_checkpoints(checkpoint_dir)
    barrier()

    resume_from = None
    if exp_cfg.get("resume_if_exists", False):
        resume_from = latest_checkpoint(checkpoint_dir)
        if is_global_rank_zero():
            for path in incomplete_checkpoints(checkpoint_dir):
                logger.warning("skipped %s when choosing the checkpoint to resume: it is incomplete (no "
                               "metadata.json or trainer_state.json, or NeMo's -unfinished marker beside it)", path)
        if resume_from is None and not exp_cfg.get("resume_ignore_no_checkpoint", False):
            raise CheckpointError(
                f"exp_manager.resume_if_exists=True but {checkpoint_dir} has no checkpoint; "
                "set exp_manager.resume_ignore_no_checkpoint=True to start from scratch"
            )
    if exp_cfg.get("resume_from_checkpoint"):
        resume_from = checkpoint_dir_named(str(exp_cfg.resume_from_checkpoint))
        if not os.path.isdir(resume_from):
            raise CheckpointError(f"exp_manager.resume_from_checkpoint={resume_from}: no such checkpoint directory")

    config = OmegaConf.to_container(full_cfg, resolve=True)
    hparams_text = OmegaConf.to_yaml(full_cfg, resolve=True)

    def write_hparams() -> None:
        # Only once the run is logging: a run that fails while starting leaves the last run's file.
        hparams = os.path.join(log_dir, "hparams.yaml")
        with open(f"{hparams}.tmp.{os.getpid()}", "w", encoding="utf-8") as f:  # the last run's stays whole
            f.write(hparams_text)
        os.replace(f"{hparams}.tmp.{os.getpid()}", hparams)

    wandb_kwargs = OmegaConf.to_container(exp_cfg.get("wandb_logger_kwargs") or OmegaConf.create({}), resolve=True)
    metric_logger = MetricLogger(
        log_dir,
        create_tensorboard=_logger_on(exp_cfg, "create_tensorboard_logger"),
        create_wandb=_logger_on(exp_cfg, "create_wandb_logger"),
        wandb_kwargs=wandb_kwargs,
        config=config,
        on_first_log=write_hparams,
    )

    callback = None
    if exp_cfg.get("create_checkpoint_callback", True):
        params = exp_cfg.get("checkpoint_callback_params") or OmegaConf.create({})
        monitor = str(params.get("monitor") or "val_loss")
        callback = CheckpointCallback(
            dirpath=checkpoint_dir,
            filename=str(params.get("filename") or f"{name}--{{{monitor}:.3f}}-{{step}}-{{consumed_samples}}-{{epoch}}"),
            monitor=monitor,
            mode=str(params.get("mode") or "min"),
            save_top_k=int(params.get("save_top_k", 1) if params.get("save_top_k") is not None else 1),
            save_nemo_on_train_end=bool(params.get("save_nemo_on_train_end", True)),
            nemo_name=name,
            save_best_model=bool(params.get("save_best_model", False)),
            always_save_nemo=bool(params.get("always_save_nemo", False)),
        )
    if resume_from:
        logger.info("resuming from %s", resume_from)
    return Experiment(log_dir, checkpoint_dir, metric_logger, callback, resume_from)
