"""SteerLM 2.0's data (NeMo-Aligner's ``SteerLM2Dataset``): per record a prompt (``system``,
``prompt_turns``), the attribute string asked for (``label``) and n sampled ``responses``, each with
``log(P(a|x,y))`` (attribute model), ``log(P(y|x))`` (unconditioned model) and ``log(Q(y|a,x))``
(the SteerLM model that sampled it). The importance weights ``ws`` of a record's responses are
``softmax(log P(a|x,y) + log P(y|x) - log Q(y|a,x))``: samples of Q reweighted towards
``P(y|a,x) ~ P(a|x,y) P(y|x)``."""

from __future__ import annotations

import logging
import math
from typing import Dict, List, Optional, Sequence

import torch

from nemo_aligner.data.nlp.chat_template import chat_tokens
from nemo_aligner.data.nlp.steerlm_labels import render_turns, steer_prompt
from nemo_aligner.utils.errors import DataError

logger = logging.getLogger(__name__)
LOG_KEYS = ("log(P(a|x,y))", "log(P(y|x))", "log(Q(y|a,x))")


def importance_weights(log_pa: Sequence[float], log_py: Sequence[float], log_q: Sequence[float]) -> List[float]:
    """``softmax(log P(a|x,y) + log P(y|x) - log Q(y|a,x))`` over one record's responses."""
    logw = torch.tensor([a + p - q for a, p, q in zip(log_pa, log_py, log_q)], dtype=torch.float64)
    return torch.softmax(logw, 0).tolist()


def response_prompt(system: str, turns: Sequence[Dict], responder: str = "Assistant", label: Optional[str] = None,
                    tokens: Optional[dict] = None) -> str:
    """The chat up to a response: the turns, then the responder's header with the label
    (``steerlm_labels.steer_prompt``; without a label, the header alone)."""
    if label is None:
        t = chat_tokens(tokens)
        return render_turns(system or "", turns, tokens) + f"{t['turn_start']}{responder}{t['end_of_name']}"
    return steer_prompt(turns, str(label), system=system or "", assistant=responder, chat_tokens=tokens)


def steerlm2_prompt(record: Dict, tokens: Optional[dict] = None) -> str:
    """The record's prompt as the SteerLM model sees it (:func:`response_prompt` with its label)."""
    return response_prompt(record.get("system"), record["prompt_turns"], record["responses"][0]["from"],
                           record.get("label"), tokens)


def check_record(record: Dict, where: str, num_responses: Optional[int]) -> int:
    """Refuse a record NeMo-Aligner's format does not allow, naming ``where``; returns its response count."""
    turns = record.get("prompt_turns")
    if not isinstance(turns, list) or len(turns) % 2 != 1 or \
            not all(isinstance(t, dict) and isinstance(t.get("value"), str) and "from" in t for t in turns):
        raise DataError(f"{where}: prompt_turns must be an odd-length list of {{\"from\", \"value\"}} turns "
                        "(ending with the user's)")
    responses = record.get("responses")
    if not isinstance(responses, list) or not responses:
        raise DataError(f"{where}: responses must be a non-empty list")
    if len({r.get("from") for r in responses if isinstance(r, dict)}) != 1 or not all(isinstance(r, dict) for r in responses):
        raise DataError(f"{where}: all responses must be dicts from the same speaker")
    for i, r in enumerate(responses):
        if not isinstance(r.get("value"), str):
            raise DataError(f"{where}: responses[{i}].value must be a string")
        for key in LOG_KEYS:
            v = r.get(key)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
                raise DataError(f"{where}: responses[{i}][{key!r}] must be a finite number, got {v!r}")
    if num_responses is not None and len(responses) != num_responses:
        raise DataError(f"{where}: {len(responses)} responses; the other records have {num_responses} "
                        "(every record needs the same number)")
    return len(responses)


class SteerLM2Dataset(torch.utils.data.Dataset):
    """Records of NeMo-Aligner's SteerLM 2.0 format; each item is all of one record's responses."""

    def __init__(self, records: List[Dict], tokenizer, max_seq_length: int, chat_prompt_tokens=None,
                 name: str = "data"):
        self.records, self.tokenizer, self.max_seq_length = records, tokenizer, int(max_seq_length)
        self.tokens = chat_prompt_tokens
        n = None
        for r in records:
            n = check_record(r, f"{r.get('__file__', name)}:{r.get('__line__', '?')}", n)
        if n is None:
            raise DataError(f"{name}: no records")
        self.num_responses = n

    def __len__(self) -> int:
        return len(self.records)

    def _warn_cut(self, record: Dict, length: int) -> None:
        if not getattr(self, "_warned", False):
            self._warned = True
            logger.warning("%s:%s: a response row of %d tokens is cut to the sequence length %d (a response cut "
                           "away entirely carries no loss); further cuts are not reported",
                           record.get("__file__", "data"), record.get("__line__", "?"), length, self.max_seq_length + 1)

    def __getitem__(self, idx: int) -> Dict:
        record = self.records[idx]
        t = chat_tokens(self.tokens)
        prompt_ids = self.tokenizer.text_to_ids(steerlm2_prompt(record, self.tokens))
        rows, masks = [], []
        for r in record["responses"]:
            answer = self.tokenizer.text_to_ids(r["value"] + t["end_of_turn"] + t["turn_start"])
            ids = (prompt_ids + answer)[: self.max_seq_length + 1]
            if len(ids) < len(prompt_ids) + len(answer):
                self._warn_cut(record, len(prompt_ids) + len(answer))
            rows.append(ids)
            masks.append(([0] * len(prompt_ids) + [1] * len(answer))[: len(ids)])
        logs = {k: [float(r[k]) for r in record["responses"]] for k in LOG_KEYS}
        return {"input_ids": rows, "mask": masks, "log_q": logs["log(Q(y|a,x))"],
                "ws": importance_weights(logs["log(P(a|x,y))"], logs["log(P(y|x))"], logs["log(Q(y|a,x))"])}


def collate_steerlm2(samples: Sequence[Dict], pad_id: int, pad_to_multiple_of: int = 8) -> Dict[str, torch.Tensor]:
    """Every record's responses as rows (record-major): ``tokens``, ``labels``, ``loss_mask`` (response
    tokens), ``position_ids``, ``lengths``, ``ws``, ``log_q`` and ``group`` (the row's record in the batch)."""
    rows = [(g, ids, mask) for g, s in enumerate(samples) for ids, mask in zip(s["input_ids"], s["mask"])]
    longest = max(len(ids) - 1 for _, ids, _ in rows)
    multiple = max(int(pad_to_multiple_of or 1), 1)
    length = -(-longest // multiple) * multiple
    n = len(rows)
    out = {"tokens": torch.full((n, length), pad_id, dtype=torch.long),
           "labels": torch.full((n, length), pad_id, dtype=torch.long),
           "loss_mask": torch.zeros((n, length), dtype=torch.float32), "lengths": torch.zeros(n, dtype=torch.long)}
    for i, (_, ids, mask) in enumerate(rows):
        k = len(ids) - 1
        out["tokens"][i, :k] = torch.tensor(ids[:-1])
        out["labels"][i, :k] = torch.tensor(ids[1:])
        out["loss_mask"][i, :k] = torch.tensor(mask[1:], dtype=torch.float32)
        out["lengths"][i] = k
    out["position_ids"] = torch.arange(length).unsqueeze(0).expand(n, length).contiguous()
    out["ws"] = torch.tensor([w for s in samples for w in s["ws"]], dtype=torch.float32)
    out["log_q"] = torch.tensor([q for s in samples for q in s["log_q"]], dtype=torch.float32)
    out["group"] = torch.tensor([g for g, _, _ in rows], dtype=torch.long)
    return out
