"""Training callbacks for the Python API: subclass :class:`Callback` and pass instances to ``fit``.

Every hook gets the API trainer first; steps count from 1 (``on_step_begin(trainer, 1)`` precedes
the first step, ``on_step_end(trainer, 1, metrics)`` follows it).
"""

from __future__ import annotations

import inspect
from typing import Any, Dict, Iterable, Optional


class Callback:
    """Override the hooks you need; the defaults do nothing."""

    def on_train_begin(self, trainer) -> None:
        pass

    def on_step_begin(self, trainer, step: int) -> None:
        pass

    def on_step_end(self, trainer, step: int, metrics: Dict[str, float]) -> None:
        pass

    def on_epoch_end(self, trainer, epoch: int) -> None:
        pass

    def on_train_end(self, trainer, result: Any) -> None:
        pass


class CallbackList:
    """What the training loops call: forwards every hook to each callback with ``owner`` bound."""

    def __init__(self, callbacks: Optional[Iterable[Callback]] = None, owner=None):
        if callbacks is not None and (isinstance(callbacks, Callback) or any(hasattr(callbacks, h) for h in _HOOKS)):
            raise TypeError(f"callbacks must be a list of callbacks (callbacks=[{type(callbacks).__name__}()]), "
                            f"got one {type(callbacks).__name__}")
        self.callbacks = list(callbacks or [])
        self.owner = owner
        for cb in self.callbacks:
            if inspect.isclass(cb):
                raise TypeError(f"callback {cb.__name__} is a class; pass an instance: callbacks=[{cb.__name__}()]")
            if not isinstance(cb, Callback) and not any(hasattr(cb, h) for h in _HOOKS):
                raise TypeError(f"callback {cb!r} has none of the hooks {', '.join(_HOOKS)}")
            for hook, params in _HOOK_PARAMS.items():
                fn = getattr(cb, hook, None)
                if fn is None:
                    continue
                try:
                    signature = inspect.signature(fn)
                except ValueError:  # no signature to inspect
                    continue
                expected = ", ".join(("trainer",) + params)
                # transformers' TrainerCallback hooks take (args, state, control): the same count for on_step_end
                transformers_style = (any(k.__name__ == "TrainerCallback" for k in type(cb).__mro__)
                                      or tuple(signature.parameters)[:3] == ("args", "state", "control"))
                try:
                    signature.bind(owner, *params)
                except TypeError:
                    transformers_style = True
                if transformers_style:
                    raise TypeError(f"callback {type(cb).__name__}.{hook}{signature} cannot be called as "
                                    f"{hook}({expected}): nemo-aligner's hooks (subclass "
                                    "nemo_aligner.algorithms.callbacks.Callback), not transformers' TrainerCallback")

    def _call(self, hook: str, *args) -> None:
        for cb in self.callbacks:
            fn = getattr(cb, hook, None)
            if fn is not None:
                fn(self.owner, *args)

    def on_train_begin(self) -> None:
        self._call("on_train_begin")

    def on_step_begin(self, step: int) -> None:
        self._call("on_step_begin", step)

    def on_step_end(self, step: int, metrics: Dict[str, float]) -> None:
        self._call("on_step_end", step, metrics)

    def on_epoch_end(self, epoch: int) -> None:
        self._call("on_epoch_end", epoch)

    def on_train_end(self, result: Any) -> None:
        self._call("on_train_end", result)


# Each hook's arguments after the trainer (binding their names checks a callback's signature).
_HOOK_PARAMS = {"on_train_begin": (), "on_step_begin": ("step",), "on_step_end": ("step", "metrics"),
                "on_epoch_end": ("epoch",), "on_train_end": ("result",)}
_HOOKS = tuple(_HOOK_PARAMS)
