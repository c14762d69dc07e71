"""Training callbacks for the Python API: subclass :class:`Callback` and pass instances to ``fit``.

Every hook gets the API trainer first; steps count from 1 (``on_step_begin(trainer, 1)`` precedes
the first step, ``on_step_end(trainer, 1, metrics)`` follows it).
"""

from __future__ import annotations

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
        self.callbacks = list(callbacks or [])
        self.owner = owner
        for cb in self.callbacks:
            if not isinstance(cb, Callback) and not any(hasattr(cb, h) for h in _HOOKS):
                raise TypeError(f"callback {cb!r} has none of the hooks {', '.join(_HOOKS)}")

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


_HOOKS = ("on_train_begin", "on_step_begin", "on_step_end", "on_epoch_end", "on_train_end")
