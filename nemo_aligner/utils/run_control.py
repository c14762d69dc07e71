"""Step budgets and wall-clock limits shared by all trainers."""

from __future__ import annotations

import logging
import math
import re
import signal
import time
from typing import Optional, Union

import torch
import torch.distributed as dist
from omegaconf import DictConfig

from nemo_aligner.utils.distributed import host_all_reduce
from nemo_aligner.utils.errors import ConfigError


def parse_max_time(value: Union[None, str, int, float, dict], key: str = "max_time") -> Optional[float]:
    """Seconds from Lightning's ``max_time`` forms: ``"DD:HH:MM:SS"``, a number of seconds, or a dict."""
    if value is None or value == "":
        return None
    if isinstance(value, (int, float)):
        return float(value)
    if hasattr(value, "items"):
        units = {"days": 86400, "hours": 3600, "minutes": 60, "seconds": 1}
        unknown = set(value) - set(units)
        if unknown:
            raise ConfigError(f"{key}: unknown unit(s) {sorted(unknown)}; use days/hours/minutes/seconds")
        return float(sum(units[k] * float(v) for k, v in value.items()))
    text = str(value).strip()
    if re.fullmatch(r"\d+(\.\d+)?", text):
        return float(text)
    parts = text.split(":")
    if len(parts) != 4 or not all(re.fullmatch(r"\d+", p) for p in parts):
        raise ConfigError(f"{key}={value!r} must look like DD:HH:MM:SS (e.g. 00:03:50:00)")
    days, hours, minutes, seconds = (int(p) for p in parts)
    return float(((days * 24 + hours) * 60 + minutes) * 60 + seconds)


_TERMINATION: dict = {"signal": None, "installed": False, "previous": {}}


def _request_stop(signum, frame) -> None:
    if _TERMINATION["signal"] is None:
        logging.getLogger(__name__).warning("received %s: finishing this step, saving a checkpoint, then stopping",
                                            signal.Signals(signum).name)
    _TERMINATION["signal"] = signum


def install_termination_handlers() -> bool:
    """SIGTERM (Slurm preemption, ``kill``) and SIGUSR1 (Slurm's ``--signal``) ask the run to stop after
    the current step, with a checkpoint. Only possible in the main thread; returns whether installed."""
    import threading

    if _TERMINATION["installed"]:
        return True
    if threading.current_thread() is not threading.main_thread():
        return False
    for sig in (signal.SIGTERM, signal.SIGUSR1):
        _TERMINATION["previous"][sig] = signal.signal(sig, _request_stop)
    _TERMINATION["installed"] = True
    return True


def restore_termination_handlers() -> None:
    """Put back the handlers that were there before (a Python-API process is killable again after
    ``fit``) and forget a signal already handled."""
    if _TERMINATION["installed"]:
        for sig, previous in _TERMINATION["previous"].items():
            signal.signal(sig, previous)
    _TERMINATION.update(signal=None, installed=False, previous={})


def termination_requested() -> Optional[int]:
    return _TERMINATION["signal"]


class RunTimer:
    """Wall-clock budget for one run, and termination signals; every rank agrees on when to stop."""

    def __init__(self, max_seconds: Optional[float], handle_signals: bool = True):
        self.max_seconds = max_seconds
        self.start = time.monotonic()
        self.watch_signals = install_termination_handlers() if handle_signals else False
        self.stop_reason = ""

    def elapsed(self) -> float:
        return time.monotonic() - self.start

    def close(self) -> None:
        """The run is over: stop watching for termination signals."""
        if self.watch_signals:
            restore_termination_handlers()
            self.watch_signals = False

    def is_finished(self) -> bool:
        """Collective when distributed: rank 0 decides (its clock, or a signal any rank received), so
        all ranks stop together."""
        if self.max_seconds is None and not self.watch_signals:
            return False
        out_of_time = self.max_seconds is not None and self.elapsed() >= self.max_seconds
        signalled = termination_requested() is not None
        flags = torch.tensor([int(out_of_time), int(signalled)], dtype=torch.int32)
        if dist.is_initialized() and dist.get_world_size() > 1:
            flags = host_all_reduce(flags, op=dist.ReduceOp.MAX)
        if flags[1]:
            self.stop_reason = "termination signal received"
        elif flags[0]:
            self.stop_reason = "max_time reached"
        return bool(flags.max().item())


def interval_steps(value, steps_per_epoch: int) -> int:
    """Steps between validations or saves: an int, or Lightning's float form (a fraction of an epoch:
    ``1.0`` is once per epoch); 0 or None is never."""
    if isinstance(value, float) and 0 < value <= 1.0:
        return max(int(steps_per_epoch * value), 1)
    return int(value or 0)


def compute_max_steps(max_steps: Optional[int], max_epochs: Optional[int], steps_per_epoch: int,
                      key: str = "trainer.sft") -> int:
    """Lightning's rule: the smaller of ``max_steps`` and ``max_epochs * steps_per_epoch`` (-1/None: no limit)."""
    limits = []
    if max_steps is not None and int(max_steps) >= 0:
        limits.append(int(max_steps))
    if max_epochs is not None and int(max_epochs) >= 0:
        limits.append(int(max_epochs) * steps_per_epoch)
    if not limits:
        raise ConfigError(f"set {key}.max_steps or {key}.max_epochs; both are unlimited")
    return min(limits)


def max_time_of(cfg: DictConfig, algo: str):
    """``trainer.<algo>.max_time``, else ``trainer.max_time``, else ``exp_manager.max_time_per_run``."""
    for key, value in ((f"trainer.{algo}.max_time", cfg.trainer.get(algo, {}).get("max_time")),
                       ("trainer.max_time", cfg.trainer.get("max_time")),
                       ("exp_manager.max_time_per_run", (cfg.get("exp_manager") or {}).get("max_time_per_run"))):
        seconds = parse_max_time(value, key)
        if seconds is not None:
            return seconds
    return None


class NonFiniteGuard:
    """Counts training steps skipped for a non-finite loss or gradients; stops the run after
    ``limit`` in a row (0: never), naming ``key`` (``trainer.<algo>.max_consecutive_nonfinite_steps``).

    The caller asks ``check(loss, model)`` after backward (collective: every rank decides alike)
    and calls ``skip(...)`` instead of the optimizer step when it says no.
    """

    def __init__(self, limit: int, key: str, what: str = "steps", advice: str = "check the data"):
        self.limit = int(limit or 0)
        self.key = key
        self.what = what
        self.advice = advice
        self.consecutive = 0
        self.total = 0

    def check(self, loss: float, model) -> bool:
        """Whether the loss and every gradient are finite (``model.grads_are_finite()`` is collective);
        a finite step ends a run of skips."""
        finite = math.isfinite(loss) and model.grads_are_finite()
        if finite:
            self.consecutive = 0
        return finite

    def skip(self, optimizer, step: int) -> None:
        """Drop the step's gradients and count it; raise ``TrainingError`` after too many in a row."""
        from nemo_aligner.utils.errors import TrainingError

        optimizer.zero_grad()
        self.consecutive += 1
        self.total += 1
        logging.getLogger(__name__).warning(
            "step %d: non-finite loss or gradients, %s skipped (%d in a row, %d in all)", step,
            self.what.rstrip("s"), self.consecutive, self.total)
        if self.limit and self.consecutive >= self.limit:
            raise TrainingError(f"{self.consecutive} consecutive {self.what} had a non-finite loss or gradients "
                                f"(up to step {step}); stopping. Lower the learning rate or {self.advice}; the last "
                                f"good checkpoint is kept ({self.key})")
