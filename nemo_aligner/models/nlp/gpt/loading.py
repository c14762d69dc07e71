"""Build a GPT role model from a run config, restoring weights from a .nemo when one is given."""

from __future__ import annotations

import logging
from typing import Iterable, Optional, Type

from omegaconf import DictConfig, OmegaConf, open_dict

from nemo_aligner.utils import nemo_file
from nemo_aligner.utils.tokenizers import build_tokenizer

logger = logging.getLogger(__name__)

# Keys that fix the shape of the weights: a restored checkpoint's values win over the run config.
ARCHITECTURE_KEYS = (
    "num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "num_query_groups", "kv_channels",
    "max_position_embeddings", "position_embedding_type", "normalization", "activation", "bias", "qkv_bias",
    "share_embeddings_and_output_weights", "rotary_percentage", "rotary_base", "layernorm_epsilon",
    "make_vocab_size_divisible_by", "padded_vocab_size", "qk_layernorm", "tokenizer",
)
# Keys describing the checkpoint itself, never copied into a new model's config.
_CHECKPOINT_ONLY = ("mcore_gpt", "dist_ckpt_format", "target", "precision", "nemo_version")


def merge_checkpoint_config(ckpt_cfg: DictConfig, run_cfg: DictConfig,
                            architecture_keys: Iterable[str] = ARCHITECTURE_KEYS) -> DictConfig:
    """The run's ``model.*`` on top of the checkpoint's config, except for architecture keys.

    This mirrors NeMo-Aligner (the run config overrides the restored one) while keeping
    a checkpoint loadable when the run config still carries the tiny built-in shape.
    """
    base = OmegaConf.to_container(ckpt_cfg, resolve=True)
    for key in _CHECKPOINT_ONLY:
        base.pop(key, None)
    run = OmegaConf.to_container(run_cfg, resolve=True)
    ignored = []
    for key in architecture_keys:
        if key in run and key in base and run[key] is not None and run[key] != base[key] and key != "tokenizer":
            ignored.append(f"{key}={base[key]} (config had {run[key]})")
        run.pop(key, None)
    if ignored:
        logger.info("using the checkpoint's architecture: %s", ", ".join(ignored))
    merged = OmegaConf.merge(OmegaConf.create(base), OmegaConf.create(run))
    return merged


def load_model(model_cls: Type, cfg: DictConfig, precision, restore_path: Optional[str] = None,
               key: str = "model.restore_from_path", allow_missing=(), **kwargs):
    """``model_cls(cfg, tokenizer, precision, **kwargs)``, with weights from ``restore_path`` if set.

    Without ``restore_path`` the model is randomly initialised from ``cfg`` and uses
    the tokenizer in ``cfg.tokenizer`` (the built-in byte tokenizer by default).
    Returns the model; the effective config is ``model.cfg``.
    """
    if not restore_path:
        tokenizer = build_tokenizer(cfg.get("tokenizer"))
        return model_cls(cfg, tokenizer, precision, **kwargs)
    ckpt_cfg = nemo_file.read_model_config(restore_path, key)
    merged = merge_checkpoint_config(ckpt_cfg, cfg)
    with nemo_file.extracted(restore_path, key) as directory:
        tokenizer_cfg = nemo_file.restore_tokenizer_files(merged.get("tokenizer") or OmegaConf.create({}), directory)
        tokenizer = build_tokenizer(tokenizer_cfg)
        with open_dict(merged):
            merged.tokenizer = tokenizer_cfg
        model = model_cls(merged, tokenizer, precision, **kwargs)
        model.load_weights(nemo_file.weights_dir(directory), what=f"{key}={restore_path}", allow_missing=allow_missing)
    logger.info("restored weights from %s", restore_path)
    return model
