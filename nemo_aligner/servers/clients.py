"""Clients of the model servers: asynchronous requests, futures, errors that name the server."""

from __future__ import annotations

import logging
import socket
import sys
import time
import warnings
from typing import List, Optional, Sequence

import numpy as np

from nemo_aligner.utils.errors import AlignerError

logger = logging.getLogger(__name__)

# How long closing a client waits for its worker threads to finish their last request.
CLOSE_WAIT_S = 10.0


class RemoteServerError(AlignerError):
    """A server is unreachable, timed out or refused a request; the message names host:port and the config key."""


def check_reachable(host: str, port: int, key: str, timeout_s: float = 3.0, wait_s: float = 0.0) -> None:
    """Fail fast (not after the client's long readiness wait) when nothing listens on host:port;
    with ``wait_s`` keep trying that long first (a server that is still starting)."""

    deadline = time.monotonic() + wait_s
    while True:
        try:
            with socket.create_connection((host, int(port)), timeout=timeout_s):
                return
        except OSError as err:
            if time.monotonic() < deadline:
                time.sleep(1.0)
                continue
            waited = f" after waiting {wait_s:.0f}s" if wait_s else ""
            hint = f"check {key}" if key.startswith("--") else f"check {key}.ip and {key}.port"  # CLI flags or config keys
            raise RemoteServerError(
                f"cannot reach the server at {host}:{port}{waited} ({err.strerror or err}); is it running? {hint}"
            ) from None


# While waiting for an answer, how often to check that the server still listens: a dead server is
# reported within seconds, not after the request's whole timeout (PyTriton's client waits out
# ``timeout_s`` on a refused connection).
LIVENESS_CHECK_S = 2.0


def _listening(where: str) -> bool:
    host, _, port = where.rpartition(":")
    try:
        with socket.create_connection((host, int(port)), timeout=LIVENESS_CHECK_S):
            return True
    except ConnectionRefusedError:
        return False
    except OSError:  # unreachable for the moment (or slow to accept): not proof that it is gone
        return True


def server_message(err: BaseException) -> str:
    """What a server's error says, without the Python traceback PyTriton forwards from the model's
    process: the line raising the exception (``BadRequest: ...``), else the message as it is."""
    import re

    text = str(err)
    if "Traceback (most recent call last)" not in text:
        return text.strip()
    raised = [line.strip() for line in text.splitlines()
              if re.match(r"^\s*[A-Za-z_][\w.]*(Error|Exception|Request|Interrupt)\b.*:", line)
              and not line.strip().startswith(("File ", "Traceback"))]
    head = text.split("Traceback (most recent call last)")[0].strip().rstrip(":")
    return f"{head}: {raised[-1]}" if raised else head


def _is_timeout(err: BaseException) -> bool:
    import concurrent.futures

    from pytriton.client.exceptions import PyTritonClientTimeoutError

    return isinstance(err, (concurrent.futures.TimeoutError, PyTritonClientTimeoutError))


class ServerFuture:
    """The pending answer of one request; ``result()`` returns the output array or raises RemoteServerError.

    A request that gets no answer within the timeout is sent again, up to ``retries`` times (a
    slow server, e.g. one busy training), before giving up; ``resend`` makes the new request.
    Errors the server answered with, and refused connections (a dead server), are not retried.
    """

    def __init__(self, future, output, where: str, key: str, timeout_s: float, resend=None, retries: int = 0,
                 settings_key: Optional[str] = None):
        self._future = future
        self._output = output
        self._where = where
        self._key = key
        self._settings_key = settings_key or key
        self._timeout_s = timeout_s
        self._resend = resend
        self._retries = int(retries) if resend is not None else 0

    def done(self) -> bool:
        return self._future.done()

    def _wait(self, timeout: float):
        """The future's outputs; between short waits, fail at once if the server no longer listens."""
        import concurrent.futures

        deadline = time.monotonic() + timeout
        while True:
            try:
                return self._future.result(timeout=max(0.0, min(LIVENESS_CHECK_S, deadline - time.monotonic())))
            except concurrent.futures.TimeoutError:
                if time.monotonic() >= deadline:
                    raise
                if not _listening(self._where):
                    raise RemoteServerError(f"the server at {self._where} is gone (connection refused) "
                                            f"(config: {self._key})") from None

    def result(self, timeout: Optional[float] = None) -> np.ndarray:
        attempt = 0
        while True:
            try:
                outputs = self._wait(timeout if timeout is not None else self._timeout_s + 5)
                break
            except RemoteServerError:
                raise
            except Exception as err:  # PyTriton client errors: connection closed, server-side error, timeout
                if not _is_timeout(err):
                    raise RemoteServerError(f"request to the server at {self._where} failed: {type(err).__name__}: "
                                            f"{server_message(err)} (config: {self._key})") from None
                if attempt >= self._retries:
                    tries = f" (tried {attempt + 1} times)" if attempt else ""
                    raise RemoteServerError(
                        f"the server at {self._where} did not answer within {self._timeout_s:.0f}s{tries}; check it is "
                        f"alive, or raise {self._settings_key}.timeout_s or {self._settings_key}.max_retries "
                        f"(config: {self._key})") from None
                attempt += 1
                logger.warning("no answer from the server at %s within %.0fs; sending the request again (retry %d "
                               "of %d, %s.max_retries)", self._where, self._timeout_s, attempt, self._retries,
                               self._settings_key)
                self._future = self._resend()
        if isinstance(self._output, str):
            return outputs[self._output]
        return tuple(outputs[name] for name in self._output)


def ignore_pytriton_timeout_rounding_warning() -> None:
    """Silence PyTriton's ``NotSupportedTimeoutWarning`` from its own client utilities.

    PyTriton 0.7 sets the HTTP network timeout to ``init_timeout_s`` and then asks for the model
    config with the init time *left*, which is smaller by however long the readiness check took;
    it warns whenever that is over 0.1% (3 ms at a 3 s timeout), i.e. at random on a busy server.
    The most a request can overrun its timeout by is that readiness check's time, so the warning
    tells users nothing they can act on. Idempotent.
    """
    from pytriton.client.warnings import NotSupportedTimeoutWarning

    warnings.filterwarnings("ignore", category=NotSupportedTimeoutWarning, module=r"pytriton\.client\.utils")


def _daemon_futures_client_class():
    """PyTriton's ``FuturesModelClient`` with daemon worker threads: a worker blocked on a dead server
    (PyTriton waits up to ``init_timeout_s`` for it) must not keep the process from exiting."""
    import threading

    from pytriton.client import FuturesModelClient

    class DaemonFuturesModelClient(FuturesModelClient):
        def _extend_thread_pool(self):  # FuturesModelClient's, with daemon=True
            if self._closed:
                return
            with self._lock:
                if not self._queue.empty() and (self._max_workers is None or len(self._threads) < self._max_workers):
                    thread = threading.Thread(target=self._worker, daemon=True)
                    self._threads.append(thread)
                    thread.start()

        def close_within(self, seconds: float) -> None:
            """Close, and wait up to ``seconds`` for the workers to finish. A worker that finishes
            closes its connections and its gevent hub; one left doing so while the interpreter
            shuts down can crash the process (SIGSEGV at exit). Workers still blocked on a dead
            server after ``seconds`` are abandoned (daemons)."""
            self.close(wait=False)
            deadline = time.monotonic() + seconds
            for thread in list(self._threads):
                thread.join(timeout=max(0.0, deadline - time.monotonic()))

    return DaemonFuturesModelClient


def _futures_client(*args, **kwargs):
    return _daemon_futures_client_class()(*args, **kwargs)


class TritonModelClient:
    """One PyTriton model on a server, called asynchronously; close it (or use ``with``).

    ``retries``: how many times a request without an answer within ``timeout_s`` is sent again
    (``send(..., retry=False)`` for requests that must not run twice, such as a training step).
    ``settings_key`` is the config section holding ``timeout_s``/``max_retries``, for messages.
    """

    def __init__(self, host: str, port: int, model_name: str, key: str, timeout_s: float = 60.0,
                 check: bool = True, wait_s: float = 0.0, retries: int = 0, settings_key: Optional[str] = None):
        self.where = f"{host}:{port}"
        self.host, self.port = host, int(port)
        self.key = key
        self.settings_key = settings_key or key
        self.timeout_s = float(timeout_s)
        self.retries = int(retries)
        if check:
            check_reachable(host, port, key, wait_s=wait_s)
        ignore_pytriton_timeout_rounding_warning()
        self._client = _futures_client(self.where, model_name, init_timeout_s=self.timeout_s,
                                       inference_timeout_s=self.timeout_s)

    def send(self, output, batched: bool = True, retry: bool = True, **inputs) -> ServerFuture:
        """Send one request; ``output`` names the output to return (or a tuple of names).
        ``batched=False`` for models without batching (the whole arrays are one sample)."""
        call = self._client.infer_batch if batched else self._client.infer_sample

        def resend():
            check_reachable(self.host, self.port, self.key)  # a dead server: give up now, not after every retry
            return call(**inputs)

        return ServerFuture(call(**inputs), output, self.where, self.key, self.timeout_s, resend=resend,
                            retries=self.retries if retry else 0, settings_key=self.settings_key)

    def close(self, wait_s: float = CLOSE_WAIT_S) -> None:
        """Stop the client. Requests still waiting on a dead server after ``wait_s`` are abandoned:
        their worker threads are daemons, so they do not hold the process open."""
        if self._client is not None:
            self._client.close_within(wait_s)
            self._client = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        try:  # no waiting once the interpreter shuts down: its daemon threads may never run again
            self.close(0.0 if sys.is_finalizing() else CLOSE_WAIT_S)
        except Exception:
            pass


class RemoteGPTRMClient(TritonModelClient):
    """Client of the ``reward_model`` server: scores token batches or texts; returns futures.

    ``infer_texts`` tokenizes with the given tokenizer and appends EOS, as the reward
    model was trained. ``rewards`` come back as [B] (or [B, attributes]).
    """

    def __init__(self, host: str = "127.0.0.1", port: int = 5555, tokenizer=None, model_name: str = "reward_model",
                 timeout_s: float = 60.0, key: str = "remote_rm", retries: int = 0, settings_key: Optional[str] = None,
                 wait_s: float = 0.0):
        super().__init__(host, port, model_name, key, timeout_s, retries=retries, settings_key=settings_key,
                         wait_s=wait_s)
        self.tokenizer = tokenizer

    def infer_tokens(self, tokens, lengths) -> "RewardFuture":
        tokens = np.asarray(tokens, dtype=np.int64)
        lengths = np.asarray(lengths, dtype=np.int64).reshape(-1, 1)
        return RewardFuture(self.send("rewards", tokens=tokens, sequence_lengths=lengths))

    def infer_texts(self, texts: Sequence[str], max_length: Optional[int] = None) -> "RewardFuture":
        """Score texts, tokenized as reward-model training does (EOS appended; with ``max_length``,
        only the last ``max_length`` tokens kept)."""
        from nemo_aligner.data.nlp.reward_datasets import texts_to_tokens

        if self.tokenizer is None:
            raise ValueError("RemoteGPTRMClient.infer_texts needs a tokenizer")
        tokens, lengths = texts_to_tokens(self.tokenizer, texts, max_length)
        return self.infer_tokens(tokens, lengths.tolist())


class RewardFuture:
    """Rewards of one request: ``result()`` -> float32 [B] (or [B, A])."""

    def __init__(self, future: ServerFuture):
        self._future = future

    def done(self) -> bool:
        return self._future.done()

    def result(self, timeout: Optional[float] = None) -> np.ndarray:
        rewards = self._future.result(timeout)
        return rewards[:, 0] if rewards.ndim == 2 and rewards.shape[1] == 1 else rewards


def _pad_width(array: np.ndarray, width: int, value) -> np.ndarray:
    if array.shape[1] >= width:
        return array
    return np.pad(array, ((0, 0), (0, width - array.shape[1])), constant_values=value)


class RMCriticFuture:
    """Rewards [B] and values [B, T] of one rollout micro-batch (``result()`` -> ``(rewards, values)``)."""

    def __init__(self, critic: ServerFuture, rewards: Optional[ServerFuture], width: int):
        self._critic = critic  # values, or (values, rewards) from a combined server
        self._rewards = rewards
        self._width = width

    def result(self):
        out = self._critic.result()
        values, rewards = out if self._rewards is None else (out, self._rewards.result())
        return np.asarray(rewards, dtype=np.float32).reshape(-1), np.asarray(values[:, : self._width], dtype=np.float32)


class RemoteGPTRMCriticClient:
    """The actor's side of PPO: ``critic_infer`` (+ ``reward_model``), ``critic_train``, ``critic_save``.

    Configured by ``remote_critic_rm``: ``combine_rm_and_critic_server``, ``pad_to_length``
    (requests padded to one width so the server can batch them), ``critic.{ip, port,
    name.{infer, train, save}}``, ``reward_model.{ip, port, name}``, ``timeout_s`` (every
    request), ``max_retries`` (inference requests without an answer within ``timeout_s`` are sent
    again this many times; ``critic_train`` never is: it would train twice) and
    ``wait_for_server_s`` (how long to wait at start for a server still starting).
    """

    def __init__(self, cfg, pad_id: int):
        self.cfg = cfg
        self.pad_id = int(pad_id)
        self.combine = bool(cfg.get("combine_rm_and_critic_server", True))
        self.pad_to_length = cfg.get("pad_to_length")
        timeout = float(cfg.get("timeout_s") or 600)
        wait = float(cfg.get("wait_for_server_s") or 0)
        common = dict(retries=int(cfg.get("max_retries") or 0), settings_key="remote_critic_rm")
        critic = cfg.critic
        names = critic.get("name") or {}
        host, port = str(critic.get("ip") or "127.0.0.1"), int(critic.port)
        key = "remote_critic_rm.critic"
        self.infer_client = TritonModelClient(host, port, names.get("infer", "critic_infer"), key, timeout,
                                              wait_s=wait, **common)
        self.train_client = TritonModelClient(host, port, names.get("train", "critic_train"), key, timeout,
                                              check=False, **common)
        self.save_client = TritonModelClient(host, port, names.get("save", "critic_save"), key, timeout, check=False,
                                             **common)
        self.rm_client = None
        if not self.combine:
            rm = cfg.reward_model
            self.rm_client = TritonModelClient(str(rm.get("ip") or "127.0.0.1"), int(rm.port),
                                               rm.get("name", "reward_model"), "remote_critic_rm.reward_model", timeout,
                                               wait_s=wait, **common)

    def check_request_sizes(self, sizes: dict) -> None:
        """Each ``{config key: rows per request}`` must fill at least one of the critic server's rounds
        (its ``inference_micro_batch_size`` x data parallel, the smallest batch its dynamic batcher
        prefers); smaller requests would each be padded up to a full round."""
        from nemo_aligner.utils.errors import ConfigError

        try:
            config = self.infer_client._client.model_config().result(timeout=self.infer_client.timeout_s)
        except Exception as err:  # the request path reports an unreachable server with its own message
            logger.warning("could not read the critic server's batch sizes (%s); not checked", err)
            return
        preferred = [int(b) for b in (getattr(config.batcher, "preferred_batch_size", None) or [])] \
            if getattr(config, "batcher", None) is not None else []
        if not preferred:
            return
        round_size = min(preferred)
        for key, rows in sizes.items():
            if int(rows) < round_size:
                raise ConfigError(
                    f"{key}={rows} is smaller than the critic server's trainer.ppo.inference_micro_batch_size x "
                    f"data parallel = {round_size} ({self.infer_client.where}); every request would be padded to "
                    f"{round_size} rows: raise {key} or lower the server's inference_micro_batch_size")

    def infer_rm_critic(self, tokens, lengths) -> RMCriticFuture:
        tokens = np.asarray(tokens, dtype=np.int64)
        width = tokens.shape[1]
        if self.pad_to_length:
            tokens = _pad_width(tokens, int(self.pad_to_length), self.pad_id)
        lengths = np.asarray(lengths, dtype=np.int64).reshape(-1, 1)
        if self.combine:
            both = self.infer_client.send(("values", "rewards"), tokens=tokens, sequence_lengths=lengths)
            return RMCriticFuture(both, None, width)
        values = self.infer_client.send("values", tokens=tokens, sequence_lengths=lengths)
        rewards = self.rm_client.send("rewards", tokens=tokens, sequence_lengths=lengths)
        return RMCriticFuture(values, rewards, width)

    def train(self, tokens, returns, prev_values, mask) -> ServerFuture:
        return self.train_client.send("loss_mean", batched=False, retry=False, tokens=np.asarray(tokens, np.int64),
                                      returns=np.asarray(returns, np.float32),
                                      prev_values=np.asarray(prev_values, np.float32),
                                      mask=np.asarray(mask, np.float32))

    def save(self) -> ServerFuture:
        return self.save_client.send("status", batched=False, dummy_var=np.zeros(1, dtype=np.int64))

    def close(self) -> None:
        deadline = time.monotonic() + CLOSE_WAIT_S  # one wait for all four: a dead server blocks each
        for c in (self.infer_client, self.train_client, self.save_client, self.rm_client):
            if c is not None:
                c.close(max(0.0, deadline - time.monotonic()))


class RemoteRewardSource:
    """Rewards from the ``reward_model`` PyTriton server (``remote_rm.reward_model.{ip, port, name}``)."""

    def __init__(self, cfg, pad_id: int, key: str = "remote_rm.reward_model"):
        rm = cfg.reward_model
        host, port = str(rm.ip), int(rm.port)
        check_reachable(host, port, key, wait_s=float(cfg.get("wait_for_server_s") or 0))
        self.client = RemoteGPTRMClient(host, port, model_name=str(rm.get("name") or "reward_model"),
                                        timeout_s=float(cfg.get("timeout_s") or 600), key=key,
                                        retries=int(cfg.get("max_retries") or 0), settings_key=key.rsplit(".", 1)[0])
        self.pad_id = pad_id
        self.pad_to_length: Optional[int] = cfg.get("pad_to_length")

    def score(self, tokens: np.ndarray, prompt_lengths: np.ndarray, response_lengths: np.ndarray,
              metadata: Optional[List[dict]] = None):
        if self.pad_to_length and tokens.shape[1] < int(self.pad_to_length):
            tokens = np.pad(tokens, ((0, 0), (0, int(self.pad_to_length) - tokens.shape[1])), constant_values=self.pad_id)
        return self.client.infer_tokens(tokens, response_lengths)

    def close(self) -> None:
        self.client.close()


class TextGenerationClient:
    """A text generation server speaking NeMo's REST protocol (``PUT http://host:port/generate``: ours,
    ``generate_gpt.py server=True``, or NeMo's ``megatron_gpt_eval.py server=True``)."""

    def __init__(self, host: str, port: int, key: str = "--host/--port", timeout_s: float = 600.0, wait_s: float = 0.0):
        self.url = f"http://{host}:{int(port)}/generate"
        self.where, self.key, self.timeout_s = f"{host}:{port}", key, float(timeout_s)
        check_reachable(host, int(port), key, wait_s=wait_s)

    def request(self, sentences: Sequence[str], **settings) -> dict:
        """One request's JSON answer; a refusal or a dead server is a ``RemoteServerError``."""
        import json
        import urllib.error
        import urllib.request

        body = json.dumps({"sentences": list(sentences), **settings}).encode("utf-8")
        req = urllib.request.Request(self.url, data=body, method="PUT", headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=self.timeout_s) as resp:
                return json.loads(resp.read().decode("utf-8"))
        except urllib.error.HTTPError as err:
            detail = err.read().decode("utf-8", "replace").strip()[:300]
            raise RemoteServerError(f"text generation server {self.where} ({self.key}) refused the request "
                                    f"(HTTP {err.code}): {detail}") from None
        except (urllib.error.URLError, OSError, ValueError) as err:
            raise RemoteServerError(f"text generation server {self.where} ({self.key}) did not answer: "
                                    f"{getattr(err, 'reason', err)}") from None

    def generate(self, prompts: Sequence[str], **settings) -> List[str]:
        """Each prompt followed by its generated text (NeMo's ``sentences``)."""
        sentences = self.request(prompts, **settings).get("sentences")
        if not isinstance(sentences, list) or len(sentences) != len(prompts):
            raise RemoteServerError(f"text generation server {self.where} answered {len(sentences or [])} sentences "
                                    f"for {len(prompts)} prompts")
        return sentences

    def logprobs(self, texts: Sequence[str]) -> List[List[float]]:
        """Each text's per-token log-probabilities (``compute_logprob`` with nothing generated)."""
        answer = self.request(texts, tokens_to_generate=0, compute_logprob=True)
        if "logprob" not in answer:
            raise RemoteServerError(f"text generation server {self.where} returned no log-probabilities "
                                    "(compute_logprob)")
        return answer["logprob"]
