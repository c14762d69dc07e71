"""Training checkpoints: model, optimizer, LR schedule, trainer state and RNG, for exact resume.

A checkpoint is a torch_dist directory laid out like NeMo's (``state_dict`` holds the
model under ``model.*`` keys, so its weights load like a .nemo's), plus
``trainer_state.json`` (step, consumed samples, epoch, metrics) and one
``rng_state_<rank>.pt`` per rank. It is written under a temporary name and renamed
when every rank is done.

Training checkpoints NeMo(-Aligner) wrote (the same torch_dist layout, its trainer state in the
directory name) are resumed too: :func:`nemo_written_state`.
"""

from __future__ import annotations

import json
import logging
import os
import random
import re
from typing import Optional

import numpy as np
import torch

from nemo_aligner.utils.checkpoint_io import load_sharded, save_sharded
from nemo_aligner.utils.distributed import get_rank
from nemo_aligner.utils.errors import CheckpointError
from nemo_aligner.utils.optim import uses_distributed_optimizer
from nemo_aligner.utils.patches.optimizer_state import float32_params_listed, without_stub_optimizers

logger = logging.getLogger(__name__)

TRAINER_STATE = "trainer_state.json"
NEMO_UNFINISHED_SUFFIX = "-unfinished"  # NeMo's marker beside a checkpoint still being written
# The counters NeMo-Aligner's checkpoint names carry (its trainers read them back from the name), and
# the trainer-state keys they are here.
_NEMO_NAME_COUNTERS = {"step": "step", "consumed_samples": "consumed_samples", "epoch": "epoch",
                       "ppo_optimization_step": "ppo_optimization_step",
                       "reinforce_optimization_step": "ppo_optimization_step",
                       "rs_optimization_step": "ppo_optimization_step"}
_DIST_OPT_METADATA = {"distrib_optim_sharding_type": "dp_reshardable"}



def rng_state() -> dict:
    """Every random generator this process uses (Python, NumPy, torch CPU/CUDA, megatron-core tracker)."""
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    state = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
        "tracker": get_cuda_rng_tracker().get_states(),
        "tracker_device": _tracker_device(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _tracker_device() -> str:
    # megatron-core's tracker holds CUDA generator states on a GPU, CPU ones (cpu_compat) otherwise.
    return "cuda" if torch.cuda.is_available() else "cpu"


def set_rng_state(state: dict) -> None:
    """Restore ``rng_state()``'s generators. A checkpoint written on the other kind of device (CPU
    vs GPU) cannot restore the model-parallel tracker's streams (dropout): they restart from the
    run's seed, with a warning."""
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    written_on = state.get("tracker_device", "cpu")  # checkpoints before this key: CPU only
    if written_on == _tracker_device():
        get_cuda_rng_tracker().set_states(state["tracker"])
    else:
        logger.warning("checkpoint written on %s, resuming on %s: dropout random streams restart from the seed",
                       written_on, _tracker_device())


def _saved_param_groups(opt_state) -> Optional[list]:
    """The param groups in one optimizer's loaded state (mixed-precision, float32 or distributed layout)."""
    for holder in (opt_state.get("optimizer"), opt_state.get("optimizer_state_dict"), opt_state):
        if isinstance(holder, dict) and isinstance(holder.get("param_groups"), list):
            return holder["param_groups"]
    return None


def _match_param_groups(optimizer, opt_state) -> None:
    """Give the optimizer's param groups the saved groups' identifying settings, position by position.

    megatron-core 0.17+ pairs saved and current param groups by their settings (``max_lr``,
    ``min_lr``, weight-decay multipliers, ...), where 0.16 paired them by position: a resume with
    another ``model.optim.lr`` would find no group. As on 0.16, the saved settings then apply (the
    learning-rate schedule continues from the checkpoint unless ``override_checkpoint_schedule``)."""
    from megatron.core.optimizer import optimizer as mcore_optimizer

    keys = getattr(mcore_optimizer, "param_group_identifier_keys", None)
    if not keys:
        return
    inners = getattr(optimizer, "chained_optimizers", [optimizer])
    states = opt_state if isinstance(opt_state, list) else [opt_state]
    for inner, state in zip(inners, states):
        saved = _saved_param_groups(state) if isinstance(state, dict) else None
        current = getattr(getattr(inner, "optimizer", None), "param_groups", None)
        if not saved or not current or len(saved) != len(current):
            continue
        for now, then in zip(current, saved):
            for key in keys:
                if key in then:
                    now[key] = then[key]


def _optimizer_sharded(model, optimizer, model_sd: dict, is_loading: bool):
    if optimizer is None:
        return None
    with without_stub_optimizers(optimizer), float32_params_listed(optimizer):
        if not uses_distributed_optimizer(model.cfg.get("optim") or {}):
            return optimizer.sharded_state_dict(model_sd, is_loading=is_loading)
        if is_loading:
            # The DistributedOptimizer needs allocated states to map checkpoint shards onto.
            for inner in getattr(optimizer, "chained_optimizers", [optimizer]):
                inner._init_optimizer_states_with_dummy_values()
        return optimizer.sharded_state_dict(model_sd, is_loading=is_loading, metadata=_DIST_OPT_METADATA)


def _saved_step(opt_state) -> Optional[float]:
    """The Adam step stored in an optimizer state dict's param groups (DistributedOptimizer)."""
    if isinstance(opt_state, dict):
        for group in (opt_state.get("optimizer") or {}).get("param_groups", []) or []:
            if group.get("step") is not None:
                return float(group["step"])
        for value in opt_state.values():
            if isinstance(value, dict):
                found = _saved_step(value)
                if found is not None:
                    return found
    return None


def _restore_adam_steps(optimizer, opt_state) -> None:
    """Give every parameter its own, correct Adam ``step`` tensor after a load.

    megatron-core keeps one shared step: restored as one tensor object, every in-place
    ``step += 1`` would advance all parameters' counters at once. The DistributedOptimizer
    also leaves the counters of the dummy step taken to allocate its state (the real value
    is in its param groups), which would silently shift Adam's bias correction.
    """
    saved = _saved_step(opt_state)
    for inner in getattr(optimizer, "chained_optimizers", [optimizer]):
        torch_opt = getattr(inner, "optimizer", None)
        if torch_opt is None:
            continue
        for st in torch_opt.state.values():
            step = st.get("step")
            if not isinstance(step, torch.Tensor):
                continue
            st["step"] = step.clone() if saved is None else torch.full_like(step, saved)


def _extras(model, model_sd: dict) -> dict:
    """What the model keeps in training checkpoints beside its weights (a changing reference policy)."""
    extras = getattr(model, "checkpoint_extras", None)
    return extras(model_sd) if extras is not None else {}


def _model_state(model) -> dict:
    """The model's part of a training checkpoint (with LoRA only the trained tensors)."""
    select = getattr(model, "checkpoint_state_dict", None)
    return select() if select is not None else model.sharded_state_dict()


# trainer.precision of a run whose weights have this dtype
_PRECISION_OF = {"float32": "32", "bfloat16": "bf16", "float16": "16"}


def _weights_dtype(model) -> str:
    """The dtype of the model's weights (``float32``, ``bfloat16``, ...): trainer.precision decides it,
    and with it the layout of the optimizer state (float32 master copies beside half-precision weights)."""
    first = next(iter(getattr(model, "module", model).parameters()), None)
    return str(first.dtype).replace("torch.", "") if first is not None else "none"


def _optimizer_layout(model) -> dict:
    """What decides the layout of the optimizer state, saved with each checkpoint."""
    optim = (getattr(model, "cfg", None) or {}).get("optim") or {}
    name = str(optim.get("name", "fused_adam"))
    return {"weights_dtype": _weights_dtype(model), "distributed_optimizer": uses_distributed_optimizer(optim),
            "optimizer": "sgd" if name.lower() == "sgd" else "adam", "optim_name": name}


def _optimizer_kind(layout: dict) -> str:
    where = "a distributed" if layout.get("distributed_optimizer") else "a plain (not distributed)"
    return f"{where} {'SGD' if layout.get('optimizer') == 'sgd' else 'Adam'} optimizer"


def check_optimizer_layout(directory: str, saved: dict, model) -> None:
    """A checkpoint whose optimizer state has another layout (another precision, a distributed optimizer
    against a plain one, SGD against Adam) is an error naming both sides (checkpoints from before these
    fields: no check)."""
    now = _optimizer_layout(model)
    fix = ("the optimizer state does not carry over between them: resume with the setting it was saved with, "
           "or start a new run in another exp_manager.explicit_log_dir")
    then_dtype = saved.get("weights_dtype")
    if then_dtype is not None and then_dtype != now["weights_dtype"]:
        raise CheckpointError(
            f"checkpoint {directory} was saved by a run with {then_dtype} weights (trainer.precision="
            f"{_PRECISION_OF.get(then_dtype, then_dtype)}); this run's are {now['weights_dtype']} (trainer.precision="
            f"{_PRECISION_OF.get(now['weights_dtype'], now['weights_dtype'])}) and {fix}")
    if "distributed_optimizer" in saved and _optimizer_kind(saved) != _optimizer_kind(now):
        raise CheckpointError(
            f"checkpoint {directory} was saved with {_optimizer_kind(saved)} (model.optim.name="
            f"{saved.get('optim_name')}); this run has {_optimizer_kind(now)} (model.optim.name={now['optim_name']}) "
            f"and {fix}")


def save_train_checkpoint(directory: str, model, optimizer, scheduler, trainer_state: dict) -> None:
    """Collective: write a complete training checkpoint to ``directory`` (atomically)."""
    trainer_state = {**trainer_state, **_optimizer_layout(model)}
    model_sd = _model_state(model)
    sharded = {"state_dict": {**model_sd, **_extras(model, model_sd)}}
    opt_sd = _optimizer_sharded(model, optimizer, model_sd, is_loading=False)
    if opt_sd is not None:
        sharded["optimizer_states"] = [opt_sd]
    if scheduler is not None:
        sharded["lr_schedulers"] = [scheduler.state_dict()]
    sharded["trainer_state"] = dict(trainer_state)
    rank = get_rank()
    rng = rng_state()

    def add_rank_files(tmp_dir: str) -> None:
        torch.save(rng, os.path.join(tmp_dir, f"rng_state_{rank}.pt"))
        if rank == 0:
            with open(os.path.join(tmp_dir, TRAINER_STATE), "w", encoding="utf-8") as f:
                json.dump(trainer_state, f, indent=2, default=float)

    save_sharded(sharded, directory, before_commit=add_rank_files)


def read_trainer_state(directory: str) -> Optional[dict]:
    path = os.path.join(directory, TRAINER_STATE)
    if not os.path.isfile(path):
        return None
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def nemo_written_state(directory: str) -> Optional[dict]:
    """The trainer state of a training checkpoint that NeMo(-Aligner) wrote (a torch_dist directory
    without this project's ``trainer_state.json`` and ``rng_state_<rank>.pt``), read from its name as
    NeMo-Aligner reads it (``megatron_gpt--val_loss=1.234-step=40-consumed_samples=320.0-epoch=0-last``);
    None for any other directory, or a name without ``step=``."""
    if not os.path.isfile(os.path.join(directory, "metadata.json")) or \
            os.path.isfile(os.path.join(directory, TRAINER_STATE)) or \
            any(name.startswith("rng_state_") for name in os.listdir(directory)):
        return None
    name = os.path.basename(os.path.normpath(directory))
    state = {}
    for key, ours in _NEMO_NAME_COUNTERS.items():
        match = re.search(rf"(?<![A-Za-z0-9_]){key}=(\d+(?:\.\d*)?)", name)
        if match and ours not in state:
            state[ours] = int(float(match.group(1)))
    if "step" not in state:
        return None
    state.setdefault("consumed_samples", 0)
    return dict(state, written_by="nemo")


def nemo_unfinished(directory: str) -> bool:
    """NeMo's ``<checkpoint>-unfinished`` marker is beside ``directory``: its save never completed."""
    return os.path.exists(os.path.normpath(directory) + NEMO_UNFINISHED_SUFFIX)


def run_identity(algorithm: str, sampler) -> dict:
    """What a resumed run must share with the saved one to continue its data order: saved in the
    trainer state and compared by :func:`check_resumed_run`."""
    return {"algorithm": algorithm, "train_samples": int(sampler.total_samples), "data_seed": int(sampler.seed),
            "global_batch_size": int(sampler.global_batch_size)}


def check_resumed_run(directory: str, saved: dict, current: dict, key: str) -> None:
    """A checkpoint of another algorithm is an error; other differences that change which samples the
    rest of the epoch draws are a warning naming them (checkpoints from before these fields: no check)."""
    if saved.get("algorithm") not in (None, current["algorithm"]):
        raise CheckpointError(f"checkpoint {directory} was saved by a {saved['algorithm']!r} run; this is "
                              f"{current['algorithm']!r} ({key}): resume from one of its own checkpoints")
    names = {"train_samples": "training samples", "data_seed": "data seed (model.seed)",
             "global_batch_size": "global batch size"}
    changed = [f"{names[k]} {saved[k]} -> {current[k]}" for k in names if k in saved and saved[k] != current[k]]
    if changed:
        logger.warning("resuming from %s with %s: the rest of the current epoch is drawn from a new order, so "
                       "some samples of it may repeat and others be skipped (later epochs are unaffected)",
                       directory, ", ".join(changed))


_SCHEDULE_KEYS = ("max_lr", "min_lr", "lr_warmup_steps", "lr_decay_steps", "lr_decay_style", "start_wd", "end_wd")


def _load_scheduler(directory: str, scheduler, saved: dict) -> None:
    """The checkpoint's learning-rate schedule continues (megatron-core's default); a config that
    now asks for another one gets a warning naming the differences, or, with
    ``model.optim.sched.override_checkpoint_schedule=True``, its own schedule from the saved step on."""
    mine = scheduler.state_dict()
    changed = {k: (saved.get(k), mine.get(k)) for k in _SCHEDULE_KEYS if k in saved and saved.get(k) != mine.get(k)}
    override = bool(getattr(scheduler, "override_opt_param_scheduler", False))
    if changed and not override:
        logger.warning("resuming from %s: its learning-rate schedule continues (%s); the config's differs (%s). "
                       "To follow the config's schedule from here, set "
                       "++model.optim.sched.override_checkpoint_schedule=True", directory,
                       ", ".join(f"{k} {a}" for k, (a, _) in changed.items()),
                       ", ".join(f"{k} {b}" for k, (_, b) in changed.items()))
    elif changed:
        logger.info("resuming from %s with the config's learning-rate schedule (%s)", directory,
                    ", ".join(f"{k} {a} -> {b}" for k, (a, b) in changed.items()))
        # megatron-core's optimizer keeps max_lr/min_lr per parameter group, restored with its state
        for group in scheduler.optimizer.param_groups:
            for key in ("max_lr", "min_lr"):
                if key in group and group[key] == saved.get(key):
                    group[key] = getattr(scheduler, key)
    scheduler.load_state_dict(saved)


def _stored_extras(directory: str, extras: dict) -> dict:
    """The entries of ``extras`` (a reference policy) a NeMo-written checkpoint holds; without them the
    run's starting weights stay the reference, as NeMo-Aligner's PPO/REINFORCE actors rebuild it."""
    from nemo_aligner.utils.checkpoint_io import checkpoint_contents

    if not extras:
        return extras
    stored, _ = checkpoint_contents(directory)
    kept = {k: v for k, v in extras.items() if getattr(v, "key", k) in stored}
    if len(kept) < len(extras):
        logger.warning("checkpoint %s has no reference-policy weights: the reference policy is the run's "
                       "starting model", directory)
        return {}
    return kept


def _continue_nemo_schedule(scheduler, state: dict, saved) -> None:
    """Put the scheduler where NeMo's was (``saved``: the checkpoint's first ``lr_schedulers`` entry): its
    optimizer steps (Lightning's ``last_epoch`` of the saved scheduler, else the counter of optimizer
    steps in the name, else the step)."""
    if scheduler is None:
        return
    steps = None
    if isinstance(saved, dict) and isinstance(saved.get("last_epoch"), int) and saved["last_epoch"] >= 0:
        steps = saved["last_epoch"]
    if steps is None:
        steps = int(state.get("ppo_optimization_step", state["step"]))
    if steps > 0:
        scheduler.step(increment=steps)


def load_train_checkpoint(directory: str, model, optimizer, scheduler, load_rng: bool = True,
                          identity: Optional[dict] = None, key: str = "") -> dict:
    """Collective: restore model, optimizer, scheduler and RNG from ``directory``; returns the trainer
    state. ``identity`` (:func:`run_identity` of the resuming run, whose config section is ``key``)
    is checked against the saved one first."""
    state = read_trainer_state(directory)
    nemo_written = state is None and (state := nemo_written_state(directory)) is not None
    if nemo_written:
        if nemo_unfinished(directory):
            raise CheckpointError(f"checkpoint {directory}: NeMo marked it unfinished ({NEMO_UNFINISHED_SUFFIX} "
                                  "beside it): its save never completed; resume from an earlier one")
    elif state is None:
        raise CheckpointError(f"{directory}: not a training checkpoint (no {TRAINER_STATE}, and not a NeMo "
                              "checkpoint directory named with its step=)")
    if identity is not None and not nemo_written:
        check_resumed_run(directory, state, identity, key)
    if optimizer is not None and not nemo_written:
        check_optimizer_layout(directory, state, model)
    model_sd = _model_state(model)
    extras = _extras(model, model_sd)
    if nemo_written:
        extras = _stored_extras(directory, extras)
    sharded = {"state_dict": {**model_sd, **extras}}
    with torch.no_grad():
        opt_sd = None if nemo_written else _optimizer_sharded(model, optimizer, model_sd, is_loading=True)
        if opt_sd is not None:
            sharded["optimizer_states"] = [opt_sd]
        loaded, _ = load_sharded(sharded, directory, what="checkpoint")
        weights = {k[len("model."):]: v for k, v in loaded["state_dict"].items() if k.startswith("model.")}
        if extras:
            model.load_checkpoint_extras({k: loaded["state_dict"][k] for k in extras})
        result = model.module.load_state_dict(weights, strict=False)
        trained = model.trainable_names() if hasattr(model, "trainable_names") else None  # None: every weight
        missing = [k for k in result.missing_keys if not k.endswith("_extra_state")
                   and (trained is None or k in trained)]
        if missing:
            raise CheckpointError(f"checkpoint {directory}: no values for {missing[:3]}")
        if optimizer is not None and not nemo_written:
            if "optimizer_states" not in loaded:
                raise CheckpointError(f"checkpoint {directory}: has no optimizer state")
            with without_stub_optimizers(optimizer):  # the structure it was saved with
                _match_param_groups(optimizer, loaded["optimizer_states"][0])
                with float32_params_listed(optimizer):
                    optimizer.load_state_dict(loaded["optimizer_states"][0])
                _restore_adam_steps(optimizer, loaded["optimizer_states"][0])
    if nemo_written:
        if optimizer is not None:
            with without_stub_optimizers(optimizer):
                optimizer.reload_model_params()  # float32 master weights from the loaded ones
        _continue_nemo_schedule(scheduler, state, (loaded.get("lr_schedulers") or [None])[0])
        logger.warning("resuming from %s, a checkpoint NeMo wrote: its weights and counters (step %d, %d samples "
                       "consumed) are restored and its learning-rate schedule continues; the optimizer state "
                       "(Adam moments, float32 master weights) and the random state start afresh, and the rest of "
                       "the current epoch is drawn in this project's data order (some of its samples may repeat, "
                       "others be skipped; later epochs are unaffected)", directory,
                       state["step"], state["consumed_samples"])
        return state
    if scheduler is not None:
        schedulers = loaded.get("lr_schedulers")  # the checkpoint's common state comes with its tensors
        if schedulers:
            _load_scheduler(directory, scheduler, schedulers[0])
    rng_path = os.path.join(directory, f"rng_state_{get_rank()}.pt")
    if load_rng:
        if os.path.isfile(rng_path):
            try:
                set_rng_state(torch.load(rng_path, weights_only=False))
            except Exception as err:  # a torn or foreign file: pickle, zip or key errors
                raise CheckpointError(f"checkpoint {directory}: {os.path.basename(rng_path)} cannot be read "
                                      f"({type(err).__name__}); the checkpoint is damaged: move it aside to resume "
                                      "from an earlier one") from None
        else:
            logger.warning("%s has no RNG state for rank %d (saved with another world size); RNG not restored",
                           directory, get_rank())
    return state
