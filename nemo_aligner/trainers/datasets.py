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
from nemo_aligner.data.nlp.prompt_dataset import record_metadata
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
            records = read_jsonl(path)
            for record in records:  # kept so errors name the user's file and line, not the copy fit writes
                record["__file__"] = path
            return records, None
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


def _where(record: Any, what: str, i: int) -> str:
    """``file:line`` for a record read from the user's jsonl, ``dataset[i]`` otherwise."""
    if isinstance(record, dict) and "__file__" in record:
        return f"{record['__file__']}:{record.get('__line__', '?')}"
    return f"{what}[{i}]"


def _fields(record: dict) -> List[str]:
    return sorted(k for k in record if not str(k).startswith("__"))


def _named_field(record: dict, names, where: str, what: str) -> Tuple[str, Any]:
    """``(name, value)`` of the first of ``names`` the record has."""
    for name in names:
        if name in record:
            return name, record[name]
    raise DataError(f"{where}: needs a {what} field ({' or '.join(repr(n) for n in names)}); has {_fields(record)}")


def _field(record: dict, names, where: str, what: str) -> Any:
    return _named_field(record, names, where, what)[1]


def _text(value: Any, where: str, name: str, allow_empty: bool = False) -> str:
    if not isinstance(value, str):
        raise DataError(f"{where}: field {name!r} must be a string, got {type(value).__name__}")
    if not value and not allow_empty:
        raise DataError(f"{where}: field {name!r} is empty")
    return value


def prompt_records(records: List[Any], what: str = "dataset") -> List[dict]:
    """GRPO prompts: strings, or dicts with ``prompt``/``text``/``input``/``question`` (their other fields
    travel as metadata to the reward function or environment)."""
    out = []
    for i, r in enumerate(records):
        if isinstance(r, str):
            name, text = "prompt", r
        else:
            where = _where(r, what, i)
            name, text = _named_field(_as_dict(r, what, i), ("prompt", "text", "input", "question"), where, "prompt")
        if not isinstance(text, str) or not text:
            raise DataError(f"{_where(r, what, i)}: the prompt ({name!r}) must be a non-empty string")
        # the prompt file's rule (record_metadata), then wrapped: PromptDataset unwraps a lone "metadata"
        extra = {} if isinstance(r, str) else record_metadata(r, name)
        out.append({"text": text, "metadata": extra} if extra else {"text": text})  # for reward_fn / environment
    return out


def sft_records(records: List[Any], what: str = "dataset") -> Tuple[List[dict], bool]:
    """SFT examples as ``{"input", "output"}``; ``True`` when they are whole texts (no prompt)."""
    out, whole = [], None
    for i, r in enumerate(records):
        if isinstance(r, str):
            rec, is_whole = {"input": "", "output": r}, True
        else:
            d, where = _as_dict(r, what, i), _where(r, what, i)
            for prompt, answer in (("input", "output"), ("prompt", "completion"), (None, "text")):
                if answer in d and (prompt is None or prompt in d):
                    break
            else:
                raise DataError(f"{where}: needs input/output, prompt/completion or text; has {_fields(d)}")
            rec = {"input": _text(d[prompt], where, prompt, allow_empty=True) if prompt else "",
                   "output": _text(d[answer], where, answer)}
            is_whole = prompt is None
        if whole is not None and is_whole != whole:
            raise DataError(f"{_where(r, what, i)}: mixes whole texts with prompt/answer pairs")
        whole = is_whole
        out.append(rec)
    return out, bool(whole)


def preference_records(records: List[Any], what: str = "dataset") -> List[dict]:
    """DPO pairs: ``prompt`` with ``chosen_response``/``rejected_response`` (or TRL's ``chosen``/``rejected``)."""
    from nemo_aligner.data.nlp.dpo_dataset import prompt_text

    out = []
    for i, r in enumerate(records):
        d = _as_dict(r, what, i)
        where = _where(r, what, i)
        prompt = _field(d, ("prompt",), where, "prompt")
        if not isinstance(prompt, (str, list)):
            raise DataError(f"{where}: field 'prompt' must be a string or a list of chat messages, got "
                            f"{type(prompt).__name__}")
        prompt_text({"prompt": prompt}, where)  # chat messages checked here, naming the user's record
        out.append({"prompt": prompt,
                    "chosen_response": _response(d, ("chosen_response", "chosen"), where, "chosen response"),
                    "rejected_response": _response(d, ("rejected_response", "rejected"), where, "rejected response")})
    return out


def _response(record: dict, names, where: str, what: str) -> str:
    """A response string; TRL's conversational form (a list holding one assistant message) is
    taken as that message's content."""
    name, value = _named_field(record, names, where, what)
    if isinstance(value, list):
        if len(value) != 1 or not isinstance(value[0], dict) or value[0].get("role") != "assistant":
            raise DataError(f"{where}: field {name!r} as a list must hold one assistant message "
                            "({'role': 'assistant', 'content': ...})")
        name, value = f"{name}[0].content", value[0].get("content")
    return _text(value, where, name)


def _as_dict(record: Any, what: str, i: int) -> dict:
    if not isinstance(record, dict):
        raise DataError(f"{what}[{i}] must be an object (dict), got {type(record).__name__}")
    return record
