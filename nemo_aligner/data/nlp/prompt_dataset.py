"""Prompts for on-line RL (PPO, REINFORCE, GRPO): jsonl ``{"text": prompt}``, tokenized without EOS."""

from __future__ import annotations

import logging
from typing import Dict, List, Sequence

import torch

from nemo_aligner.data.nlp.jsonl import require_fields
from nemo_aligner.data.nlp.reward_datasets import read_files

logger = logging.getLogger(__name__)


class PromptDataset(torch.utils.data.Dataset):
    """Each item: ``{"text", "tokens"}``; prompts longer than ``max_prompt_length`` keep their end."""

    def __init__(self, paths, tokenizer, max_prompt_length: int, key: str = "model.data.data_prefix.train",
                 records=None, text_key: str = "text"):
        records = records if records is not None else read_files(paths, key)
        self.items: List[Dict] = []
        truncated = 0
        for record in records:
            require_fields(record, [text_key], record.get("__file__", str(paths)), non_empty=True)
            ids = tokenizer.text_to_ids(record[text_key])
            if len(ids) > max_prompt_length:
                truncated += 1
                ids = ids[-max_prompt_length:]
            if not ids:
                ids = [tokenizer.eos_id]
            self.items.append({"text": record[text_key], "tokens": ids, "metadata": record_metadata(record, text_key)})
        if truncated:
            logger.warning("%d prompt(s) longer than %d tokens keep only their last %d tokens (%s)", truncated,
                           max_prompt_length, max_prompt_length, key)

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, idx: int) -> Dict:
        if idx < 0:
            return {"text": None, "tokens": None, "metadata": None}
        return self.items[idx]


def record_metadata(record: Dict, text_key: str) -> Dict:
    """A prompt record's other fields (a reference answer, a task id ...), given to reward functions
    and environments with each of its responses. A lone ``metadata`` object is taken as it is."""
    extra = {k: v for k, v in record.items() if k != text_key and not str(k).startswith("__")}
    if set(extra) == {"metadata"} and isinstance(extra["metadata"], dict):
        return dict(extra["metadata"])
    return extra


def collate_prompts(samples: Sequence[Dict]) -> Dict[str, list]:
    """Lists (prompts stay ragged: generation aligns them itself); padding rows are dropped."""
    real = [s for s in samples if s["tokens"] is not None]
    return {"text": [s["text"] for s in real], "tokens": [s["tokens"] for s in real],
            "metadata": [s.get("metadata") or {} for s in real]}
