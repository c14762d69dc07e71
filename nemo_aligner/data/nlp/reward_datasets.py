"""Reward-model datasets in NeMo-Aligner's jsonl formats.

- Comparisons (Bradley-Terry): ``{"text": prompt + chosen}`` then ``{"text": prompt + rejected}``
  on consecutive lines, chosen first.
- Regression (SteerLM attributes): ``{"text", "label"}``, the label a list of floats (``-100``
  for a missing attribute) or a string ``"quality:4,toxicity:0,..."``.

Each text is tokenized with EOS appended; the reward is read at the last token. A text
longer than ``seq_length`` keeps its end (the response being judged) and loses its start.
"""

from __future__ import annotations

import logging
import math
import os
from typing import Dict, List, Optional, Sequence

import torch

from nemo_aligner.data.nlp.jsonl import read_jsonl_files, require_fields
from nemo_aligner.data.nlp.length_report import report_truncated
from nemo_aligner.utils.errors import ConfigError, DataError

logger = logging.getLogger(__name__)

# NeMo SteerLM's attribute order (HelpSteer + OASST): the label vector follows it.
STEERLM_ATTRIBUTES = ("quality", "toxicity", "humor", "creativity", "helpfulness", "correctness",
                      "coherence", "complexity", "verbosity")
MISSING = -100.0


def common_prefix_length(a: str, b: str) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def read_files(paths, key: str) -> List[dict]:
    """Records of one or more jsonl files; each keeps ``__file__`` and ``__line__``."""
    return read_jsonl_files(paths, key)


def warn_identical_pairs(places: List[str]) -> None:
    """One warning for pairs whose chosen and rejected texts are the same (``places``: their
    ``file:line``): such a pair teaches nothing, as its loss is a constant."""
    if places:
        logger.warning("%s: the chosen and rejected responses are identical (%d such pair%s in all%s); "
                       "such pairs carry no preference signal", places[0], len(places), "" if len(places) == 1 else "s",
                       "" if len(places) == 1 else f", also {', '.join(places[1:4])}{' ...' if len(places) > 4 else ''}")


KEEPS_END = "each text keeps its end, the response being judged"


def tokenize_text(tokenizer, text: str, seq_length: Optional[int], add_eos: bool = True) -> List[int]:
    """Token ids of ``text`` (EOS appended), keeping the last ``seq_length`` (all when None)."""
    ids = tokenizer.text_to_ids(text)
    if add_eos:
        ids.append(tokenizer.eos_id)
    return ids[-seq_length:] if seq_length else ids


def texts_to_tokens(tokenizer, texts: Sequence[str], seq_length: Optional[int] = None, add_eos: bool = True):
    """``(tokens int64 [B, longest], lengths int64 [B])`` of ``texts`` tokenized by :func:`tokenize_text`,
    right-padded with EOS: a reward-model request's inputs."""
    import numpy as np

    rows = [tokenize_text(tokenizer, text, seq_length, add_eos) for text in texts]
    tokens = np.full((len(rows), max((len(r) for r in rows), default=0)), tokenizer.eos_id, dtype=np.int64)
    for i, ids in enumerate(rows):
        tokens[i, :len(ids)] = ids
    return tokens, np.array([len(r) for r in rows], dtype=np.int64)


class RewardComparisonDataset(torch.utils.data.Dataset):
    """Pairs of consecutive lines (chosen, rejected) for the pairwise (Bradley-Terry) loss. ``add_eos``:
    ``model.data.append_eod``. Pairs longer than ``seq_length`` are skipped."""

    def __init__(self, paths, tokenizer, seq_length: int, key: str = "model.data.data_prefix.train",
                 records=None, add_eos: bool = True):
        self.tokenizer = tokenizer
        self.seq_length = int(seq_length)
        self.add_eos = add_eos
        records = records if records is not None else read_files(paths, key)
        by_file: Dict[str, List[dict]] = {}
        for record in records:
            by_file.setdefault(record.get("__file__", str(paths)), []).append(record)
        self.pairs, self.places = [], []
        identical = []
        for path, rows in by_file.items():
            for record in rows:
                require_fields(record, ["text"], path, non_empty=True)
            if len(rows) % 2:
                raise DataError(
                    f"{path}:{rows[-1]['__line__']}: odd number of records ({len(rows)}); comparisons come in "
                    "pairs, chosen then rejected on consecutive lines"
                )
            for chosen, rejected in zip(rows[::2], rows[1::2]):
                shared = common_prefix_length(chosen["text"], rejected["text"])
                if shared < min(8, len(chosen["text"]), len(rejected["text"])):
                    raise DataError(
                        f"{path}:{rejected['__line__']}: this rejected text does not start with the prompt of "
                        f"the chosen text on line {chosen['__line__']} (they share {shared} characters); "
                        "are the lines out of order?"
                    )
                if chosen["text"] == rejected["text"]:
                    identical.append(f"{path}:{rejected['__line__']}")
                self.pairs.append((chosen["text"], rejected["text"]))
                self.places.append(f"{path}:{chosen['__line__']}")
        warn_identical_pairs(identical)
        self._skip_over_long(str(paths))

    def _skip_over_long(self, name: str) -> None:
        """Drop the pairs in which either text is longer than the sequence length, as NeMo-Aligner
        does (a cut text would be judged without its end); log their count and the first file:line."""
        over_by = [max(self._cut(c), self._cut(r)) for c, r in self.pairs]  # each text tokenized once
        keep = [i for i, over in enumerate(over_by) if not over]
        dropped = len(self.pairs) - len(keep)
        if not dropped:
            return
        first = next(i for i, over in enumerate(over_by) if over)
        if not name or name == "None":  # records handed over in memory: name their file
            name = self.places[first].rsplit(":", 1)[0]
        over = over_by[first]
        if not keep:
            raise DataError(f"{name}: every one of the {len(self.pairs)} comparison pairs is longer than the "
                            f"sequence length {self.seq_length} (first: {self.places[first]}, {over} tokens over): "
                            "raise model.encoder_seq_length (or model.data.seq_length)")
        logger.warning("%s: %d of %d comparison pairs are longer than the sequence length %d and are skipped "
                       "(first: %s, %d tokens over)", name, dropped, len(self.pairs), self.seq_length,
                       self.places[first], over)
        self.pairs = [self.pairs[i] for i in keep]
        self.places = [self.places[i] for i in keep]

    def _cut(self, text: str) -> int:
        return max(len(self.tokenizer.text_to_ids(text)) + int(self.add_eos) - self.seq_length, 0)

    def __len__(self) -> int:
        return len(self.pairs)

    def __getitem__(self, idx: int) -> Dict:
        if idx < 0:  # padding of a partial validation batch
            return {"chosen": [self.tokenizer.eos_id], "rejected": [self.tokenizer.eos_id], "padding": True}
        chosen, rejected = self.pairs[idx]
        return {"chosen": tokenize_text(self.tokenizer, chosen, self.seq_length, self.add_eos),
                "rejected": tokenize_text(self.tokenizer, rejected, self.seq_length, self.add_eos)}


def parse_label(label, attribute_names: Sequence[str], num_attributes: int, where: str,
                missing: float = MISSING) -> List[float]:
    """A list of floats (``missing``, ``model.regression.loss_mask_val``, where an attribute has no
    value) of length ``num_attributes`` from a list or a ``name:value`` string."""
    if isinstance(label, (int, float)) and not isinstance(label, bool):
        label = [label]
    if isinstance(label, list):
        if len(label) != num_attributes:
            raise DataError(f"{where}: label has {len(label)} values but model.regression.num_attributes={num_attributes}")
        if any(isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) for v in label):
            raise DataError(f"{where}: label values must be finite numbers, got {label!r}")
        return [float(v) for v in label]
    if not isinstance(label, str):
        raise DataError(f"{where}: field 'label' must be a list of numbers or a 'name:value,...' string")
    values = [float(missing)] * num_attributes
    for part in filter(None, (p.strip() for p in label.split(","))):
        name, sep, value = part.partition(":")
        if not sep:
            raise DataError(f"{where}: label part {part!r} is not name:value")
        name = name.strip()
        if name not in attribute_names:
            raise DataError(f"{where}: unknown attribute {name!r}; model.regression.attribute_names is "
                            f"{list(attribute_names)}")
        try:
            number = float(value)
        except ValueError:
            number = float("nan")
        if not math.isfinite(number):
            raise DataError(f"{where}: attribute {name!r} has a value that is not a finite number: {value!r}")
        values[list(attribute_names).index(name)] = number
    return values


class RegressionRewardDataset(torch.utils.data.Dataset):
    """``{"text", "label"}`` records for the masked MSE loss of a multi-attribute (SteerLM) reward model."""

    def __init__(self, paths, tokenizer, seq_length: int, num_attributes: int,
                 attribute_names: Optional[Sequence[str]] = None, key: str = "model.data.data_prefix.train",
                 records=None, add_eos: bool = True, missing: float = MISSING):
        self.tokenizer = tokenizer
        self.seq_length = int(seq_length)
        self.add_eos = add_eos
        self.num_attributes = int(num_attributes)
        self.missing = float(missing)  # the loss's mask value: missing attributes and padding rows
        names = list(attribute_names) if attribute_names else list(STEERLM_ATTRIBUTES)
        records = records if records is not None else read_files(paths, key)
        self.items, places = [], []
        for record in records:
            path = record.get("__file__", str(paths))
            require_fields(record, ["text"], path, non_empty=True)
            require_fields(record, ["label"], path, types=(list, str, int, float))
            where = f"{path}:{record['__line__']}"
            if isinstance(record["label"], str) and len(names) != self.num_attributes:
                raise ConfigError(
                    f"model.regression.num_attributes={self.num_attributes} but model.regression.attribute_names "
                    f"lists {len(names)} names ({names}); string labels need one name per attribute"
                )
            self.items.append((record["text"], parse_label(record["label"], names, self.num_attributes, where,
                                                           self.missing)))
            places.append(where)
        cut = lambda text: max(len(tokenizer.text_to_ids(text)) + int(add_eos) - self.seq_length, 0)  # noqa: E731
        report_truncated(str(paths), ((where, cut(text)) for where, (text, _) in zip(places, self.items)),
                         self.seq_length, KEEPS_END)
        self.attribute_names = names if len(names) == self.num_attributes else [f"attr{i}" for i in range(num_attributes)]

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, idx: int) -> Dict:
        if idx < 0:
            return {"tokens": [self.tokenizer.eos_id], "label": [self.missing] * self.num_attributes, "padding": True}
        text, label = self.items[idx]
        return {"tokens": tokenize_text(self.tokenizer, text, self.seq_length, self.add_eos), "label": label}


def _pad(seqs: Sequence[List[int]], pad_id: int, length: int) -> torch.Tensor:
    out = torch.full((len(seqs), length), pad_id, dtype=torch.long)
    for i, s in enumerate(seqs):
        out[i, : len(s)] = torch.tensor(s, dtype=torch.long)
    return out


def padded_length(longest: int, seq_length: int, multiple: int = 8) -> int:
    multiple = max(int(multiple or 1), 1)
    return min(-(-longest // multiple) * multiple, seq_length)


def collate_comparisons(samples: Sequence[Dict], pad_id: int, seq_length: int, pad_to_multiple_of: int = 8):
    """``chosen``/``rejected`` [B, S] padded to one length, their ``*_length`` and a ``weight`` (0 for padding)."""
    length = padded_length(max(max(len(s["chosen"]), len(s["rejected"])) for s in samples), seq_length,
                           pad_to_multiple_of)
    return {
        "chosen": _pad([s["chosen"] for s in samples], pad_id, length),
        "rejected": _pad([s["rejected"] for s in samples], pad_id, length),
        "chosen_length": torch.tensor([len(s["chosen"]) for s in samples], dtype=torch.long),
        "rejected_length": torch.tensor([len(s["rejected"]) for s in samples], dtype=torch.long),
        "weight": torch.tensor([0.0 if s.get("padding") else 1.0 for s in samples]),
        "position_ids": torch.arange(length).unsqueeze(0).expand(len(samples), length).contiguous(),
    }


def collate_regression(samples: Sequence[Dict], pad_id: int, seq_length: int, pad_to_multiple_of: int = 8):
    """``tokens`` [B, S], ``lengths`` [B], ``labels`` [B, A] (padding rows all missing)."""
    length = padded_length(max(len(s["tokens"]) for s in samples), seq_length, pad_to_multiple_of)
    return {
        "tokens": _pad([s["tokens"] for s in samples], pad_id, length),
        "lengths": torch.tensor([len(s["tokens"]) for s in samples], dtype=torch.long),
        "labels": torch.tensor([s["label"] for s in samples], dtype=torch.float32),
        "position_ids": torch.arange(length).unsqueeze(0).expand(len(samples), length).contiguous(),
    }


CHUNK_ID = "CHUNK_ID"  # NeMo-Aligner's placeholder for the chunk index in a chunked_jsonl path


def chunk_paths(placeholder: str, n_chunks, split: str) -> list:
    """``placeholder`` with ``CHUNK_ID`` replaced by 0, 1, ... up to ``n_chunks`` (NeMo-Aligner's
    ``chunked_jsonl``): the chunks that exist, from the first on; none is an error."""
    if CHUNK_ID not in placeholder:
        raise ConfigError(f"model.data.data_impl=chunked_jsonl: model.data.data_prefix.{split} path {placeholder} "
                          f"has no {CHUNK_ID} (the chunk index's place, e.g. train_with_logits_{CHUNK_ID}.jsonl)")
    paths = []
    for i in range(int(n_chunks)):
        path = placeholder.replace(CHUNK_ID, str(i))
        if not os.path.exists(path):
            break
        paths.append(path)
    if not paths:
        raise DataError(f"{placeholder.replace(CHUNK_ID, '0')}: file does not exist (model.data.data_prefix.{split}, "
                        "chunk 0)")
    return paths


def data_prefix_paths(data_cfg, split: str, chunks: bool = False, packs: bool = False):
    """``model.data.data_prefix.<split>`` (a list, a path, or a dict of them); None if absent. With
    ``chunks`` (knowledge distillation), ``model.data.data_impl=chunked_jsonl`` expands each path's
    ``CHUNK_ID`` over ``model.data.n_chunks`` chunks; elsewhere chunked_jsonl is refused."""
    prefix = data_cfg.get("data_prefix")
    if prefix is None:
        raise ConfigError("model.data.data_prefix is required: {train: [...], validation: [...], test: [...]}")
    if isinstance(prefix, str) or not hasattr(prefix, "get"):
        raise ConfigError("model.data.data_prefix must be a dict {train: [...], validation: [...], test: [...]}")
    paths = prefix.get(split)
    if paths is None:
        return None
    paths = [paths] if isinstance(paths, str) else list(paths)
    if data_cfg.get("data_impl") == "chunked_jsonl":
        if not chunks:
            raise ConfigError("model.data.data_impl=chunked_jsonl is read by knowledge distillation only; use jsonl")
        n_chunks = data_cfg.get("n_chunks")
        if isinstance(n_chunks, (dict,)) or hasattr(n_chunks, "get"):
            n_chunks = n_chunks.get(split)
        if n_chunks is None or int(n_chunks) < 1:
            given = "null" if data_cfg.get("n_chunks") is None else data_cfg.get("n_chunks")
            raise ConfigError(f"model.data.n_chunks={given} must be >= 1 with model.data.data_impl=chunked_jsonl "
                              "(files with CHUNK_ID replaced by 0 .. n_chunks-1); one whole file per split: "
                              "model.data.data_impl=jsonl")
        return [c for p in paths for c in chunk_paths(str(p), n_chunks, split)]
    if data_cfg.get("data_impl") == "packed_jsonl":
        if not packs:
            raise ConfigError("model.data.data_impl=packed_jsonl is read by DPO only (its packed pairs); use jsonl")
        wrong = next((p for p in paths if not str(p).endswith(".npy")), None)
        if wrong is not None:
            raise ConfigError(f"model.data.data_prefix.{split}: {wrong} is not a .npy of packs; with "
                              "model.data.data_impl=packed_jsonl every split is packed "
                              "(examples/nlp/data/dpo/prepare_packed_dpo_dataset.py)")
    for p in paths:
        if not os.path.exists(str(p)):
            raise DataError(f"{p}: file does not exist (model.data.data_prefix.{split})")
    return paths
