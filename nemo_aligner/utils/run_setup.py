"""What every training script does first: check the config, start the processes' groups, seed."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist
from omegaconf import DictConfig

from nemo_aligner.utils import nemo_file
from nemo_aligner.utils.config_checks import check_config_values, check_run_limits_keys
from nemo_aligner.utils.distributed import (check_expert_parallel_size, check_parallel_sizes,
                                            init_distributed, initialize_model_parallel)
from nemo_aligner.utils.errors import ConfigError
from nemo_aligner.utils.model_config import check_architecture_values, merge_checkpoint_config, sequence_parallel_on

logger = logging.getLogger(__name__)


@dataclass
class ParallelInfo:
    """This process's place in the job."""

    rank: int
    world_size: int
    tp: int
    pp: int
    dp: int
    dp_rank: int


def effective_model_config(model_cfg: DictConfig, restore_path: Optional[str], key: str) -> DictConfig:
    """The model config a run will build: the checkpoint's architecture (if any) plus the run's keys."""
    if not restore_path:
        return model_cfg
    return merge_checkpoint_config(nemo_file.read_model_config(restore_path, key), model_cfg)


def resolve_sequence_length(model_cfg: DictConfig, arch: DictConfig, restore_path: Optional[str]) -> int:
    """Set ``model.encoder_seq_length`` when the config leaves it null: the checkpoint's value, or
    ``max_position_embeddings`` for a model built from scratch. Interpolations of it in the data and
    generation keys then resolve to the value the model is built with."""
    from omegaconf import open_dict

    value = model_cfg.get("encoder_seq_length")
    if value is None:
        value = arch.get("encoder_seq_length") or arch.get("max_position_embeddings")
        if value is None:
            raise ConfigError("model.encoder_seq_length is required: "
                              + ("the checkpoint has none" if restore_path else "model.restore_from_path is empty and "
                                 "model.max_position_embeddings is not set either"))
        with open_dict(model_cfg):
            model_cfg.encoder_seq_length = int(value)
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ConfigError(f"model.encoder_seq_length={value!r} must be a positive integer")
    learned = str(arch.get("position_embedding_type") or "learned_absolute") == "learned_absolute"
    max_pos = arch.get("max_position_embeddings")
    if learned and max_pos is not None and int(value) > int(max_pos):
        raise ConfigError(f"model.encoder_seq_length={value} is longer than the model's learned position embeddings "
                          f"(max_position_embeddings={max_pos})")
    return int(value)


def check_accelerator(trainer_cfg: DictConfig) -> None:
    accelerator = str(trainer_cfg.get("accelerator", "auto") or "auto").lower()
    if accelerator not in ("auto", "cpu", "gpu", "cuda"):
        raise ConfigError(f"trainer.accelerator={accelerator!r} must be auto, cpu or gpu")
    if accelerator in ("gpu", "cuda") and not torch.cuda.is_available():
        raise ConfigError("trainer.accelerator=gpu but no GPU is visible; use trainer.accelerator=auto or cpu")
    if accelerator == "cpu" and torch.cuda.is_available():
        # Everything follows torch.cuda.is_available() (NCCL, parameters on the GPU): hide the GPUs instead.
        raise ConfigError("trainer.accelerator=cpu but a GPU is visible; run with CUDA_VISIBLE_DEVICES= (empty) "
                          "to train on the CPU, or use trainer.accelerator=auto")


def init_run(cfg: DictConfig, restore_path: Optional[str] = None,
             restore_key: str = "model.restore_from_path", timeout_minutes: int = 30) -> ParallelInfo:
    """Start torch.distributed and megatron-core model parallelism from ``trainer.*`` and ``model.*``.

    Validates ``trainer.devices x trainer.num_nodes`` against the launched processes and
    TP/PP against the world size and the model's heads and layers (taken from the
    checkpoint when restoring). Servers pass a long ``timeout_minutes``: their other ranks
    wait in a collective until rank 0 gets a request.
    """
    from nemo_aligner.utils.config_keys import resolve_aliases

    resolve_aliases(cfg)  # the Python API's configs too (the scripts' are resolved at parse time)
    check_accelerator(cfg.trainer)
    arch = effective_model_config(cfg.model, restore_path, restore_key)
    resolve_sequence_length(cfg.model, arch, restore_path)
    check_config_values(cfg)
    check_run_limits_keys(cfg)
    for key in ("num_attention_heads", "num_layers"):
        if arch.get(key) is None:
            raise ConfigError(f"model.{key} is required when model.restore_from_path is empty")
    check_architecture_values(arch)  # the checkpoint's values, before the sizes below are read
    init_distributed(devices=cfg.trainer.get("devices", 1), num_nodes=cfg.trainer.get("num_nodes", 1),
                     timeout_minutes=timeout_minutes)
    world = dist.get_world_size()
    tp = int(cfg.model.get("tensor_model_parallel_size", 1) or 1)
    pp = int(cfg.model.get("pipeline_model_parallel_size", 1) or 1)
    dp = check_parallel_sizes(world, tp, pp, int(arch.num_attention_heads), arch.get("num_query_groups"),
                              int(arch.num_layers))
    if sequence_parallel_on(cfg.model) and not torch.cuda.is_available():
        raise ConfigError("model.sequence_parallel=True needs Transformer Engine on a GPU; set it to False on CPU")
    ep = int(cfg.model.get("expert_model_parallel_size", 1) or 1)
    check_expert_parallel_size(ep, dp, arch.get("num_moe_experts"))
    initialize_model_parallel(tp, pp, seed=int(cfg.model.get("seed", 1234) or 1234), ep=ep)
    from megatron.core import parallel_state

    from nemo_aligner.utils.exp_manager import setup_console_logging

    setup_console_logging()
    info = ParallelInfo(dist.get_rank(), world, tp, pp, dp, parallel_state.get_data_parallel_rank())
    logger.info("world size %d: tensor parallel %d x pipeline parallel %d x data parallel %d%s", world, tp, pp, dp,
                f" (experts split over {ep} of them)" if ep > 1 else "")
    return info
