"""Read jsonl files with errors that name the file, the line and the field."""

from __future__ import annotations

import gzip
import json
import os
from typing import Any, Dict, Iterable, List, Optional, Sequence

from nemo_aligner.utils.errors import DataError


class _NonFinite(float):
    """What ``NaN``/``Infinity``/``-Infinity`` parse to, so the record can be searched for it:
    Python's json accepts them, JSON itself has no such numbers, and one in a label or reward
    would turn every loss it enters into NaN."""


def _first_field(value: Any, bad, where: str = "") -> Optional[str]:
    """The field path (``label[0]``, ``conversations[1].value``) of the first leaf value for which
    ``bad(value)`` holds, walking dicts and lists in order."""
    if isinstance(value, dict):
        items = ((f"{where}.{k}" if where else str(k)) for k in value), value.values()
    elif isinstance(value, list):
        items = (f"{where}[{i}]" for i in range(len(value))), value
    else:
        return (where or "(the record)") if bad(value) else None
    for path, item in zip(*items):
        found = _first_field(item, bad, path)
        if found is not None:
            return found
    return None


def _non_finite_field(record: Any) -> Optional[str]:
    """The first non-finite number (NaN/Infinity parsed as ``_NonFinite``)."""
    return _first_field(record, lambda v: isinstance(v, _NonFinite))


def _not_unicode(value: Any) -> bool:
    """A string that is not valid Unicode: a lone surrogate such as ``"\\ud800"``, valid JSON that no
    tokenizer can encode."""
    if not isinstance(value, str):
        return False
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


def _unencodable_field(record: Any) -> Optional[str]:
    return _first_field(record, _not_unicode)


def read_jsonl(path: str, allow_non_finite: bool = False) -> List[Dict[str, Any]]:
    """All records of a jsonl file; blank lines are skipped.

    Each record gets ``__line__`` (1-based) so later checks can point at it. ``NaN``/``Infinity``
    (which Python's json writes and JSON has not) are an error unless ``allow_non_finite`` (our own
    ``metrics.jsonl``: a skipped step's loss is NaN).
    """
    if not path:
        raise DataError("no data file given (empty path)")
    _check_file(path)
    records = []
    opener = gzip.open if path.endswith(".gz") else open  # .jsonl.gz, as public datasets ship
    try:
        with opener(path, "rb") as f:
            for line_no, raw in enumerate(f, start=1):
                try:
                    line = raw.decode("utf-8")
                except UnicodeDecodeError as err:
                    raise DataError(f"{path}:{line_no}: not UTF-8 text (byte 0x{raw[err.start]:02x} at column "
                                    f"{err.start + 1}); re-encode the file as UTF-8") from None
                if line_no == 1 and line.startswith("\ufeff"):  # a byte-order mark, as some editors write
                    line = line[1:]
                if not line.strip():
                    continue
                try:
                    record = json.loads(line, parse_constant=_NonFinite)
                except json.JSONDecodeError as err:
                    raise DataError(f"{path}:{line_no}: malformed JSON ({err.msg} at column {err.colno})") from None
                if not isinstance(record, dict):
                    raise DataError(f"{path}:{line_no}: expected a JSON object, got {type(record).__name__}")
                field = None if allow_non_finite else _non_finite_field(record)
                if field is not None:
                    raise DataError(f"{path}:{line_no}: field {field!r} is not a finite number "
                                    f"(JSON has no NaN or Infinity)")
                field = _unencodable_field(record)
                if field is not None:
                    raise DataError(f"{path}:{line_no}: field {field!r} is not valid Unicode text (a lone "
                                    f"surrogate escape such as \\ud800)")
                record["__line__"] = line_no
                records.append(record)
    except (OSError, EOFError) as err:  # unreadable, or a truncated or corrupt .gz
        what = "not a readable gzip file" if path.endswith(".gz") else "cannot be read"
        raise DataError(f"{path}: {what} ({err})") from None
    if not records:
        raise DataError(f"{path}: file is empty (no JSON records)")
    return records


def _check_file(path: str) -> None:
    if not os.path.exists(path):
        raise DataError(f"{path}: file does not exist")
    if os.path.isdir(path):
        raise DataError(f"{path}: is a directory, expected a .jsonl file")


def check_files_exist(paths) -> None:
    """Refuse (as :func:`read_jsonl` does) a named data file that is missing or a directory: called
    before a model is built, so a wrong path stops a run at once (on every rank alike)."""
    if paths is None or paths == "???" or (isinstance(paths, str) and not paths):
        return  # the builders name the missing key
    for path in [paths] if isinstance(paths, str) else paths:
        if str(path):
            _check_file(str(path))


def read_jsonl_files(paths, key: str) -> List[Dict[str, Any]]:
    """Records of one or more jsonl files (a path or a list); each keeps ``__file__`` and ``__line__``.

    ``key`` is the config key that named the files, for the error when none are given.
    """
    from nemo_aligner.utils.errors import ConfigError

    if paths is None or paths == "???" or (isinstance(paths, str) and not paths):
        raise ConfigError(f"{key} is required")
    if isinstance(paths, str):
        paths = [paths]
    records = []
    for path in paths:
        for record in read_jsonl(str(path)):
            record["__file__"] = str(path)
            records.append(record)
    return records


def require_fields(record: Dict[str, Any], fields: Sequence[str], path: str, types=(str,),
                   non_empty: bool = False) -> None:
    """Raise if a required field is missing or has the wrong type (or, with ``non_empty``, is empty)."""
    path = record.get("__file__", path)
    for field in fields:
        if field not in record:
            present = sorted(k for k in record if not k.startswith("__"))
            raise DataError(f"{path}:{record.get('__line__', '?')}: missing field {field!r} (found {present})")
        if types and not isinstance(record[field], types):
            raise DataError(
                f"{path}:{record.get('__line__', '?')}: field {field!r} must be "
                f"{' or '.join(t.__name__ for t in types)}, got {type(record[field]).__name__}"
            )
        if non_empty and isinstance(record[field], (str, list)) and not record[field]:
            raise DataError(f"{path}:{record.get('__line__', '?')}: field {field!r} is empty")


def write_jsonl(path: str, records: Iterable[Dict[str, Any]]) -> None:
    """Write records atomically (temp file, then rename)."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        for record in records:
            f.write(json.dumps(record, ensure_ascii=False) + "\n")
    os.replace(tmp, path)
