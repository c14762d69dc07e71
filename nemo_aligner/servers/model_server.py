"""What the reward-model and critic servers share: a model served by rank 0 over PyTriton, its
requests checked, padded to data-parallel shards and computed by every rank."""

from __future__ import annotations

import threading
from typing import Callable, Dict, List, Optional, Tuple

import numpy as np

from nemo_aligner.servers.batching import TrainedLengthWarning, check_request, pad_request, request_limits
from nemo_aligner.servers.request_guard import ModelLimits
from nemo_aligner.servers.triton_host import ServerAddress, serve_forever


class BatchedModelServer:
    """``micro_batch_size`` rows per data-parallel rank and forward; requests up to ``max_batch_size``
    rows (default: 64, or one micro-batch per rank if more) of up to ``max_sequence_length`` tokens
    (see :func:`request_limits`); ``key``: the config section named in errors."""

    def __init__(self, model, address: ServerAddress, description: str, key: str, micro_batch_size: int = 4,
                 max_queue_delay_us: int = 2000, strip_to_multiple: Optional[int] = None,
                 max_batch_size: Optional[int] = None, workspace_dir: Optional[str] = None,
                 triton_log_file: Optional[str] = None, max_sequence_length: Optional[int] = None):
        from megatron.core import parallel_state

        self.model = model
        self.address = address
        self.description = description
        self.key = key
        self.micro_batch_size = int(micro_batch_size)
        self.dp = parallel_state.get_data_parallel_world_size()
        self.max_queue_delay_us = int(max_queue_delay_us)
        self.strip_to_multiple = strip_to_multiple
        self.max_batch_size = int(max_batch_size or max(64, self.micro_batch_size * self.dp))
        self.workspace_dir = workspace_dir
        self.triton_log_file = triton_log_file
        self.lock = threading.Lock()  # one forward at a time: every rank takes part in each
        self.pad_id = model.tokenizer.eos_id
        self.max_seq_length, self.vocab_size = request_limits(model.cfg, max_sequence_length)
        self.warn_length = TrainedLengthWarning(model.cfg, description)

    def prepare_batch(self, tokens, lengths) -> Tuple[np.ndarray, np.ndarray, int]:
        """A request's tokens and lengths checked, trimmed and padded to whole data-parallel shards;
        also the number of real rows."""
        tokens, lengths = check_request(tokens, lengths, self.max_seq_length, self.vocab_size)
        self.warn_length(int(lengths.max()))
        return pad_request(tokens, lengths, self.pad_id, self.dp * self.micro_batch_size, self.strip_to_multiple)

    def preferred_batch_sizes(self) -> List[int]:
        return sorted({self.micro_batch_size * self.dp, self.max_batch_size})

    def serve(self, bind: Callable, limits: Dict[str, ModelLimits],
              stop_on_sigterm: Optional[Callable[[], bool]] = None) -> None:
        """Rank 0: serve the models ``bind`` declares until stopped (see :func:`serve_forever`)."""
        serve_forever(self.address, bind, self.description, self.key, limits, self.workspace_dir,
                      self.triton_log_file, stop_on_sigterm=stop_on_sigterm)
