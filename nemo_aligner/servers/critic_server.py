"""The PPO critic server: PyTriton models ``critic_infer``, ``critic_train`` and ``critic_save``.

Rank 0 serves; every request is announced to the other ranks with a signal (FORWARD, TRAIN,
SAVE) and its tensors are broadcast, so TP/PP/DP critics work. One lock serialises the
three models: a train request never overlaps an inference.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from typing import Optional

import numpy as np
import torch

from nemo_aligner.servers.batching import guard_limits, data_parallel_apply, token_id_problem
from nemo_aligner.servers.model_server import BatchedModelServer
from nemo_aligner.servers.signals import ServerSignal, broadcast_signal, follow
from nemo_aligner.servers.request_guard import ModelLimits
from nemo_aligner.servers.triton_host import ServerAddress
from nemo_aligner.utils.distributed import broadcast_object, get_rank
from nemo_aligner.utils.errors import TrainingError

logger = logging.getLogger(__name__)

# ``trainer.ppo.max_train_rows``'s default: rows one ``critic_train`` request may carry.
DEFAULT_MAX_TRAIN_ROWS = 65536

CRITIC_INFER, CRITIC_TRAIN, CRITIC_SAVE = "critic_infer", "critic_train", "critic_save"


class BadTrainRequest(ValueError):
    """critic_train tensors that do not fit together."""


class ShutdownDrain:
    """When to stop after SIGTERM, so that the critic and the actor stay in step.

    The critic saves only when the actor asks (``critic_save``, at the actor's own saves): a
    checkpoint of its own would be ahead of the actor's last one. Slurm (``scancel``, the time
    limit, preemption) signals both jobs at once, and the actor then finishes its step and saves;
    so a SIGTERM while the actor is mid-step (its last request was not a save) keeps the server up
    until that ``critic_save`` has been answered, or until ``idle_s`` pass with no request (the
    actor is gone). Between steps, or on a second SIGTERM or SIGINT, the server stops at once.
    """

    def __init__(self, idle_s: float, answer_s: float = 2.0):
        self.idle_s = float(idle_s)
        self.answer_s = answer_s  # time for the last response to reach the actor before stopping
        self.lock = threading.Lock()
        self.mid_step = False
        self.in_flight = 0
        self.last_request = time.monotonic()
        self.draining = False
        self.stopping = False  # decided: the watcher and the answered save interrupt no more

    def begin(self) -> None:
        with self.lock:
            self.in_flight += 1
            self.last_request = time.monotonic()

    def end(self, kind: str) -> None:
        with self.lock:
            self.in_flight -= 1
            self.last_request = time.monotonic()
            self.mid_step = kind != CRITIC_SAVE
            stop = self.draining and kind == CRITIC_SAVE and not self.stopping
            self.stopping = self.stopping or stop
        if stop:
            logger.info("the actor's checkpoint request after SIGTERM is answered: stopping")
            threading.Timer(self.answer_s, self._interrupt).start()

    def on_sigterm(self) -> bool:
        """Whether to stop now (called in the signal handler)."""
        with self.lock:
            if self.draining or not (self.mid_step or self.in_flight):
                self.stopping = True
                return True
            self.draining = True
        logger.warning("SIGTERM while the actor is mid-step: serving until it saves (critic_save), or until %.0f s "
                       "pass without a request; SIGINT or a second SIGTERM stops at once", self.idle_s)
        threading.Thread(target=self._watch_idle, daemon=True).start()
        return False

    def _watch_idle(self) -> None:
        while True:
            time.sleep(0.5)
            with self.lock:
                if self.stopping:
                    return
                idle = not self.in_flight and time.monotonic() - self.last_request >= self.idle_s
                self.stopping = idle
            if idle:
                logger.warning("no request for %.0f s after SIGTERM: stopping", self.idle_s)
                self._interrupt()
                return

    @staticmethod
    def _interrupt() -> None:
        os.kill(os.getpid(), signal.SIGINT)


class CriticServer(BatchedModelServer):
    """Serves a ``MegatronGPTCriticModel`` and its ``CriticServerTrainer``.

    ``critic_infer``: in ``tokens`` int64 [-1], ``sequence_lengths`` int64 [1]; out ``values``
    float32 [-1] (one per token of the request's width) and, with the co-located reward model,
    ``rewards`` float32 [1]. ``critic_train`` (no batching): ``tokens`` int64 [-1, -1],
    ``returns``/``prev_values``/``mask`` float32 [-1, -1] (width - 1 columns); out ``loss_mean``
    float32 [1]. ``critic_save``: ``dummy_var`` int64 [1]; out ``status`` int64 [1].
    """

    def __init__(self, model, trainer, address: ServerAddress, combine_rm_and_critic: bool = True,
                 micro_batch_size: int = 4, max_queue_delay_us: int = 2000, strip_to_multiple: Optional[int] = None,
                 max_batch_size: Optional[int] = None, workspace_dir: Optional[str] = None,
                 triton_log_file: Optional[str] = None, shutdown_idle_s: float = 60.0, key: str = "trainer.ppo",
                 max_sequence_length: Optional[int] = None, max_train_rows: Optional[int] = None):
        super().__init__(model, address, "critic server", key, micro_batch_size, max_queue_delay_us,
                         strip_to_multiple, max_batch_size, workspace_dir, triton_log_file, max_sequence_length)
        self.trainer = trainer
        self.combine = combine_rm_and_critic
        self.drain = ShutdownDrain(shutdown_idle_s)
        self.max_train_rows = int(max_train_rows or DEFAULT_MAX_TRAIN_ROWS)
        # seconds spent serving critic_infer since the last critic_train, logged with it
        # (``critic/time/infer``): with ``critic/time/train`` the server's busy time per PPO step
        self.infer_seconds = 0.0

    # ----------------------------------------------------------------- compute (every rank)
    def _forward(self, tokens: Optional[np.ndarray], lengths: Optional[np.ndarray]) -> torch.Tensor:
        """[B, 1 + S]: the reward (0 without the reward model) then the values."""

        def shard(tok, lens):
            self.model.prepare_for_inference()
            rewards, values = self.model.infer_rm_critic(tok, lens, micro_batch_size=self.micro_batch_size)
            rewards = torch.zeros(tok.shape[0]) if rewards is None else rewards.reshape(-1)
            return torch.cat([rewards.unsqueeze(1), values], dim=1)

        return data_parallel_apply(shard, tokens, lengths)

    def _train(self, data=None) -> float:
        data = broadcast_object(data)
        try:
            return self.trainer.train(*data)
        except TrainingError as err:  # every rank stops training alike; rank 0 answers the actor with it
            if get_rank() == 0:
                raise
            logger.error("critic training stopped: %s", err)
            return float("nan")

    def _save(self) -> None:
        self.trainer.save()

    # ----------------------------------------------------------------- rank 0 entry points
    def _request(self, kind: str, handler, *args, **kwargs):
        self.drain.begin()
        try:
            return handler(*args, **kwargs)
        finally:
            self.drain.end(kind)

    def infer(self, **inputs):
        width = np.asarray(inputs["tokens"]).shape[-1]
        tokens, lengths, real = self.prepare_batch(inputs["tokens"], inputs["sequence_lengths"])
        with self.lock:
            start = time.monotonic()
            broadcast_signal(ServerSignal.FORWARD)
            out = self._forward(tokens, lengths)[:real].numpy()
            self.infer_seconds += time.monotonic() - start
        values = np.zeros((real, width), dtype=np.float32)
        used = min(width, out.shape[1] - 1)
        values[:, :used] = out[:, 1 : 1 + used]
        result = {"values": values}
        if self.combine:
            result["rewards"] = out[:, :1].astype(np.float32)
        return result

    def train(self, tokens, returns, prev_values, mask):
        tokens = np.asarray(tokens, dtype=np.int64)
        if tokens.ndim != 2:
            raise BadTrainRequest(f"tokens must be [batch, sequence], got {list(tokens.shape)}")
        problem = token_id_problem(tokens, self.vocab_size)
        if problem:
            raise BadTrainRequest(problem)
        if self.max_seq_length is not None and tokens.shape[1] > self.max_seq_length:
            raise BadTrainRequest(f"sequences of {tokens.shape[1]} tokens are longer than the model's "
                                  f"{self.max_seq_length}")
        if tokens.shape[0] > self.max_train_rows:
            raise BadTrainRequest(f"{tokens.shape[0]} rows, more than the server's {self.key}.max_train_rows="
                                  f"{self.max_train_rows}")
        expected = (tokens.shape[0], tokens.shape[1] - 1)
        for name, value in (("returns", returns), ("prev_values", prev_values), ("mask", mask)):
            if tuple(np.shape(value)) != expected:
                raise BadTrainRequest(f"{name} must be {list(expected)} (tokens minus one column), got "
                                      f"{list(np.shape(value))}")
        data = (tokens, np.asarray(returns, np.float32), np.asarray(prev_values, np.float32),
                np.asarray(mask, np.float32))
        with self.lock:
            start = time.monotonic()
            broadcast_signal(ServerSignal.TRAIN)
            loss = self._train(data)
            self.trainer.log_times(train=time.monotonic() - start, infer=self.infer_seconds)
            self.infer_seconds = 0.0
        return {"loss_mean": np.array([loss], dtype=np.float32)}

    def save(self, dummy_var=None):
        with self.lock:
            broadcast_signal(ServerSignal.SAVE)
            self._save()
        return {"status": np.array([0], dtype=np.int64)}

    def _bind(self, triton) -> None:
        from pytriton.decorators import batch
        from pytriton.model_config import DynamicBatcher, ModelConfig, Tensor

        outputs = [Tensor(name="values", dtype=np.float32, shape=(-1,))]
        if self.combine:
            outputs.append(Tensor(name="rewards", dtype=np.float32, shape=(1,)))
        preferred = self.preferred_batch_sizes()
        triton.bind(
            model_name=CRITIC_INFER, infer_func=batch(lambda **inputs: self._request(CRITIC_INFER, self.infer, **inputs)),
            inputs=[Tensor(name="tokens", dtype=np.int64, shape=(-1,)),
                    Tensor(name="sequence_lengths", dtype=np.int64, shape=(1,)),
                    Tensor(name="sentences", dtype=bytes, shape=(1,), optional=True)],
            outputs=outputs,
            config=ModelConfig(max_batch_size=self.max_batch_size, batcher=DynamicBatcher(
                max_queue_delay_microseconds=self.max_queue_delay_us, preferred_batch_size=preferred)),
            strict=True)

        def train_fn(requests):
            return [self._request(CRITIC_TRAIN, self.train, **{k: r[k] for k in ("tokens", "returns", "prev_values", "mask")})
                    for r in requests]

        triton.bind(
            model_name=CRITIC_TRAIN, infer_func=train_fn,
            inputs=[Tensor(name="tokens", dtype=np.int64, shape=(-1, -1)),
                    Tensor(name="returns", dtype=np.float32, shape=(-1, -1)),
                    Tensor(name="prev_values", dtype=np.float32, shape=(-1, -1)),
                    Tensor(name="mask", dtype=np.float32, shape=(-1, -1))],
            outputs=[Tensor(name="loss_mean", dtype=np.float32, shape=(1,))],
            config=ModelConfig(batching=False), strict=True)

        def save_fn(requests):
            return [self._request(CRITIC_SAVE, self.save) for _ in requests]

        triton.bind(
            model_name=CRITIC_SAVE, infer_func=save_fn,
            inputs=[Tensor(name="dummy_var", dtype=np.int64, shape=(1,))],
            outputs=[Tensor(name="status", dtype=np.int64, shape=(1,))],
            config=ModelConfig(batching=False), strict=True)

    def run(self) -> None:
        """Serve until SIGTERM/SIGINT (see :class:`ShutdownDrain`); every rank stops."""
        if get_rank() != 0:
            follow({ServerSignal.FORWARD: lambda: self._forward(None, None),
                    ServerSignal.TRAIN: self._train,
                    ServerSignal.SAVE: self._save})
        else:
            try:
                limits = {CRITIC_INFER: guard_limits(self.max_batch_size, self.max_seq_length),
                          CRITIC_TRAIN: guard_limits(self.max_train_rows, self.max_seq_length),
                          CRITIC_SAVE: ModelLimits(1, 1)}
                self.serve(self._bind, limits, stop_on_sigterm=self.drain.on_sigterm)
            finally:
                broadcast_signal(ServerSignal.EXIT)
        unsaved = self.trainer.train_calls - self.trainer.saved_train_calls
        if unsaved:
            logger.warning("critic stopped %d critic_train call(s) after the actor's last checkpoint request: not "
                           "saved, so that the critic resumes in step with the actor", unsaved)
