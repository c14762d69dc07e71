"""Clients of the model servers: asynchronous requests, futures, errors that name the server."""

from __future__ import annotations

import logging
import socket
from typing import List, Optional, Sequence

import numpy as np

from nemo_aligner.utils.errors import AlignerError

logger = logging.getLogger(__name__)


class RemoteServerError(AlignerError):
    """A server is unreachable, timed out or refused a request; the message names host:port and the config key."""


def check_reachable(host: str, port: int, key: str, timeout_s: float = 3.0) -> None:
    """Fail fast (not after the client's long readiness wait) when nothing listens on host:port."""
    try:
        with socket.create_connection((host, int(port)), timeout=timeout_s):
            pass
    except OSError as err:
        raise RemoteServerError(
            f"cannot reach the server at {host}:{port} ({err.strerror or err}); is it running? "
            f"check {key}.ip and {key}.port"
        ) from None


class ServerFuture:
    """The pending answer of one request; ``result()`` returns the output array or raises RemoteServerError."""

    def __init__(self, future, output: str, where: str, key: str, timeout_s: float):
        self._future = future
        self._output = output
        self._where = where
        self._key = key
        self._timeout_s = timeout_s

    def done(self) -> bool:
        return self._future.done()

    def result(self, timeout: Optional[float] = None) -> np.ndarray:
        import concurrent.futures

        try:
            outputs = self._future.result(timeout=timeout if timeout is not None else self._timeout_s + 5)
        except concurrent.futures.TimeoutError:
            raise RemoteServerError(f"the server at {self._where} did not answer within {self._timeout_s:.0f}s; "
                                    f"check it is alive or raise {self._key}.timeout") from None
        except Exception as err:  # PyTriton client errors: connection closed, server-side error, timeout
            raise RemoteServerError(f"request to the server at {self._where} failed: {type(err).__name__}: {err} "
                                    f"(config: {self._key})") from None
        return outputs[self._output]


class TritonModelClient:
    """One PyTriton model on a server, called asynchronously; close it (or use ``with``)."""

    def __init__(self, host: str, port: int, model_name: str, key: str, timeout_s: float = 60.0,
                 check: bool = True):
        from pytriton.client import FuturesModelClient

        self.where = f"{host}:{port}"
        self.key = key
        self.timeout_s = float(timeout_s)
        if check:
            check_reachable(host, port, key)
        self._client = FuturesModelClient(self.where, model_name, init_timeout_s=self.timeout_s,
                                          inference_timeout_s=self.timeout_s)

    def send(self, output: str, **inputs) -> ServerFuture:
        return ServerFuture(self._client.infer_batch(**inputs), output, self.where, self.key, self.timeout_s)

    def close(self) -> None:
        if self._client is not None:
            self._client.close()
            self._client = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass


class RemoteGPTRMClient(TritonModelClient):
    """Client of the ``reward_model`` server: scores token batches or texts; returns futures.

    ``infer_texts`` tokenizes with the given tokenizer and appends EOS, as the reward
    model was trained. ``rewards`` come back as [B] (or [B, attributes]).
    """

    def __init__(self, host: str = "127.0.0.1", port: int = 5555, tokenizer=None, model_name: str = "reward_model",
                 timeout_s: float = 60.0, key: str = "remote_rm"):
        super().__init__(host, port, model_name, key, timeout_s)
        self.tokenizer = tokenizer

    def infer_tokens(self, tokens, lengths) -> "RewardFuture":
        tokens = np.asarray(tokens, dtype=np.int64)
        lengths = np.asarray(lengths, dtype=np.int64).reshape(-1, 1)
        return RewardFuture(self.send("rewards", tokens=tokens, sequence_lengths=lengths))

    def infer_texts(self, texts: Sequence[str]) -> "RewardFuture":
        if self.tokenizer is None:
            raise ValueError("RemoteGPTRMClient.infer_texts needs a tokenizer")
        ids: List[List[int]] = [self.tokenizer.text_to_ids(t) + [self.tokenizer.eos_id] for t in texts]
        width = max(len(i) for i in ids)
        tokens = np.full((len(ids), width), self.tokenizer.eos_id, dtype=np.int64)
        for row, seq in enumerate(ids):
            tokens[row, : len(seq)] = seq
        return self.infer_tokens(tokens, [len(i) for i in ids])


class RewardFuture:
    """Rewards of one request: ``result()`` -> float32 [B] (or [B, A])."""

    def __init__(self, future: ServerFuture):
        self._future = future

    def done(self) -> bool:
        return self._future.done()

    def result(self, timeout: Optional[float] = None) -> np.ndarray:
        rewards = self._future.result(timeout)
        return rewards[:, 0] if rewards.ndim == 2 and rewards.shape[1] == 1 else rewards
