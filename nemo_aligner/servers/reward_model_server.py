"""The ``reward_model`` PyTriton server: rank 0 serves, every rank computes."""

from __future__ import annotations

import logging
from typing import Optional

import numpy as np

from nemo_aligner.servers.batching import guard_limits, data_parallel_apply
from nemo_aligner.servers.model_server import BatchedModelServer
from nemo_aligner.servers.signals import ServerSignal, broadcast_signal, follow
from nemo_aligner.servers.triton_host import ServerAddress
from nemo_aligner.utils.distributed import get_rank

logger = logging.getLogger(__name__)

REWARD_MODEL_NAME = "reward_model"


class RewardModelServer(BatchedModelServer):
    """Serves ``model.infer`` (a reward model) as the PyTriton model ``reward_model``.

    Inputs: ``tokens`` int64 [-1] per request row and ``sequence_lengths`` int64 [1], or only
    ``sentences`` bytes [1] (text, tokenized here as the model was trained: no BOS, EOS unless
    ``model.data.append_eod`` is False; when tokens are sent too, the tokens are scored). Output: ``rewards`` float32
    (one value, or one per attribute for an unmerged regression head). Batches are
    trimmed to the longest sequence (rounded up to ``strip_sequence_length_to_multiple``),
    padded to a multiple of data parallel x ``inference_micro_batch_size`` and split over
    data-parallel ranks; padding rows are dropped before answering.
    """

    def __init__(self, model, address: ServerAddress, micro_batch_size: int = 4, max_queue_delay_us: int = 2000,
                 strip_to_multiple: Optional[int] = None, max_batch_size: Optional[int] = None,
                 workspace_dir: Optional[str] = None, triton_log_file: Optional[str] = None,
                 key: str = "inference", max_sequence_length: Optional[int] = None):
        super().__init__(model, address, "reward model server", key, micro_batch_size, max_queue_delay_us,
                         strip_to_multiple, max_batch_size, workspace_dir, triton_log_file, max_sequence_length)
        self.requests = 0

    # ----------------------------------------------------------------- compute (every rank)
    def _score(self, tokens: Optional[np.ndarray], lengths: Optional[np.ndarray]):
        def score_shard(tok, lens):
            return self.model.infer(tok, lens, micro_batch_size=self.micro_batch_size).reshape(tok.shape[0], -1)

        return data_parallel_apply(score_shard, tokens, lengths)

    # ----------------------------------------------------------------- rank 0
    def tokenize_sentences(self, sentences: np.ndarray):
        """``tokens``/``sequence_lengths`` of text requests (NeMo-Aligner's ``sentences`` input), with the
        EOS the model was trained with (``model.data.append_eod``, True unless its config says False)."""
        from nemo_aligner.data.nlp.reward_datasets import texts_to_tokens
        from nemo_aligner.servers.batching import BadRequest

        append_eod = bool((self.model.cfg.get("data") or {}).get("append_eod", True))
        texts = []
        for i, raw in enumerate(np.asarray(sentences).reshape(-1)):
            try:
                texts.append(raw.decode("utf-8") if isinstance(raw, (bytes, np.bytes_)) else str(raw))
            except UnicodeDecodeError:
                raise BadRequest(f"sentences[{i}] is not UTF-8 text") from None
        tokens, lengths = texts_to_tokens(self.model.tokenizer, texts, add_eos=append_eod)
        if (lengths == 0).any():
            raise BadRequest(f"sentences[{int(np.argmin(lengths))}] is empty")
        return tokens, lengths

    def infer(self, **inputs):
        """PyTriton entry point (batched by ``@batch``): ``tokens`` + ``sequence_lengths``, or ``sentences``."""
        from nemo_aligner.servers.batching import BadRequest

        if inputs.get("tokens") is None or inputs.get("sequence_lengths") is None:
            if inputs.get("sentences") is None:
                raise BadRequest("a request needs tokens and sequence_lengths, or sentences")
            inputs = dict(inputs, **dict(zip(("tokens", "sequence_lengths"),
                                             self.tokenize_sentences(inputs["sentences"]))))
        tokens, lengths, real = self.prepare_batch(inputs["tokens"], inputs["sequence_lengths"])
        with self.lock:
            broadcast_signal(ServerSignal.FORWARD)
            rewards = self._score(tokens, lengths)
        self.requests += 1
        return {"rewards": rewards[:real].numpy().astype(np.float32)}

    def _bind(self, triton) -> None:
        from pytriton.decorators import batch
        from pytriton.model_config import DynamicBatcher, ModelConfig, Tensor

        preferred = self.preferred_batch_sizes()
        width = self.model.output_width
        triton.bind(
            model_name=REWARD_MODEL_NAME,
            infer_func=batch(self.infer),
            inputs=[
                Tensor(name="tokens", dtype=np.int64, shape=(-1,), optional=True),
                Tensor(name="sequence_lengths", dtype=np.int64, shape=(1,), optional=True),
                Tensor(name="sentences", dtype=bytes, shape=(1,), optional=True),
            ],
            outputs=[Tensor(name="rewards", dtype=np.float32, shape=(width,))],
            config=ModelConfig(
                max_batch_size=self.max_batch_size,
                batcher=DynamicBatcher(max_queue_delay_microseconds=self.max_queue_delay_us,
                                       preferred_batch_size=preferred),
            ),
            strict=True,
        )

    def run(self) -> None:
        """Serve until SIGTERM/SIGINT (rank 0) or the EXIT signal (other ranks)."""
        if get_rank() != 0:
            follow({ServerSignal.FORWARD: lambda: self._score(None, None)})
            return
        try:
            limits = {REWARD_MODEL_NAME: guard_limits(self.max_batch_size, self.max_seq_length)}
            self.serve(self._bind, limits)
        finally:
            broadcast_signal(ServerSignal.EXIT)
            logger.info("reward model server stopped after %d batches", self.requests)
