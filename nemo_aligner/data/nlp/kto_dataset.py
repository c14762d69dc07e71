"""Unpaired preference data for KTO: ``{"prompt", "response", "preference": "chosen"|"rejected"}``.

The prompt may be a string or a list of chat messages (as for DPO). Each batch also carries the
mismatched sequences KTO's KL estimate needs: prompt ``i`` followed by response ``i + 1``
(cyclically, within the batch), as in the KTO paper.
"""

from __future__ import annotations

from typing import Dict, Sequence

import torch

from nemo_aligner.data.nlp.dpo_dataset import (TruncationWarning, encode_and_count_cut, encode_prompt_response, pad_rows,
                                               padded_length, prompt_text, response_mask)
from nemo_aligner.data.nlp.jsonl import read_jsonl_files, require_fields
from nemo_aligner.data.nlp.length_report import report_truncated
from nemo_aligner.utils.errors import DataError

PREFERENCE_VALUES = {"chosen": 1.0, "rejected": 0.0}


class KTODataset(torch.utils.data.Dataset):
    """Tokenized prompts and responses with a desirable (1) / undesirable (0) flag."""

    def __init__(self, paths, tokenizer, seq_length: int, key: str = "model.data.data_prefix.train", records=None,
                 chat_tokens=None, add_eos: bool = True):
        self.tokenizer = tokenizer
        self.add_eos = add_eos  # model.data.append_eod
        self.seq_length = int(seq_length)
        records = records if records is not None else read_jsonl_files(paths, key)
        self.items = []
        for record in records:
            path = record.get("__file__", str(paths))
            where = f"{path}:{record['__line__']}"
            require_fields(record, ["prompt"], path, types=(str, list))
            require_fields(record, ["response", "preference"], path)
            require_fields(record, ["response"], path, non_empty=True)
            preference = record["preference"]
            if preference not in PREFERENCE_VALUES:
                raise DataError(f"{where}: field 'preference' must be \"chosen\" or \"rejected\", got {preference!r}")
            self.items.append((prompt_text(record, where, chat_tokens), record["response"], PREFERENCE_VALUES[preference],
                               where))
        how = "the prompt is cut from the left, then the response from the right"
        self._warn_truncated = TruncationWarning(self.seq_length, how)
        self._warn_truncated.warned = bool(report_truncated(
            str(paths), ((where, encode_and_count_cut(tokenizer, tokenizer.text_to_ids(prompt), response,
                                                      self.seq_length, add_eos)[2])
                         for prompt, response, _, where in self.items),
            self.seq_length, how))

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, idx: int) -> Dict:
        if idx < 0:  # padding of a partial validation batch
            return {"prompt_ids": [self.tokenizer.eos_id], "response": "", "desirable": 0.0, "padding": True,
                    "add_eos": True}
        prompt, response, desirable, where = self.items[idx]
        prompt_ids = self.tokenizer.text_to_ids(prompt)
        if not self._warn_truncated.warned:  # the collate encodes the pair; this is only for the warning
            self._warn_truncated(where, encode_and_count_cut(self.tokenizer, prompt_ids, response, self.seq_length,
                                                             self.add_eos)[2])
        return {"prompt_ids": prompt_ids, "response": response, "desirable": desirable, "add_eos": self.add_eos}


def collate_kto(samples: Sequence[Dict], tokenizer, seq_length: int, pad_to_multiple_of: int = 8) -> Dict:
    """``tokens``/``mask`` of prompt + response, ``kl_tokens``/``kl_mask`` of prompt ``i`` + response
    ``i + 1``, ``desirable`` and ``weight`` (0 for padding) per row."""
    real = [i for i, s in enumerate(samples) if not s.get("padding")]
    matched = [encode_prompt_response(tokenizer, s["prompt_ids"], s["response"], seq_length, s.get("add_eos", True))
               for s in samples]
    mismatched = list(matched)
    if len(real) > 1:  # a lone sample has no mismatched partner; its KL row gets weight 0
        for j, i in enumerate(real):
            partner = samples[real[(j + 1) % len(real)]]
            mismatched[i] = encode_prompt_response(tokenizer, samples[i]["prompt_ids"], partner["response"], seq_length,
                                                   samples[i].get("add_eos", True))
    longest = max(len(ids) for ids, _ in matched + mismatched)
    width = padded_length(longest, seq_length, pad_to_multiple_of)
    weight = torch.tensor([0.0 if s.get("padding") else 1.0 for s in samples])
    out = {}
    for name, rows in (("tokens", matched), ("kl_tokens", mismatched)):
        out[name] = pad_rows([ids for ids, _ in rows], width, tokenizer.eos_id)
        out["mask" if name == "tokens" else "kl_mask"] = response_mask(
            [(1, 1) if s.get("padding") else (len(ids), p) for s, (ids, p) in zip(samples, rows)], width)
    out["desirable"] = torch.tensor([s["desirable"] for s in samples], dtype=torch.float32)
    out["weight"] = weight
    out["kl_weight"] = weight if len(real) > 1 else torch.zeros_like(weight)
    return out
