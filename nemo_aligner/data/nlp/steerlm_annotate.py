"""Label chat data with SteerLM attributes from a regression reward-model server.

Each Assistant turn's conversation prefix (rendered with the chat template, no labels) is scored
by the ``reward_model`` server; the values, rounded and clipped to ``[min_value, max_value]``,
become the turn's ``label`` (``"quality:4,verbosity:2"``).
"""

from __future__ import annotations

import logging
from typing import Dict, List, Optional, Sequence

import numpy as np

from nemo_aligner.data.nlp.chat_template import turns_problem
from nemo_aligner.data.nlp.jsonl import require_fields
from nemo_aligner.data.nlp.steerlm_labels import NEMO_ATTRIBUTES, assistant_turn_texts, format_label
from nemo_aligner.utils.errors import ConfigError, DataError

logger = logging.getLogger(__name__)


def values_to_label(values: Sequence[float], names: Sequence[str], min_value: float, max_value: float) -> str:
    """Round each value to an integer, clip it to the range and format ``name:value,...``."""
    clipped = np.clip(np.rint(np.asarray(values, dtype=np.float64)), min_value, max_value)
    return format_label([float(v) for v in clipped], names)


def annotate_records(records: List[Dict], client, names: Optional[Sequence[str]] = None, batch_size: int = 32,
                     min_value: float = 0, max_value: float = 4, assistant: str = "Assistant",
                     chat_tokens: Optional[dict] = None, where: str = "input", max_length: Optional[int] = None) -> int:
    """Set ``label`` on every Assistant turn of ``records`` in place; returns the number labelled.
    ``client`` is a :class:`RemoteGPTRMClient` with a tokenizer; ``max_length`` keeps each text's
    last tokens, as reward-model training does."""
    if min_value > max_value:
        raise ConfigError(f"--min-value {min_value} is above --max-value {max_value}")
    jobs = []
    for record in records:
        require_fields(record, ["conversations"], where, types=(list,))
        problem = turns_problem(record["conversations"], f"{where}:{record['__line__']}")
        if problem:
            raise DataError(problem)
        jobs += [(record, i, text) for i, text in assistant_turn_texts(record, chat_tokens, assistant)]
    futures = [client.infer_texts([text for _, _, text in jobs[s : s + batch_size]], max_length)
               for s in range(0, len(jobs), batch_size)]
    start = 0
    for future in futures:
        rewards = np.asarray(future.result())
        rewards = rewards.reshape(len(rewards), -1)
        if names is None:
            if rewards.shape[1] != len(NEMO_ATTRIBUTES):
                raise ConfigError(f"the server returns {rewards.shape[1]} attributes: pass --attributes with "
                                  f"{rewards.shape[1]} comma-separated names")
            names = NEMO_ATTRIBUTES
        if rewards.shape[1] != len(names):
            raise ConfigError(f"--attributes names {len(names)} attributes ({','.join(names)}) but the server "
                              f"returns {rewards.shape[1]}")
        for row, (record, turn_no, _) in zip(rewards, jobs[start : start + len(rewards)]):
            if not np.isfinite(row).all():
                raise DataError(f"{where}:{record['__line__']}: conversations[{turn_no}]: the server returned "
                                f"non-finite values {row.tolist()}")
            record["conversations"][turn_no]["label"] = values_to_label(row, names, min_value, max_value)
            record.setdefault("type", "VALUE_TO_TEXT")  # NeMo's chat format renders labels only with a type
        start += len(rewards)
    return len(jobs)
