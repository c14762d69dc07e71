"""Build a GPT role model from a run config, restoring weights from a .nemo when one is given."""

from __future__ import annotations

import logging
from typing import Optional, Type

from omegaconf import DictConfig, OmegaConf, open_dict

from nemo_aligner.utils import nemo_file
from nemo_aligner.utils.model_config import merge_checkpoint_config
from nemo_aligner.utils.tokenizers import build_tokenizer

logger = logging.getLogger(__name__)

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
        tokenizer_cfg, packed = nemo_file.restore_tokenizer_files(merged.get("tokenizer") or OmegaConf.create({}),
                                                                  directory)
        tokenizer = build_tokenizer(tokenizer_cfg, padded_vocab_size=merged.get("padded_vocab_size"),
                                    packed_dir=packed)
        with open_dict(merged):
            merged.tokenizer = tokenizer_cfg
        model = model_cls(merged, tokenizer, precision, **kwargs)
        model.load_weights(nemo_file.weights_dir(directory), what=f"{key}={restore_path}", allow_missing=allow_missing)
    logger.info("restored weights from %s", restore_path)
    return model
