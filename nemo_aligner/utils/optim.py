"""Optimizer and LR schedule from NeMo's ``model.optim`` config, on megatron-core."""

from __future__ import annotations

import logging

import torch

from nemo_aligner.utils.errors import ConfigError

logger = logging.getLogger(__name__)

_ADAM_NAMES = {"adam", "adamw", "fused_adam", "distributed_fused_adam", "mcore_distributed_optim"}
_DISTRIBUTED_NAMES = {"distributed_fused_adam", "mcore_distributed_optim"}
_DECAY_STYLES = {
    "cosineannealing": "cosine",
    "cosine": "cosine",
    "constantlr": "constant",
    "constant": "constant",
    "linear": "linear",
    "linearannealing": "linear",
    "inversesquarerootannealing": "inverse-square-root",
}


def uses_distributed_optimizer(optim_cfg) -> bool:
    """``model.optim.name=distributed_fused_adam`` selects megatron-core's DistributedOptimizer."""
    return str(optim_cfg.get("name", "fused_adam")).lower() in _DISTRIBUTED_NAMES


def optim_lr(optim_cfg, warn: bool = False) -> float:
    """``model.optim.lr``; for a bare ``{name: sgd}`` torch's SGD default 1e-3, which NeMo's optimizer gets
    (NeMo-Aligner's CI runs so)."""
    lr = optim_cfg.get("lr")
    if lr is None and str(optim_cfg.get("name", "")).lower() == "sgd":
        if warn:
            logger.warning("model.optim.lr is not set: SGD uses torch's default lr=1e-3")
        return 1e-3
    if lr is None:
        raise ConfigError("model.optim.lr is required")
    return float(lr)


def _or_default(value, default: float) -> float:
    """A number key's value, null meaning its default (0 stays 0: the value checks refuse it where it is wrong)."""
    return default if value is None else float(value)


def optimizer_config(optim_cfg, dtype: torch.dtype, clip_grad: float):
    """megatron-core ``OptimizerConfig`` from ``model.optim`` (name, lr, weight_decay, betas, eps)."""
    from megatron.core.optimizer import OptimizerConfig

    name = str(optim_cfg.get("name", "fused_adam")).lower()
    if name not in _ADAM_NAMES and name != "sgd":
        raise ConfigError(f"model.optim.name={name!r} is not supported; use one of {sorted(_ADAM_NAMES | {'sgd'})}")
    betas = list(optim_cfg.get("betas", [0.9, 0.98]) or [0.9, 0.98])
    if len(betas) != 2:
        raise ConfigError(f"model.optim.betas must have two values, got {betas}")
    lr = optim_lr(optim_cfg, warn=True)
    return OptimizerConfig(
        optimizer="sgd" if name == "sgd" else "adam",
        lr=float(lr),
        min_lr=float((optim_cfg.get("sched") or {}).get("min_lr", 0.0) or 0.0),
        weight_decay=float(optim_cfg.get("weight_decay", 0.0) or 0.0),
        adam_beta1=float(betas[0]),
        adam_beta2=float(betas[1]),
        adam_eps=_or_default(optim_cfg.get("eps"), 1e-8),
        sgd_momentum=float(optim_cfg.get("momentum", 0.0) or 0.0),  # torch's SGD default, as NeMo's `name: sgd`
        bf16=dtype == torch.bfloat16,
        fp16=dtype == torch.float16,
        params_dtype=dtype,
        loss_scale=None,
        initial_loss_scale=_or_default(optim_cfg.get("initial_loss_scale"), 2.0**16),
        use_distributed_optimizer=name in _DISTRIBUTED_NAMES,
        clip_grad=float(clip_grad or 0.0),
    )


def _use_fused_adamw(optimizer) -> bool:
    """Switch megatron-core's torch AdamW to the fused kernel where the device supports it.

    Without Transformer Engine or apex, megatron-core builds ``torch.optim.AdamW``
    with its default (foreach) kernel. The fused kernel gives the same maths.
    """
    switched = False
    for inner in getattr(optimizer, "chained_optimizers", [optimizer]):
        torch_opt = getattr(inner, "optimizer", None)
        if not isinstance(torch_opt, torch.optim.AdamW):
            continue
        params = [p for g in torch_opt.param_groups for p in g["params"]]
        if not params or not all(p.dtype in (torch.float32, torch.bfloat16, torch.float16) for p in params):
            continue
        for group in torch_opt.param_groups:
            group["fused"] = True
            group["foreach"] = False
        torch_opt.defaults["fused"] = True
        torch_opt.defaults["foreach"] = False
        switched = True
    return switched


def build_optimizer(optim_cfg, model_chunks, dtype: torch.dtype, clip_grad: float):
    """The megatron-core optimizer for ``model_chunks`` (DDP-wrapped)."""
    from megatron.core.optimizer import get_megatron_optimizer

    config = optimizer_config(optim_cfg, dtype, clip_grad)
    optimizer = get_megatron_optimizer(config, model_chunks)
    if config.optimizer == "adam" and optim_cfg.get("fused", True):
        _use_fused_adamw(optimizer)
    return optimizer


# model.optim.sched keys the schedule reads (NeMo's CosineAnnealing's, and this project's override switch).
_SCHED_KEYS = ("name", "warmup_steps", "warmup_ratio", "constant_steps", "constant_ratio", "min_lr", "max_steps",
               "override_checkpoint_schedule")
# NeMo's phases: each a number of steps or a share of the run's steps (not both).
_PHASES = (("warmup_steps", "warmup_ratio"), ("constant_steps", "constant_ratio"))


def _phase_steps(sched, steps_key: str, ratio_key: str, total: int) -> int:
    return int(sched.get(steps_key) or int(float(sched.get(ratio_key) or 0.0) * total))


def check_schedule(optim_cfg, warn: bool = False) -> str:
    """Refuse, naming the keys, a ``model.optim.sched`` that NeMo refuses or that cannot decay (an unknown
    name; a phase given both as steps and as a ratio; ``min_lr`` above ``lr``); with ``warn``, name the
    keys the schedule does not read. Returns megatron-core's decay style."""
    sched = optim_cfg.get("sched") or {}
    name = str(sched.get("name", "constant") or "constant").lower()
    if name not in _DECAY_STYLES:
        raise ConfigError(f"model.optim.sched.name={sched.get('name')!r} is not supported; use CosineAnnealing or Constant")
    for steps, ratio in _PHASES:
        if sched.get(steps) is not None and sched.get(ratio) is not None:
            raise ConfigError(f"model.optim.sched.{steps}={sched.get(steps)} and model.optim.sched.{ratio}="
                              f"{sched.get(ratio)} are both set: NeMo takes one of them (set {steps}=null to use "
                              "the ratio)")
    style = _DECAY_STYLES[name]
    if style != "constant":
        lr, min_lr = optim_lr(optim_cfg), float(sched.get("min_lr", 0.0) or 0.0)
        if min_lr > lr:  # megatron-core asserts it (NeMo too); a schedule that "decays" upwards is a typo
            raise ConfigError(f"model.optim.sched.min_lr={min_lr:g} is above model.optim.lr={lr:g}: "
                              f"{sched.get('name')} decays from lr down to min_lr")
    if warn:
        for key in sched.keys():
            if str(key) not in _SCHED_KEYS and sched.get(key) is not None:
                logger.warning("model.optim.sched.%s is not read: the schedule reads %s", key, ", ".join(_SCHED_KEYS))
    return style


def build_scheduler(optimizer, optim_cfg, max_steps: int):
    """NeMo's schedules on megatron-core's ``OptimizerParamScheduler``.

    ``CosineAnnealing``: linear warm-up over ``warmup_steps``, cosine decay to ``min_lr`` until
    ``max_steps - constant_steps``, then ``min_lr``. As NeMo's: the warm-up's first step takes
    ``lr / (warmup_steps + 1)`` without ``constant_steps`` and 0 with them (NeMo's Megatron-style branch,
    ``lr * step / warmup_steps``), and a run that ends within ``warmup_steps + constant_steps`` holds
    ``min_lr`` from the end of the warm-up (with a warning).
    ``Constant``/``ConstantLR`` (or no ``sched``): warm-up, then ``lr``.
    """
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    style = check_schedule(optim_cfg)
    sched = optim_cfg.get("sched") or {}
    lr = optim_lr(optim_cfg)
    min_lr = float(sched.get("min_lr", 0.0) or 0.0) if style != "constant" else lr
    total = int(sched.get("max_steps", 0) or max_steps)
    warmup, constant = (_phase_steps(sched, steps, ratio, total) for steps, ratio in _PHASES)
    decay_steps = max(total - constant, 1)
    hold_phase = style == "cosine" and constant > 0  # NeMo's CosineAnnealing with constant_steps
    if style != "constant" and decay_steps <= warmup:
        if total <= warmup:
            logger.warning("model.optim.sched: the run's %d steps end within the warm-up (warmup_steps=%d): the LR "
                           "stays below model.optim.lr=%g", total, warmup, lr)
            style, min_lr = "constant", lr
        elif hold_phase:
            logger.warning("model.optim.sched: the run's %d steps end within warmup_steps (%d) + constant_steps (%d): "
                           "after warm-up the LR stays at min_lr=%g, as NeMo's CosineAnnealing does; lower "
                           "model.optim.sched.constant_steps to decay from lr over the run", total, warmup, constant,
                           min_lr)
            decay_steps = warmup + 1  # min_lr from the first step after the warm-up
        else:
            logger.warning("model.optim.sched: no steps left to decay after warm-up; using a constant LR")
            style, min_lr = "constant", lr
    weight_decay = float(optim_cfg.get("weight_decay", 0.0) or 0.0)
    # megatron-core requires warm-up to end before decay does, even for a constant schedule.
    decay_steps = max(decay_steps, warmup + 1)
    return OptimizerParamScheduler(
        optimizer,
        # NeMo's warm-up: lr * (step + 1) / (warmup_steps + 1), so the first step already learns; with
        # constant_steps its CosineAnnealing warms up as Megatron does, lr * step / warmup_steps.
        init_lr=(0.0 if hold_phase else lr / (warmup + 1)) if warmup else lr,
        max_lr=lr,
        min_lr=min_lr,
        lr_warmup_steps=warmup,
        lr_decay_steps=decay_steps,
        lr_decay_style=style,
        start_wd=weight_decay,
        end_wd=weight_decay,
        wd_incr_steps=1,
        wd_incr_style="constant",
        # On resume the checkpoint's schedule continues unless the config asks for its own.
        use_checkpoint_opt_param_scheduler=not bool(sched.get("override_checkpoint_schedule", False)),
        override_opt_param_scheduler=bool(sched.get("override_checkpoint_schedule", False)),
    )


def current_lr(optimizer) -> float:
    for group in optimizer.param_groups:
        return float(group["lr"])
    return 0.0


class OptimizerOffload:
    """Moves an optimizer's states (Adam's moments) and its master weights off the GPU while a model
    generates, and back before it trains (``model.ppo.offload_adam_states``).

    megatron-core's ``offload_to_cpu`` moves every tensor in the optimizer's parameter groups: in
    float32 those are the model's own parameters (and a bf16 model's float32 head), which would
    then run generation on the CPU. Here the model's parameters never move.
    """

    def __init__(self, optimizer, model_parameters):
        self.optimizer = optimizer
        self.keep = {id(p) for p in model_parameters}
        self.moved = []  # (holder, key, original device): put back by restore()

    def _inner(self):
        chained = getattr(self.optimizer, "chained_optimizers", None) or [self.optimizer]
        return [o.optimizer for o in chained if getattr(o, "optimizer", None) is not None]

    def master_weights(self) -> list:
        """The parameter-group tensors that are not the model's own (bf16/fp16 master copies)."""
        return [p for inner in self._inner() for group in inner.param_groups for p in group["params"]
                if id(p) not in self.keep]

    def offload(self, device=torch.device("cpu")) -> None:
        """Move the states and master weights to ``device`` (idempotent)."""
        if self.moved:
            return
        for p in self.master_weights():
            if p.device != device:
                self.moved.append((p, None, p.device))
                p.data = p.data.to(device)
        for inner in self._inner():
            for state in inner.state.values():
                for key, value in state.items():
                    if isinstance(value, torch.Tensor) and value.device != device:
                        self.moved.append((state, key, value.device))
                        state[key] = value.to(device)

    def restore(self) -> None:
        """Put everything ``offload`` moved back where it was."""
        for holder, key, device in self.moved:
            if key is None:
                holder.data = holder.data.to(device)
            else:
                holder[key] = holder[key].to(device)
        self.moved = []
