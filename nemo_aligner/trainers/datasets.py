"""Turn what a Python-API user passes as ``dataset`` into jsonl records the engine reads.

Accepted: a jsonl path; a list of strings or dicts; a local Hugging Face ``datasets`` directory
(``save_to_disk``); or a DataModule-like object with ``train`` (or ``train_dataset``) and
optionally ``validation`` (or ``val_dataset``) holding any of the former.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, List, Optional, Tuple

from nemo_aligner.data.nlp.jsonl import read_jsonl
from nemo_aligner.utils.errors import ConfigError, DataError


@dataclass
class DataModule:
    """Training and (optional) validation data for ``fit``."""

    train: Any
    validation: Any = None


def _hf_disk_records(path: str) -> Tuple[List[dict], Optional[List[dict]]]:
    try:
        import datasets  # optional
    except ImportError:
        raise ConfigError(f"dataset={path!r} is a directory; reading it needs the `datasets` package "
                          "(pip install datasets), or pass a jsonl file") from None
    loaded = datasets.load_from_disk(path)
    if isinstance(loaded, datasets.DatasetDict):
        train = loaded.get("train")
        if train is None:
            raise ConfigError(f"dataset={path!r} has splits {list(loaded)} but no 'train'")
        val = loaded.get("validation") or loaded.get("test")
        return [dict(r) for r in train], ([dict(r) for r in val] if val is not None else None)
    return [dict(r) for r in loaded], None


def _records(source: Any, what: str) -> Tuple[List[Any], Optional[List[Any]]]:
    if isinstance(source, (str, os.PathLike)):
        path = os.fspath(source)
        if os.path.isfile(path):
            return [{k: v for k, v in r.items() if not k.startswith("__")} for r in read_jsonl(path)], None
        if os.path.isdir(path):
            return _hf_disk_records(path)
        raise ConfigError(f"{what}={path!r} is not a local file or directory; datasets are not downloaded at run "
                          "time (no Hub access): pass a local jsonl, a list, or a directory saved with "
                          "datasets.save_to_disk")
    if isinstance(source, (list, tuple)):
        if not source:
            raise DataError(f"{what} is empty")
        return list(source), None
    train = getattr(source, "train", None) or getattr(source, "train_dataset", None)
    if train is not None:
        val = getattr(source, "validation", None) or getattr(source, "val_dataset", None)
        return _records(train, f"{what}.train")[0], (_records(val, f"{what}.validation")[0] if val is not None else None)
    if hasattr(source, "__iter__") and hasattr(source, "column_names"):  # an in-memory datasets.Dataset
        return [dict(r) for r in source], None
    raise ConfigError(f"{what} must be a jsonl path, a list of strings or dicts, a datasets directory or a "
                      f"DataModule with .train/.validation; got {type(source).__name__}")


def resolve_dataset(dataset: Any, val_dataset: Any = None) -> Tuple[List[Any], Optional[List[Any]]]:
    """``(train records, validation records or None)``."""
    train, val = _records(dataset, "dataset")
    if val_dataset is not None:
        val = _records(val_dataset, "val_dataset")[0]
    return train, val


def _field(record: Any, names, where: str, what: str) -> Any:
    for name in names:
        if name in record:
            return record[name]
    raise DataError(f"{where}: needs a {what} field ({' or '.join(repr(n) for n in names)}); has {sorted(record)}")


def prompt_records(records: List[Any], what: str = "dataset") -> List[dict]:
    """GRPO prompts: strings, or dicts with ``prompt``/``text``/``input``/``question``."""
    out = []
    for i, r in enumerate(records):
        text = r if isinstance(r, str) else _field(_as_dict(r, what, i), ("prompt", "text", "input", "question"),
                                                   f"{what}[{i}]", "prompt")
        if not isinstance(text, str) or not text:
            raise DataError(f"{what}[{i}]: the prompt must be a non-empty string")
        out.append({"text": text})
    return out


def sft_records(records: List[Any], what: str = "dataset") -> Tuple[List[dict], bool]:
    """SFT examples as ``{"input", "output"}``; ``True`` when they are whole texts (no prompt)."""
    out, whole = [], None
    for i, r in enumerate(records):
        if isinstance(r, str):
            rec, is_whole = {"input": "", "output": r}, True
        else:
            d = _as_dict(r, what, i)
            if "input" in d and "output" in d:
                rec, is_whole = {"input": d["input"], "output": d["output"]}, False
            elif "prompt" in d and "completion" in d:
                rec, is_whole = {"input": d["prompt"], "output": d["completion"]}, False
            elif "text" in d:
                rec, is_whole = {"input": "", "output": d["text"]}, True
            else:
                raise DataError(f"{what}[{i}]: needs input/output, prompt/completion or text; has {sorted(d)}")
        if whole is not None and is_whole != whole:
            raise DataError(f"{what}[{i}]: mixes whole texts with prompt/answer pairs")
        whole = is_whole
        out.append(rec)
    return out, bool(whole)


def preference_records(records: List[Any], what: str = "dataset") -> List[dict]:
    """DPO pairs: ``prompt`` with ``chosen_response``/``rejected_response`` (or TRL's ``chosen``/``rejected``)."""
    out = []
    for i, r in enumerate(records):
        d = _as_dict(r, what, i)
        where = f"{what}[{i}]"
        out.append({"prompt": _field(d, ("prompt",), where, "prompt"),
                    "chosen_response": _field(d, ("chosen_response", "chosen"), where, "chosen response"),
                    "rejected_response": _field(d, ("rejected_response", "rejected"), where, "rejected response")})
    return out


def _as_dict(record: Any, what: str, i: int) -> dict:
    if not isinstance(record, dict):
        raise DataError(f"{what}[{i}] must be an object (dict), got {type(record).__name__}")
    return record
