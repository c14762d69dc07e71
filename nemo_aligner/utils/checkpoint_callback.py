"""Where training checkpoints go, what they are called, which are kept, and which one to resume."""

from __future__ import annotations

import logging
import math
import os
import re
from typing import Dict, List, Optional


from nemo_aligner.utils.checkpoint_io import REMOVING_SUFFIX, remove_dir_atomically
from nemo_aligner.utils.distributed import barrier, broadcast_object, get_rank
from nemo_aligner.utils.errors import ConfigError
from nemo_aligner.utils.nemo_file import save_nemo
from nemo_aligner.utils.train_checkpoint import (nemo_unfinished, nemo_written_state, read_trainer_state,
                                                  save_train_checkpoint)

logger = logging.getLogger(__name__)

_FIELD = re.compile(r"\{([^{}:]+)(:[^{}]*)?\}")
# Metric names NeMo-Aligner's configs use for the same values (monitor, checkpoint file names).
_MONITOR_ALIASES = {"val_loss": "validation_loss", "validation_loss": "val_loss",
                    "val_rewards": "val_global_rewards", "val_global_rewards": "val_rewards",
                    "reinforce_optimization_step": "ppo_optimization_step",
                    "rs_optimization_step": "ppo_optimization_step"}




def format_checkpoint_name(pattern: str, values: Dict[str, float]) -> str:
    """Lightning's naming: ``{step}`` -> ``step=12``, ``{val_loss:.3f}`` -> ``val_loss=0.123``."""

    def fill(match):
        name, fmt = match.group(1), (match.group(2) or ":")[1:]
        value = values.get(name, values.get(_MONITOR_ALIASES.get(name, ""), float("nan")))
        try:
            text = format(value, fmt) if fmt else (str(int(value)) if float(value).is_integer() else str(value))
        except (TypeError, ValueError):
            text = str(value)
        return f"{name}={text}"

    return _FIELD.sub(fill, pattern).replace("/", "_")


class CheckpointCallback:
    """Saves training checkpoints under ``dirpath`` and keeps the ``save_top_k`` best by ``monitor``.

    The most recent checkpoint is always kept as well (it is what a resumed run
    loads). ``save_top_k=-1`` keeps all of them. ``always_save_nemo`` (NeMo's): the .nemo is
    rewritten with every checkpoint, or with ``save_best_model`` whenever a checkpoint is the new best.
    """

    def __init__(self, dirpath: str, filename: str, monitor: str = "val_loss", mode: str = "min",
                 save_top_k: int = 1, save_nemo_on_train_end: bool = True, nemo_name: str = "model",
                 save_best_model: bool = False, always_save_nemo: bool = False):
        if mode not in ("min", "max"):
            raise ConfigError(f"exp_manager.checkpoint_callback_params.mode={mode!r} must be 'min' or 'max'")
        self.dirpath = dirpath
        self.filename = filename
        self.monitor = monitor
        self.mode = mode
        self.save_top_k = int(save_top_k)
        self.save_nemo_on_train_end = save_nemo_on_train_end
        self.save_best_model = save_best_model  # the final .nemo holds the best checkpoint's weights
        self.always_save_nemo = always_save_nemo
        self.nemo_path = os.path.join(dirpath, f"{nemo_name}.nemo")
        self.last_saved: Optional[str] = None
        self.last_saved_step: Optional[int] = None
        self.nemo_from: Optional[str] = None  # the checkpoint whose weights ``nemo_path`` holds (always_save_nemo)
        self._warned_no_best = False

    def monitor_value(self, metrics: Dict[str, float]) -> float:
        for key in (self.monitor, _MONITOR_ALIASES.get(self.monitor, "")):
            if key in metrics and metrics[key] is not None:
                return float(metrics[key])
        return float("nan")

    def save(self, model, optimizer, scheduler, trainer_state: dict, metrics: Dict[str, float]) -> str:
        """Collective: save a checkpoint named from ``metrics`` and ``trainer_state``; prune old ones."""
        values = dict(metrics)
        values.update({k: v for k, v in trainer_state.items() if isinstance(v, (int, float))})
        name = format_checkpoint_name(self.filename, values)
        path = os.path.join(self.dirpath, name)
        state = dict(trainer_state)
        state["monitor"] = self.monitor
        value = self.monitor_value(metrics)
        # None, not NaN: ranks compare this common state, and NaN != NaN.
        state["monitor_value"] = None if math.isnan(value) else value
        state["metrics"] = {k: float(v) for k, v in metrics.items() if isinstance(v, (int, float))}
        if get_rank() == 0:
            os.makedirs(self.dirpath, exist_ok=True)
        barrier()
        save_train_checkpoint(path, model, optimizer, scheduler, state)
        self.last_saved = path
        self.last_saved_step = trainer_state.get("step")
        if get_rank() == 0:
            self.prune()
        barrier()
        if self.always_save_nemo:
            self._refresh_nemo(model, path)
        return path

    def _refresh_nemo(self, model, saved: str) -> None:
        """Collective: ``always_save_nemo``'s .nemo of the model just saved as ``saved``; with
        ``save_best_model`` only when ``saved`` is the best checkpoint (the .nemo holds the best so far)."""
        if self.save_best_model:
            best = broadcast_object(self.best() if get_rank() == 0 else None)  # one decision: the write is collective
            if best is None and not self._warned_no_best:
                self._warned_no_best = True
                logger.warning("always_save_nemo with save_best_model: no checkpoint has a %s value yet (it is "
                               "logged by validation), so no .nemo is written", self.monitor)
            if best != saved:
                return
        self.save_nemo(model)
        self.nemo_from = saved
        logger.info("always_save_nemo: %s written from %s", self.nemo_path, os.path.basename(saved))

    def nemo_holds(self, checkpoint: Optional[str]) -> bool:
        """Whether ``nemo_path`` already holds the weights of ``checkpoint`` (written by always_save_nemo
        in this run and still there). Global rank 0 decides for all ranks, as the next write is collective."""
        held = checkpoint is not None and checkpoint == self.nemo_from
        return bool(broadcast_object(held and os.path.isfile(self.nemo_path) if get_rank() == 0 else None))

    def checkpoints(self) -> List[tuple]:
        """``(path, trainer_state)`` of every complete checkpoint under ``dirpath``."""
        return list_checkpoints(self.dirpath)

    def prune(self) -> None:
        if self.save_top_k < 0:
            return
        found = self.checkpoints()
        if not found:
            return
        latest = max(found, key=lambda item: (item[1].get("step", 0), os.path.getmtime(item[0])))[0]
        sign = 1.0 if self.mode == "min" else -1.0

        def rank_key(item):
            value = item[1].get("monitor_value")
            value = float("inf") if value is None or math.isnan(value) else sign * value
            return (value, -item[1].get("step", 0))

        keep = {p for p, _ in sorted(found, key=rank_key)[: self.save_top_k]}
        keep.add(latest)
        for path, _ in found:
            if path not in keep:
                try:
                    remove_dir_atomically(path)
                except FileNotFoundError:  # already gone (another process pruned it)
                    continue
                logger.debug("removed checkpoint %s (not in the top %d by %s)", path, self.save_top_k, self.monitor)

    def best(self) -> Optional[str]:
        found = [item for item in self.checkpoints() if item[1].get("monitor_value") is not None
                 and not math.isnan(item[1]["monitor_value"])]
        if not found:
            return None
        sign = 1.0 if self.mode == "min" else -1.0
        return min(found, key=lambda item: sign * item[1]["monitor_value"])[0]

    def save_nemo(self, model, path: Optional[str] = None) -> str:
        """Collective: write the model as a .nemo (weights only) next to the checkpoints."""
        self.nemo_from = None  # whatever it held, it now holds the model as it is
        return save_nemo(model, path or self.nemo_path)


def _checkpoint_dirs(dirpath: str) -> List[str]:
    """Directories under ``dirpath`` that are not a save or deletion in progress (``*.tmp``,
    ``*.removing``) or a version moved aside (``*.old.*``)."""
    if not os.path.isdir(dirpath):
        return []
    return [os.path.join(dirpath, name) for name in sorted(os.listdir(dirpath))
            if not name.endswith((".tmp", REMOVING_SUFFIX)) and ".old." not in name
            and os.path.isdir(os.path.join(dirpath, name))]


def list_checkpoints(dirpath: str) -> List[tuple]:
    """Complete training checkpoints in ``dirpath`` (partial ``*.tmp`` writes and half-deleted
    ``*.removing`` ones are ignored)."""
    found = []
    for path in _checkpoint_dirs(dirpath):
        try:
            state = read_trainer_state(path)
        except (OSError, ValueError):  # being removed by another process's pruning, or not ours
            continue
        if state is not None and os.path.isfile(os.path.join(path, "metadata.json")):
            found.append((path, state))
    return found


def nemo_written_checkpoints(dirpath: str) -> List[tuple]:
    """``(path, trainer state)`` of the finished training checkpoints NeMo(-Aligner) wrote in ``dirpath``
    (their state read from their names); a save NeMo marked ``-unfinished`` is left out."""
    found = []
    for path in _checkpoint_dirs(dirpath):
        state = nemo_written_state(path)
        if state is not None and not nemo_unfinished(path):
            found.append((path, state))
    return found


def incomplete_checkpoints(dirpath: str) -> List[str]:
    """Directories under ``dirpath`` that look like training checkpoints but lack a file that a
    complete one has, or that NeMo marked unfinished (``latest_checkpoint`` ignores them)."""
    found = []
    for path in _checkpoint_dirs(dirpath):
        if nemo_written_state(path) is not None:
            if nemo_unfinished(path):
                found.append(path)
            continue
        has = [os.path.isfile(os.path.join(path, f)) for f in ("metadata.json", "trainer_state.json")]
        if any(has) and not all(has):
            found.append(path)
    return found


def latest_checkpoint(dirpath: str) -> Optional[str]:
    """The checkpoint with the highest step (what ``resume_if_exists`` loads): one of this project's,
    or one NeMo(-Aligner) wrote."""
    found = list_checkpoints(dirpath) + nemo_written_checkpoints(dirpath)
    if not found:
        return None
    return max(found, key=lambda item: (item[1].get("step", 0), os.path.getmtime(item[0])))[0]
