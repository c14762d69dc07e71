"""Request batches for model servers: validate, trim/pad the sequence length, pad rows to a
multiple of data parallel x micro-batch, scatter over data-parallel ranks and gather back."""

from __future__ import annotations

import logging
from typing import Callable, Optional, Tuple

import numpy as np
import torch
import torch.distributed as dist

from nemo_aligner.servers.request_guard import ModelLimits
from nemo_aligner.utils.distributed import broadcast_object, comm_device
from nemo_aligner.utils.errors import ConfigError

logger = logging.getLogger(__name__)


class BadRequest(ValueError):
    """A request whose tensors are inconsistent; reported to the client, the server keeps serving."""


def check_batch_limits(max_batch_size, micro_batch_size: int, dp: int, max_key: str, micro_key: str) -> None:
    """A server's largest batch must hold one micro-batch per data-parallel rank: the dynamic
    batcher could otherwise never fill a round, and every request would be padded past its limit."""
    if max_batch_size is not None and int(max_batch_size) < int(micro_batch_size) * dp:
        raise ConfigError(f"{max_key}={max_batch_size} is smaller than {micro_key}={micro_batch_size} x data "
                          f"parallel size {dp} = {int(micro_batch_size) * dp}; raise {max_key} or lower {micro_key}")


def check_request(tokens: np.ndarray, lengths: np.ndarray, max_seq_length: Optional[int] = None,
                  vocab_size: Optional[int] = None):
    """``tokens`` [B, S] and ``lengths`` [B] (or [B, 1]) as int64 arrays, checked for consistency
    (and, with ``vocab_size``, every id within a sequence's length is a row of the embedding: an id
    outside it fails inside the forward, on one data-parallel rank, and takes the server down)."""
    tokens = np.asarray(tokens)
    lengths = np.asarray(lengths).reshape(-1)
    if tokens.ndim != 2:
        raise BadRequest(f"tokens must be [batch, sequence], got shape {list(tokens.shape)}")
    if lengths.shape[0] != tokens.shape[0]:
        raise BadRequest(f"{tokens.shape[0]} token rows but {lengths.shape[0]} sequence_lengths")
    if (lengths < 1).any() or (lengths > tokens.shape[1]).any():
        raise BadRequest(f"sequence_lengths must be within 1..{tokens.shape[1]} (the token width), got "
                         f"{lengths.min()}..{lengths.max()}")
    # (the batch is trimmed to its longest sequence before any forward: lengths decide the cost)
    if max_seq_length is not None and lengths.max() > max_seq_length:
        raise BadRequest(f"a sequence of {lengths.max()} tokens is longer than the model's {max_seq_length} (its "
                         "positions, or the server's max_sequence_length)")
    if vocab_size is not None and tokens.size:
        problem = token_id_problem(tokens[np.arange(tokens.shape[1])[None, :] < lengths[:, None]], vocab_size)
        if problem:
            raise BadRequest(problem)
    return tokens.astype(np.int64), lengths.astype(np.int64)


def token_id_problem(ids: np.ndarray, vocab_size: int) -> Optional[str]:
    """Why ``ids`` cannot be looked up in a ``vocab_size``-row embedding (None when they can)."""
    if ids.size and (ids.min() < 0 or ids.max() >= vocab_size):
        return f"token ids must be within 0..{vocab_size - 1} (the model's vocabulary), got {ids.min()}..{ids.max()}"
    return None


def _learned_positions(cfg) -> bool:
    return str(cfg.get("position_embedding_type", "rope")) == "learned_absolute"


# RoPE has no table to end at: without a configured limit, a server takes sequences up to this many
# times the trained length (longer ones are extrapolation anyway, and a bound keeps one request
# from holding the server for minutes or exhausting its memory).
ROPE_LIMIT_FACTOR = 4


def request_limits(cfg, max_sequence_length: Optional[int] = None) -> Tuple[int, int]:
    """``(longest sequence, vocabulary rows)`` a server takes for a model config: learned positions
    end at the table's size; ``max_sequence_length`` (the server's key) lowers that, or sets it for
    RoPE, whose default is ``ROPE_LIMIT_FACTOR`` x ``encoder_seq_length``."""
    if _learned_positions(cfg):
        longest = int(cfg.get("max_position_embeddings") or cfg.encoder_seq_length)
        if max_sequence_length:
            longest = min(longest, int(max_sequence_length))
    else:
        longest = int(max_sequence_length or ROPE_LIMIT_FACTOR * int(cfg.encoder_seq_length))
    return longest, int(cfg.padded_vocab_size)


# Clients pad requests to one width (``remote_critic_rm.pad_to_length``), which may exceed the
# longest sequence a server scores; the request guard takes rows up to this many times that length.
PADDED_WIDTH_FACTOR = 4


def guard_limits(max_rows: int, max_seq_length: int) -> ModelLimits:
    """The request guard's limits for a model taking ``max_rows`` rows of up to ``max_seq_length`` tokens."""
    return ModelLimits(int(max_rows), PADDED_WIDTH_FACTOR * int(max_seq_length),
                       f"{PADDED_WIDTH_FACTOR} x the {int(max_seq_length)} tokens it scores; a client's "
                       "pad_to_length (remote_critic_rm, remote_rm) must not exceed that")


class TrainedLengthWarning:
    """Logs once when a RoPE model is asked about a sequence longer than ``model.encoder_seq_length``.

    Learned positions refuse such requests (:func:`request_limits`); RoPE computes positions past
    the trained length, so nothing fails, but the model never saw them and its scores there are
    extrapolations (e.g. a reward model with a shorter context than the actor it scores)."""

    def __init__(self, cfg, server: str):
        # learned positions: longer requests are refused before they get here
        self.length = None if _learned_positions(cfg) else int(cfg.encoder_seq_length)
        self.server = server
        self.warned = False

    def __call__(self, longest: int) -> None:
        if self.length is not None and longest > self.length and not self.warned:
            self.warned = True
            logger.warning("%s: a request holds a sequence of %d tokens, longer than the %d "
                           "(model.encoder_seq_length) the model was trained on; RoPE extrapolates past it, so "
                           "its outputs there may be unreliable (give the model a longer context or the client "
                           "shorter sequences; warned once)", self.server, longest, self.length)


def pad_request(tokens: np.ndarray, lengths: np.ndarray, pad_id: int, row_multiple: int,
                strip_to_multiple: Optional[int] = None) -> Tuple[np.ndarray, np.ndarray, int]:
    """Trim the sequence width to the longest sequence (rounded up to ``strip_to_multiple`` when
    given) and add padding rows (length 1) up to a multiple of ``row_multiple``; returns the real
    row count too. Clients pad requests to one width so the server can batch them (e.g. the PPO
    actor's ``remote_critic_rm.pad_to_length``, the model's whole context); computing over that
    padding would only produce values that are thrown away."""
    real = tokens.shape[0]
    multiple = int(strip_to_multiple or 1)
    width = int(-(-lengths.max() // multiple) * multiple)
    if width <= tokens.shape[1]:
        tokens = tokens[:, :width]
    else:
        tokens = np.pad(tokens, ((0, 0), (0, width - tokens.shape[1])), constant_values=pad_id)
    rows = -(-real // row_multiple) * row_multiple
    if rows > real:
        tokens = np.concatenate([tokens, np.full((rows - real, tokens.shape[1]), pad_id, dtype=np.int64)])
        lengths = np.concatenate([lengths, np.ones(rows - real, dtype=np.int64)])
    return tokens, lengths, real


def data_parallel_apply(fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
                        tokens: Optional[np.ndarray], lengths: Optional[np.ndarray]) -> torch.Tensor:
    """Collective on every rank: rank 0's batch is split over data-parallel ranks, ``fn`` runs on each
    shard (a model-parallel collective), and the full result is gathered back on every rank."""
    from megatron.core import parallel_state

    tokens, lengths = broadcast_object((tokens, lengths))
    dp = parallel_state.get_data_parallel_world_size()
    rank = parallel_state.get_data_parallel_rank()
    per_rank = tokens.shape[0] // dp
    shard = slice(rank * per_rank, (rank + 1) * per_rank)
    out = fn(torch.from_numpy(tokens[shard]), torch.from_numpy(lengths[shard])).float().contiguous()
    if dp == 1:
        return out
    out = out.to(comm_device())  # NCCL gathers device tensors
    gathered = [torch.empty_like(out) for _ in range(dp)]
    dist.all_gather(gathered, out, group=parallel_state.get_data_parallel_group())
    return torch.cat(gathered, dim=0).cpu()
