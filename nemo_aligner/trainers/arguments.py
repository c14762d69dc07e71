"""Checks of what a Python-API user passes, so a mistake names the argument (or config key) it is
in before anything runs, instead of surfacing as a bare ``TypeError`` deep inside a fit or being
silently ignored."""

from __future__ import annotations

import inspect
import os
from typing import Any, Callable, Dict, Iterable, Mapping, Optional, Tuple

from nemo_aligner.utils.errors import ConfigError

# (kind, minimum): kind "int", "float" (an int is fine), "floats" (a number or a list of them), "bool" or
# "str"; minimum None or (value, strict)
Rule = Tuple[str, Optional[Tuple[float, bool]]]

POLICY_RULES: Dict[str, Rule] = {
    "model_name": ("str", None),
    "learning_rate": ("float", (0.0, True)),
    "max_total_sequence_length": ("int", (1, False)),
    "dtensor_cfg": ("dict", None),
}
COMMON_RULES: Dict[str, Rule] = {
    "micro_batch_size": ("int", (1, False)), "global_batch_size": ("int", (1, False)),
    "batch_size": ("int", (1, False)), "seed": ("int", None),
    "tensor_parallel_size": ("int", (1, False)), "pipeline_parallel_size": ("int", (1, False)),
    "val_check_interval": ("float", (0.0, False)), "val_period": ("int", (0, False)),
}
TOP_LEVEL = ("policy", "output_dir", "precision", "overrides", "use_wandb")
NONE_MEANS_NEVER = frozenset({"val_check_interval", "val_period", "save_period"})  # every other key needs a value


def _check_value(where: str, value: Any, rule: Rule) -> None:
    kind, minimum = rule
    if kind == "dict":
        if not isinstance(value, Mapping):
            raise ConfigError(f"{where} must be a dict, got {type(value).__name__}")
        return
    if kind == "str":
        if not isinstance(value, (str, os.PathLike)):
            raise ConfigError(f"{where}={value!r} must be a string, got {type(value).__name__}")
        return
    if kind == "bool":
        if not isinstance(value, bool):
            raise ConfigError(f"{where}={value!r} must be True or False, got {type(value).__name__}")
        return
    if kind == "floats":
        values = list(value) if isinstance(value, (list, tuple)) else [value]
        if not values:
            raise ConfigError(f"{where}=[] needs at least one number")
        for item in values:
            _check_value(where, item, ("float", minimum))
        return
    allowed = (int,) if kind == "int" else (int, float)
    if isinstance(value, bool) or not isinstance(value, allowed):
        what = "an integer" if kind == "int" else "a number"
        raise ConfigError(f"{where}={value!r} must be {what}, got {type(value).__name__}")
    if minimum is not None:
        bound, strict = minimum
        if value < bound or (strict and value == bound):
            raise ConfigError(f"{where}={value!r} must be {'>' if strict else '>='} {bound}")


def check_trainer_config(config: Mapping[str, Any], section: str, section_rules: Dict[str, Rule],
                         owner: str) -> None:
    """Every key of a trainer's config dict is known and has the right type and range; the message
    names the key (``grpo.num_prompts_per_step``), which is also the ``from_pretrained`` argument."""
    unknown = sorted(set(config) - set(TOP_LEVEL) - {section})
    if unknown:
        raise ConfigError(f"{owner}: unknown config key(s) {unknown}; known: {sorted(TOP_LEVEL + (section,))}")
    rules = dict(COMMON_RULES, **section_rules)
    for name, known in (("policy", POLICY_RULES), (section, rules)):
        values = config.get(name) or {}
        if not isinstance(values, Mapping):
            raise ConfigError(f"{owner}: config {name!r} must be a dict, got {type(values).__name__}")
        typos = sorted(set(values) - set(known))
        if typos:
            raise ConfigError(f"{owner}: unknown key(s) {[f'{name}.{k}' for k in typos]}; known under {name!r}: "
                              f"{sorted(known)}")
        for key, value in values.items():
            if value is None and key in NONE_MEANS_NEVER:
                continue
            _check_value(f"{name}.{key}", value, known[key])
    overrides = config.get("overrides")
    if overrides is not None and not isinstance(overrides, Mapping):
        raise ConfigError(f"{owner}: overrides must be a dict of dotted config keys to values "
                          f"(overrides={{'model.optim.lr': 1e-5}}), got {type(overrides).__name__}")
    output_dir = config.get("output_dir")
    if output_dir is not None and os.path.exists(output_dir) and not os.path.isdir(output_dir):
        raise ConfigError(f"{owner}: output_dir={output_dir!r} is a file, not a directory")


def check_model_path(path: str, key: str) -> None:
    """A local ``.nemo`` file or Hugging Face model directory (checked now, imported when first needed)."""
    if os.path.isfile(path) or (os.path.isdir(path) and os.path.isfile(os.path.join(path, "config.json"))):
        return
    what = "does not exist" if not os.path.exists(path) else "is a directory without config.json"
    raise ConfigError(f"{key}={path!r} {what}: give a local .nemo file or Hugging Face model directory "
                      "(config.json + safetensors); models are not downloaded at run time")


def check_steps(max_steps: Optional[int], max_epochs: Optional[int], owner: str) -> None:
    for name, value in (("max_steps", max_steps), ("max_epochs", max_epochs)):
        if value is not None:
            _check_value(f"{owner}({name})", value, ("int", (1, False)))


def check_fit_kwargs(given: Iterable[str], values_fn: Callable, owner: str) -> None:
    """``fit``'s keyword arguments are those its trainer's ``_values`` takes (TRL-style names are
    not silently accepted)."""
    params = [p for p in inspect.signature(values_fn).parameters if p not in ("self", "dataset", "run_dir")]
    unknown = sorted(set(given) - set(params))
    if unknown:
        raise ConfigError(f"{owner}: unknown argument(s) {unknown}; known: {sorted(params + ['callbacks'])}")


def check_reward_fn(reward_fn: Any, owner: str):
    """A callable ``(prompt, response, **fields) -> float``, or its ``"module:function"`` path (loaded here)."""
    from nemo_aligner.environments.reward_sources import load_reward_fn, reward_fn_fields

    if isinstance(reward_fn, str):
        reward_fn = load_reward_fn(reward_fn)
    if not callable(reward_fn):
        raise ConfigError(f"{owner}: reward_fn must be a function (prompt, response) -> float, "
                          f"got {type(reward_fn).__name__}")
    try:
        # parameters after (prompt, response) are filled from the prompt record's other fields
        inspect.signature(reward_fn).bind("prompt", "response", **dict.fromkeys(reward_fn_fields(reward_fn)[1]))
    except TypeError:
        raise ConfigError(f"{owner}: reward_fn{inspect.signature(reward_fn)} cannot be called as "
                          "reward_fn(prompt, response, **fields) -> float (one response at a time, the prompt "
                          "record's other fields as keyword arguments; a TRL-style reward_fn(completions, "
                          "**kwargs) needs a wrapper)") from None
    except ValueError:  # a builtin without a signature: let the first call tell
        pass
    return reward_fn


def check_environment(environment: Any, owner: str) -> None:
    if not callable(getattr(environment, "step", None)):
        raise ConfigError(f"{owner}: environment must have a step(conversations) method (an EnvironmentInterface), "
                          f"got {type(environment).__name__}")
