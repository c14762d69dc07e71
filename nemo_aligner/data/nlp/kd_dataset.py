"""Knowledge-distillation data (NeMo-Aligner's ``KnowledgeDistillationDataset``): jsonl records with
``tokens``, ``labels``, ``loss_mask`` and, per position, the teacher's ``topk_logits`` and
``topk_token_ids`` (largest first), as ``compute_topk_logits.py`` writes them."""

from __future__ import annotations

import logging
from typing import Dict, List, Optional, Sequence

import numpy as np
import torch

from nemo_aligner.data.nlp.jsonl import read_jsonl_files
from nemo_aligner.utils.errors import DataError

logger = logging.getLogger(__name__)

KD_FIELDS = ("tokens", "labels", "loss_mask", "topk_logits", "topk_token_ids")


def _where(record: dict) -> str:
    return f"{record.get('__file__', '?')}:{record.get('__line__', '?')}"


def check_kd_record(record: dict, vocab_size: int, top_k: Optional[int]) -> int:
    """Refuse a record the student cannot train on, naming file:line; returns its k."""
    where = _where(record)
    missing = [f for f in KD_FIELDS if f not in record]
    if missing:
        raise DataError(f"{where}: missing {missing} (records of compute_topk_logits.py: {list(KD_FIELDS)})")
    n = len(record["tokens"]) if isinstance(record["tokens"], list) else -1
    if n < 1:
        raise DataError(f"{where}: tokens must be a non-empty list of token ids")
    for f in ("labels", "loss_mask", "topk_logits", "topk_token_ids"):
        if not isinstance(record[f], list) or len(record[f]) != n:
            raise DataError(f"{where}: {f} must be a list of {n} entries, one per token")
    try:
        logits = np.asarray(record["topk_logits"], dtype=np.float64)
        ids = np.asarray(record["topk_token_ids"])
        tokens = np.asarray(record["tokens"] + record["labels"])
    except (TypeError, ValueError):
        raise DataError(f"{where}: topk_logits/topk_token_ids must be rectangular [tokens, k] lists") from None
    if logits.ndim != 2 or ids.shape != logits.shape or logits.shape[1] < 1:
        raise DataError(f"{where}: topk_logits {list(logits.shape)} and topk_token_ids {list(ids.shape)} must "
                        "both be [tokens, k]")
    for name, values in (("tokens/labels", tokens), ("topk_token_ids", ids)):
        if values.dtype.kind not in "iu" or values.min() < 0 or values.max() >= vocab_size:
            raise DataError(f"{where}: {name} must be token ids in 0..{vocab_size - 1} (the student's vocabulary)")
    if not np.isfinite(logits).all():
        raise DataError(f"{where}: topk_logits holds a non-finite value")
    k = logits.shape[1]
    if top_k is not None and top_k > k:
        raise DataError(f"{where}: has {k} teacher logits per token; model.data.top_k={top_k} asks for more")
    if k > 1 and (np.diff(logits, axis=1) > 1e-6).any():
        raise DataError(f"{where}: topk_logits must be sorted largest first (model.data.top_k keeps the first k)")
    return k


class KnowledgeDistillationDataset(torch.utils.data.Dataset):
    """Records of ``paths``; ``top_k`` keeps each position's first (largest) k teacher logits;
    a record longer than ``seq_length`` tokens is cut to it (with a warning naming the first)."""

    def __init__(self, paths, vocab_size: int, seq_length: int, top_k: Optional[int] = None,
                 key: str = "model.data.data_prefix", records: Optional[List[dict]] = None):
        self.records = records if records is not None else read_jsonl_files(paths, key)
        if not self.records:
            raise DataError(f"{key}: no records")
        self.seq_length = int(seq_length)
        self.top_k = int(top_k) if top_k is not None else None
        ks = {check_kd_record(r, vocab_size, self.top_k) for r in self.records}
        if self.top_k is None and len(ks) > 1:
            raise DataError(f"{key}: records have different numbers of teacher logits per token {sorted(ks)}; "
                            "set model.data.top_k")
        self.k = self.top_k or ks.pop()
        long = [r for r in self.records if len(r["tokens"]) > self.seq_length]
        if long:
            logger.warning("%s: %d tokens, longer than the sequence length %d; cut to it (and %d more records)",
                           _where(long[0]), len(long[0]["tokens"]), self.seq_length, len(long) - 1)

    def __len__(self) -> int:
        return len(self.records)

    def __getitem__(self, idx: int) -> Dict:
        if idx < 0:  # padding of a partial validation batch: no loss
            return {"tokens": [0], "labels": [0], "loss_mask": [0], "topk_logits": [[0.0] * self.k],
                    "topk_token_ids": [[0] * self.k]}
        r = self.records[idx]
        n, k = min(len(r["tokens"]), self.seq_length), self.k
        return {"tokens": r["tokens"][:n], "labels": r["labels"][:n], "loss_mask": r["loss_mask"][:n],
                "topk_logits": [row[:k] for row in r["topk_logits"][:n]],
                "topk_token_ids": [row[:k] for row in r["topk_token_ids"][:n]]}


def collate_kd(samples: Sequence[Dict], pad_id: int, pad_to_multiple_of: int = 8) -> Dict[str, torch.Tensor]:
    """Right-pad to the longest sample (rounded up to ``pad_to_multiple_of``): padding has no loss."""
    longest = max(len(s["tokens"]) for s in samples)
    multiple = max(int(pad_to_multiple_of or 1), 1)
    length = -(-longest // multiple) * multiple
    k = len(samples[0]["topk_logits"][0])
    b = len(samples)
    out = {"tokens": torch.full((b, length), pad_id, dtype=torch.long),
           "labels": torch.full((b, length), pad_id, dtype=torch.long),
           "loss_mask": torch.zeros((b, length), dtype=torch.float32),
           "topk_logits": torch.zeros((b, length, k), dtype=torch.float32),
           "topk_token_ids": torch.zeros((b, length, k), dtype=torch.long),
           "lengths": torch.zeros((b,), dtype=torch.long)}
    for i, s in enumerate(samples):
        n = len(s["tokens"])
        out["tokens"][i, :n] = torch.tensor(s["tokens"])
        out["labels"][i, :n] = torch.tensor(s["labels"])
        out["loss_mask"][i, :n] = torch.tensor(s["loss_mask"], dtype=torch.float32)
        out["topk_logits"][i, :n] = torch.tensor(s["topk_logits"], dtype=torch.float32)
        out["topk_token_ids"][i, :n] = torch.tensor(s["topk_token_ids"])
        out["lengths"][i] = n if any(s["loss_mask"]) else 0
    out["position_ids"] = torch.arange(length).unsqueeze(0).expand(b, length).contiguous()
    return out
