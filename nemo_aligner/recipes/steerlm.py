"""SteerLM attribute-conditioned SFT: SFT on NeMo chat data whose Assistant turns carry attribute
labels (``train_steerlm_model.py``); the labels come from the data or from a regression reward
model (``examples/nlp/data/steerlm/attribute_annotate.py``)."""

from __future__ import annotations

import logging
from typing import Dict

from omegaconf import DictConfig

from nemo_aligner.recipes.sft import run_sft
from nemo_aligner.data.nlp.jsonl import read_jsonl
from nemo_aligner.data.nlp.steerlm_labels import parse_label
from nemo_aligner.utils.errors import ConfigError

logger = logging.getLogger(__name__)


def check_labels(path: str, key: str) -> int:
    """Count labelled turns in a chat jsonl, checking each label parses; errors name file and line."""
    labelled = 0
    for record in read_jsonl(path):
        for turn_no, turn in enumerate(record.get("conversations") or []):
            if isinstance(turn, dict) and turn.get("label") is not None:
                parse_label(turn["label"], f"{path}:{record['__line__']}: conversations[{turn_no}].label")
                labelled += 1
    if labelled == 0:
        logger.warning("%s=%s has no labelled turn: this is plain chat SFT, nothing to steer with", key, path)
    return labelled


def run_steerlm(cfg: DictConfig) -> Dict[str, float]:
    """Check the chat data's attribute labels, then run SFT on it."""
    if not cfg.model.data.get("chat", False):
        raise ConfigError("model.data.chat must be True for SteerLM (attribute labels live on chat turns)")
    for split in ("train_ds", "validation_ds"):
        paths = cfg.model.data[split].file_path
        for path in [paths] if isinstance(paths, str) else list(paths):
            check_labels(path, f"model.data.{split}.file_path")
    return run_sft(cfg)
