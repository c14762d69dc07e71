"""BaseTrainer: the Python API over the same runs the Hydra scripts use.

A trainer holds a config dict and a current model (a ``.nemo``). ``fit`` writes the data as
jsonl, composes the algorithm's Hydra config (``examples/nlp/gpt/conf/<name>.yaml``) with the
API's values, runs the algorithm in this process (or in every process of a ``torchrun`` launch)
and moves the current model to the trained one.
"""

from __future__ import annotations

import copy
import os
import shutil
from dataclasses import dataclass, field
from typing import Any, Dict, Iterable, List, Optional

from omegaconf import DictConfig, OmegaConf

from nemo_aligner.data.nlp.jsonl import write_jsonl
from nemo_aligner.trainers.arguments import (Rule, check_fit_kwargs, check_model_path, check_steps,
                                             check_trainer_config)
from nemo_aligner.algorithms.callbacks import Callback, CallbackList
from nemo_aligner.utils.errors import ConfigError
from nemo_aligner.utils.examples_path import examples_dir

CONF_DIR = examples_dir("nlp", "gpt", "conf")
TOP_LEVEL_KEYS = ("output_dir", "precision", "overrides", "use_wandb")  # from_pretrained arguments outside the section


@dataclass
class TrainingResult:
    """What ``fit`` returns."""

    metrics: Dict[str, float] = field(default_factory=dict)
    best_checkpoint_path: Optional[str] = None
    total_steps: int = 0
    total_epochs: int = 0
    model_path: Optional[str] = None  # the trained .nemo


def compose_config(config_name: str, values: Dict[str, Any]) -> DictConfig:
    """The algorithm's Hydra config with dotted ``values`` set; an unknown key is a ConfigError."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    import nemo_aligner.utils.hydra_runner  # noqa: F401  (registers the config resolvers)

    if not os.path.isdir(CONF_DIR):
        raise ConfigError(f"the algorithm configs are not at {CONF_DIR}: this install has neither a source "
                          "checkout's examples/ nor the copy a wheel carries; reinstall nemo-aligner (pip install .)")
    if GlobalHydra.instance().is_initialized():
        GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=CONF_DIR, version_base=None):
        cfg = compose(config_name=config_name)
    for key, value in values.items():
        try:
            OmegaConf.update(cfg, key, value, merge=False)
        except Exception as err:  # struct mode: the key does not exist
            raise ConfigError(f"unknown config key {key!r} for {config_name}.yaml ({type(err).__name__})") from None
    from nemo_aligner.utils.model_config import record_command_line

    # as a command line's keys: an architecture value the caller set that a checkpoint overrides is
    # named in a warning
    record_command_line(values)
    return cfg


def resolve_model(model_name_or_path: str, work_dir: str) -> str:
    """A ``.nemo`` path for a ``.nemo`` file or a local Hugging Face model directory (imported once)."""
    path = os.fspath(model_name_or_path)
    check_model_path(path, "policy.model_name")
    if os.path.isfile(path):
        return os.path.abspath(path)
    from nemo_aligner.models.nlp.gpt.hf_interop import import_hf_model

    # One import per source: named by the directory and a digest of where it is and what is in it,
    # so another model of the same directory name, or the same directory re-saved, is imported anew.
    target = os.path.join(work_dir, "imported", f"{os.path.basename(os.path.normpath(path))}-"
                                                f"{_hf_dir_digest(path)}.nemo")
    if not os.path.isfile(target):
        import_hf_model(path, target)
    return target


def _hf_dir_digest(path: str) -> str:
    """Short digest of a Hugging Face model directory: its absolute path, config.json, and each
    file's name, size and modification time (weights are not read)."""
    import hashlib

    digest = hashlib.sha256(os.path.abspath(path).encode())
    with open(os.path.join(path, "config.json"), "rb") as f:
        digest.update(f.read())
    for name in sorted(os.listdir(path)):
        info = os.stat(os.path.join(path, name))
        digest.update(f"{name}:{info.st_size}:{info.st_mtime_ns}".encode())
    return digest.hexdigest()[:12]


class BaseTrainer:
    """``fit(dataset, **kwargs) -> TrainingResult``, ``save_checkpoint``, ``load_checkpoint``,
    ``config`` (a dict) and ``current_step``. Subclasses set ``algorithm``, ``config_name`` and
    implement ``_values`` (config values for one fit) and ``_run`` (the engine call)."""

    algorithm = ""
    config_name = ""

    section_rules: Dict[str, Rule] = {}  # the keys of the config's algorithm section, with their checks

    def __init__(self, config: Optional[Dict[str, Any]] = None):
        self._config = copy.deepcopy(dict(config or {}))
        owner = type(self).__name__
        check_trainer_config(self._config, self.algorithm, self.section_rules, owner)
        policy = self._config.setdefault("policy", {})
        if not policy.get("model_name"):
            raise ConfigError("config policy.model_name is required (a .nemo file or a local Hugging Face directory)")
        check_model_path(os.fspath(policy["model_name"]), f"{owner}: policy.model_name (model_name_or_path)")
        self.output_dir = os.path.abspath(self._config.get("output_dir") or os.path.join("results", f"api_{self.algorithm}"))
        self._model_path: Optional[str] = None
        self._step = 0
        self._epochs = 0
        self._fits = 0

    # ----------------------------------------------------------------- properties
    @property
    def config(self) -> Dict[str, Any]:
        return copy.deepcopy(self._config)

    @property
    def current_step(self) -> int:
        return self._step

    @property
    def model_path(self) -> str:
        """The current model: the starting one until ``fit`` or ``load_checkpoint`` changes it."""
        if self._model_path is None:
            self._model_path = resolve_model(self._config["policy"]["model_name"], self.output_dir)
        return self._model_path

    # ----------------------------------------------------------------- checkpoints
    def save_checkpoint(self, path: str) -> str:
        """Write the current model as a ``.nemo`` at ``path`` (atomically)."""
        path = os.path.abspath(path)
        if os.path.isdir(path):
            raise ConfigError(f"save_checkpoint({path!r}): is a directory; give the .nemo file's path")
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = f"{path}.tmp.{os.getpid()}"
        try:
            shutil.copyfile(self.model_path, tmp)
            os.replace(tmp, path)
        finally:
            if os.path.exists(tmp):
                os.remove(tmp)
        return path

    def load_checkpoint(self, path: str) -> None:
        """Make ``path`` the current model: a ``.nemo``, or a training checkpoint directory (e.g.
        ``TrainingResult.best_checkpoint_path``), whose weights are exported to a ``.nemo`` first."""
        path = os.path.abspath(path)
        if os.path.isfile(path):
            from nemo_aligner.utils.nemo_file import read_model_config

            read_model_config(path, "load_checkpoint(path)")  # a .nemo, or an error naming it now
            self._model_path = path
        elif os.path.isdir(path):
            self._model_path = self._export_checkpoint_dir(path)
        else:
            raise ConfigError(f"checkpoint {path!r} does not exist")

    def _export_checkpoint_dir(self, directory: str) -> str:
        from nemo_aligner.models.nlp.gpt.gpt_sft_model import GPTSFTModel
        from nemo_aligner.models.nlp.gpt.loading import load_model
        from nemo_aligner.utils import distributed as D
        from nemo_aligner.utils.nemo_file import save_nemo

        D.init_distributed()
        D.initialize_model_parallel(1, 1)
        model = load_model(GPTSFTModel, OmegaConf.create({"micro_batch_size": 1}), "32", self.model_path,
                           trainable=False)
        model.load_weights(directory, what=f"checkpoint {directory}")
        target = os.path.join(self.output_dir, "loaded", os.path.basename(directory.rstrip("/")) + ".nemo")
        return save_nemo(model, target)

    # ----------------------------------------------------------------- fit
    def _run_dir(self) -> str:
        while True:
            self._fits += 1
            run_dir = os.path.join(self.output_dir, f"fit_{self._fits}")
            if not os.path.exists(run_dir):  # never write into an earlier run's directory
                return run_dir

    def _common_values(self, run_dir: str) -> Dict[str, Any]:
        world = int(os.environ.get("WORLD_SIZE", "1"))
        values = {"trainer.devices": world, "trainer.num_nodes": 1,
                  "exp_manager.explicit_log_dir": run_dir, "exp_manager.resume_if_exists": False,
                  "exp_manager.create_wandb_logger": bool(self._config.get("use_wandb", False)),
                  # the API's optimizer (not the scripts' NeMo-Aligner schedules): AdamW at a constant
                  # learning_rate from the first step; overrides={"model.optim.sched.name": ...} for others
                  "model.optim.sched.name": "Constant", "model.optim.sched.warmup_steps": 0,
                  "model.optim.weight_decay": 0.01}
        if self._config.get("precision") is not None:
            values["trainer.precision"] = self._config["precision"]
        values.update(self._config.get("overrides") or {})
        return values

    def fit(self, dataset, callbacks: Optional[Iterable[Callback]] = None, **kwargs) -> TrainingResult:
        owner = f"{type(self).__name__}.fit"
        check_fit_kwargs(kwargs, self._values, owner)
        check_steps(kwargs.get("max_steps"), kwargs.get("max_epochs"), owner)
        kwargs = self._checked_fit_kwargs(kwargs, owner)
        hooks = CallbackList(callbacks, owner=self)
        run_dir = self._run_dir()
        os.makedirs(run_dir)
        values = self._common_values(run_dir)
        values.update(self._values(dataset, run_dir, **kwargs))
        values.update(self._config.get("overrides") or {})  # explicit overrides win
        cfg = compose_config(self.config_name, values)
        summary = self._run(cfg, hooks, **kwargs)
        self._step += int(summary.get("steps", 0))
        self._epochs = int(summary.get("epochs", 0))
        if summary.get("nemo_path"):
            self._model_path = summary["nemo_path"]
        metrics = {k: v for k, v in summary.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
        result = TrainingResult(metrics=metrics, best_checkpoint_path=summary.get("best_checkpoint") or summary.get("nemo_path"),
                                total_steps=self._step, total_epochs=self._epochs, model_path=summary.get("nemo_path"))
        return result

    def _checked_fit_kwargs(self, kwargs: Dict[str, Any], owner: str) -> Dict[str, Any]:
        """``fit``'s algorithm-specific arguments, checked (and normalised) before anything runs."""
        return kwargs

    def _values(self, dataset, run_dir: str, **kwargs) -> Dict[str, Any]:
        raise NotImplementedError

    def _run(self, cfg: DictConfig, hooks: CallbackList, **kwargs) -> Dict[str, Any]:
        raise NotImplementedError

    @staticmethod
    def _write(run_dir: str, name: str, records: List[dict]) -> str:
        path = os.path.join(run_dir, "data", f"{name}.jsonl")
        write_jsonl(path, records)
        return path

    @classmethod
    def _pretrained(cls, model_name_or_path: str, learning_rate: float, max_sequence_length: int,
                    section: Dict[str, Any], kwargs: Dict[str, Any], allowed: Iterable[str]):
        """``cls(config)`` for ``from_pretrained``: the policy, the algorithm's section (``section`` plus the
        remaining ``kwargs``) and the top-level settings among ``kwargs``."""
        cls._check_kwargs(kwargs, allowed, f"{cls.__name__}.from_pretrained")
        kwargs = dict(kwargs)
        config = {"policy": {"model_name": str(model_name_or_path), "learning_rate": learning_rate,
                             "max_total_sequence_length": kwargs.pop("max_sequence_length", max_sequence_length)},
                  cls.algorithm: dict(section)}
        for key in TOP_LEVEL_KEYS:
            if key in kwargs:
                config[key] = kwargs.pop(key)
        config[cls.algorithm].update(kwargs)
        return cls(config)

    @staticmethod
    def _check_kwargs(given: Dict[str, Any], allowed: Iterable[str], where: str) -> None:
        unknown = sorted(set(given) - set(allowed))
        if unknown:
            raise ConfigError(f"{where}: unknown argument(s) {unknown}; known: {sorted(allowed)} "
                              "(other settings go in overrides={'dotted.key': value})")
