"""Where critic-free RL gets its rewards: a reward-model server or a Python function.

Both answer ``score(tokens, prompt_lengths, response_lengths)`` with a future whose ``result()``
is a float32 array [B], so the trainer overlaps scoring with generation either way.
"""

from __future__ import annotations

import importlib
import math
from concurrent.futures import Future
from typing import Callable, Optional

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


class FunctionRewardSource:
    """Rewards from ``fn(prompt_text, response_text)``, computed at once (a finished future)."""

    def __init__(self, fn: RewardFn, tokenizer, key: str = "reward_fn"):
        self.fn = fn
        self.tokenizer = tokenizer
        self.key = key

    def score(self, tokens: np.ndarray, prompt_lengths: np.ndarray, response_lengths: np.ndarray) -> Future:
        rewards = np.zeros(len(tokens), dtype=np.float32)
        for b, (prompt, response) in enumerate(decode_rollouts(self.tokenizer, tokens, prompt_lengths, response_lengths)):
            value = self.fn(prompt, response)
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


class RemoteRewardSource:
    """Rewards from the ``reward_model`` PyTriton server (``remote_rm.reward_model.{ip, port, name}``)."""

    def __init__(self, cfg, pad_id: int, key: str = "remote_rm.reward_model"):
        from nemo_aligner.servers.clients import RemoteGPTRMClient, check_reachable

        rm = cfg.reward_model
        host, port = str(rm.ip), int(rm.port)
        check_reachable(host, port, key, wait_s=float(cfg.get("wait_for_server_s") or 0))
        self.client = RemoteGPTRMClient(host, port, model_name=str(rm.get("name") or "reward_model"),
                                        timeout_s=float(cfg.get("timeout_s") or 600), key=key,
                                        retries=int(cfg.get("max_retries") or 0), settings_key=key.rsplit(".", 1)[0])
        self.pad_id = pad_id
        self.pad_to_length: Optional[int] = cfg.get("pad_to_length")

    def score(self, tokens: np.ndarray, prompt_lengths: np.ndarray, response_lengths: np.ndarray):
        if self.pad_to_length and tokens.shape[1] < int(self.pad_to_length):
            tokens = np.pad(tokens, ((0, 0), (0, int(self.pad_to_length) - tokens.shape[1])), constant_values=self.pad_id)
        return self.client.infer_tokens(tokens, response_lengths)

    def close(self) -> None:
        self.client.close()


class EnvironmentRewardSource:
    """Rewards from an :class:`EnvironmentInterface`: one ``step`` per scored micro-batch, on the
    conversation ``[user: prompt, assistant: response]``."""

    def __init__(self, environment, tokenizer):
        self.environment = environment
        self.tokenizer = tokenizer
        self._warned = False

    def score(self, tokens: np.ndarray, prompt_lengths: np.ndarray, response_lengths: np.ndarray) -> Future:
        import logging

        conversations = [[{"role": "user", "content": prompt}, {"role": "assistant", "content": response}]
                         for prompt, response in decode_rollouts(self.tokenizer, tokens, prompt_lengths, response_lengths)]
        result = self.environment.step(conversations)
        rewards = np.asarray(result.rewards, dtype=np.float32).reshape(-1)
        if len(rewards) != len(conversations):
            raise ConfigError(f"environment.step returned {len(rewards)} rewards for {len(conversations)} conversations")
        bad = np.flatnonzero(~np.isfinite(rewards))
        if len(bad):
            raise ConfigError(f"environment.step returned {rewards[bad[0]]} as the reward of conversation {bad[0]} "
                              f"({len(bad)} non-finite in all); rewards must be finite")
        if not self._warned and not all(result.done):
            self._warned = True
            logging.getLogger(__name__).warning("the environment continues some episodes (done=False); GRPO scores "
                                                "the first turn only")
        future: Future = Future()
        future.set_result(rewards)
        return future

    def close(self) -> None:
        pass
