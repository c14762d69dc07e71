"""Where critic-free RL gets its rewards: a Python function or an environment (a reward-model server:
:class:`nemo_aligner.servers.clients.RemoteRewardSource`).

All answer ``score(tokens, prompt_lengths, response_lengths, metadata=None)`` with a future whose
``result()`` is a float32 array [B], so the trainer overlaps scoring with generation either way.
``metadata`` holds each row's prompt record fields besides the prompt (a reference answer, say):
a reward function receives those its signature names (or all, with ``**kwargs``), as TRL passes
dataset columns; an environment receives the list, as NeMo-RL's ``step(conversations, metadata)``.
"""

from __future__ import annotations

import importlib
import inspect
import math
from concurrent.futures import Future
from typing import Callable, List, Optional, Tuple

import numpy as np

from nemo_aligner.utils.errors import ConfigError

RewardFn = Callable[[str, str], float]


def load_reward_fn(spec: str, key: str = "reward_fn") -> RewardFn:
    """``"package.module:function"`` -> the function (called as ``fn(prompt, response) -> float``)."""
    module_name, sep, attr = str(spec).partition(":")
    if not sep or not module_name or not attr:
        raise ConfigError(f"{key}={spec!r} must be 'package.module:function'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        raise ConfigError(f"{key}={spec!r}: cannot import {module_name!r} ({err})") from None
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise ConfigError(f"{key}={spec!r}: {module_name!r} has no function {attr!r}")
    return fn


def decode_rollouts(tokenizer, tokens: np.ndarray, prompt_lengths: np.ndarray, response_lengths: np.ndarray):
    """``(prompt text, response text)`` per row of right-padded rollouts (the response's EOS dropped)."""
    for b in range(len(tokens)):
        p, end = int(prompt_lengths[b]), int(response_lengths[b])
        ids = [int(t) for t in tokens[b, p:end]]
        if ids and ids[-1] == tokenizer.eos_id:
            ids = ids[:-1]
        yield tokenizer.ids_to_text([int(t) for t in tokens[b, :p]]), tokenizer.ids_to_text(ids)


def reward_fn_fields(fn) -> Tuple[Optional[frozenset], frozenset]:
    """``(accepted, required)``: the metadata fields ``fn`` takes as keyword arguments after
    ``(prompt, response)`` (None: all of them, it has ``**kwargs``) and those without a default."""
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):  # no signature to read: the two text arguments only
        return frozenset(), frozenset()
    named = [p for p in params[2:] if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    required = frozenset(p.name for p in named if p.default is p.empty)
    if any(p.kind is p.VAR_KEYWORD for p in params):
        return None, required
    return frozenset(p.name for p in named), required


class FunctionRewardSource:
    """Rewards from ``fn(prompt_text, response_text, **fields)``, computed at once (a finished future);
    ``fields`` are the prompt record's metadata the function's signature asks for."""

    def __init__(self, fn: RewardFn, tokenizer, key: str = "reward_fn"):
        self.fn = fn
        self.tokenizer = tokenizer
        self.key = key
        self.accepted, self.required = reward_fn_fields(fn)

    def score(self, tokens: np.ndarray, prompt_lengths: np.ndarray, response_lengths: np.ndarray,
              metadata: Optional[List[dict]] = None) -> Future:
        rewards = np.zeros(len(tokens), dtype=np.float32)
        for b, (prompt, response) in enumerate(decode_rollouts(self.tokenizer, tokens, prompt_lengths, response_lengths)):
            meta = metadata[b] if metadata else {}
            missing = self.required - set(meta)
            if missing:
                raise ConfigError(f"{self.key} takes {sorted(missing)}, which the prompt {prompt[-80:]!r} has no field "
                                  f"for (its other fields: {sorted(meta)})")
            fields = meta if self.accepted is None else {k: v for k, v in meta.items() if k in self.accepted}
            value = self.fn(prompt, response, **fields)
            try:
                rewards[b] = float(value)
            except (TypeError, ValueError):
                raise ConfigError(f"{self.key} returned {value!r} for a response; it must return a float") from None
            if not math.isfinite(rewards[b]):
                raise ConfigError(f"{self.key} returned {value!r} for the response {response[:80]!r} to the prompt "
                                  f"{prompt[-80:]!r}; rewards must be finite (one NaN makes the whole step's "
                                  "advantages NaN)")
        future: Future = Future()
        future.set_result(rewards)
        return future

    def close(self) -> None:
        pass


class EnvironmentRewardSource:
    """Rewards from an :class:`EnvironmentInterface`. Single-turn: one ``step`` per scored micro-batch, on
    the conversation ``[user: prompt, assistant: response]``. Multi-turn episodes (the trainer's
    ``max_rollout_turns`` > 1) call :meth:`step` once per turn with the growing conversations."""

    multi_turn = True  # the trainer may continue episodes the environment does not end

    def __init__(self, environment, tokenizer):
        self.environment = environment
        self.tokenizer = tokenizer
        self._warned = False
        try:
            inspect.signature(environment.step).bind([], [])
            self._takes_metadata = True
        except TypeError:
            self._takes_metadata = False
        except ValueError:  # no signature to read: NeMo-RL's form
            self._takes_metadata = True

    def step(self, conversations: List[list], metadata: Optional[List[dict]] = None, need_observations: bool = False):
        """One environment step, checked: ``(rewards float32 [B], done [B] bools, observations [B])``;
        with ``need_observations`` every conversation not done must get a message to continue with."""
        if self._takes_metadata:
            result = self.environment.step(conversations, metadata if metadata is not None else [{}] * len(conversations))
        else:  # an environment written as step(conversations)
            result = self.environment.step(conversations)
        rewards = np.asarray(result.rewards, dtype=np.float32).reshape(-1)
        if len(rewards) != len(conversations):
            raise ConfigError(f"environment.step returned {len(rewards)} rewards for {len(conversations)} conversations")
        bad = np.flatnonzero(~np.isfinite(rewards))
        if len(bad):
            raise ConfigError(f"environment.step returned {rewards[bad[0]]} as the reward of conversation {bad[0]} "
                              f"({len(bad)} non-finite in all); rewards must be finite")
        done = [bool(d) for d in (result.done if result.done is not None else [True] * len(conversations))]
        if len(done) != len(conversations):
            raise ConfigError(f"environment.step returned {len(done)} done flags for {len(conversations)} conversations")
        observations = list(getattr(result, "observations", None) or [None] * len(conversations))
        if need_observations:
            if len(observations) != len(conversations):
                raise ConfigError(f"environment.step returned {len(observations)} observations for {len(conversations)} "
                                  "conversations; give one per conversation (None where done)")
            for i, (d, obs) in enumerate(zip(done, observations)):
                if not d and not (isinstance(obs, dict) and isinstance(obs.get("content"), str)):
                    raise ConfigError(f"environment.step left conversation {i} not done but its observation is {obs!r}; "
                                      "give a message such as {'role': 'user', 'content': '...'} to continue with")
        return rewards, done, observations

    def score(self, tokens: np.ndarray, prompt_lengths: np.ndarray, response_lengths: np.ndarray,
              metadata: Optional[List[dict]] = None) -> Future:
        import logging

        conversations = [[{"role": "user", "content": prompt}, {"role": "assistant", "content": response}]
                         for prompt, response in decode_rollouts(self.tokenizer, tokens, prompt_lengths, response_lengths)]
        rewards, done, _ = self.step(conversations, metadata)
        if not self._warned and not all(done):
            self._warned = True
            logging.getLogger(__name__).warning("the environment continues some episodes (done=False) but episodes here "
                                                "have one turn: set max_rollout_turns > 1 to play them on")
        future: Future = Future()
        future.set_result(rewards)
        return future

    def close(self) -> None:
        pass
