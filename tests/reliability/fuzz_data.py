"""Data fuzzing: run the training and generation scripts on the built-in data with one hostile record
(a field set to null, a number, a list, a dict, empty or very long text, a field missing, a line cut
short, not JSON, not UTF-8, ...) in their training or validation file, and report every run that
ended in a traceback or a hang instead of a one-line refusal (naming file:line) or a finished run.

    python tests/reliability/fuzz_data.py                       # 150 runs, seed 0, every script
    python tests/reliability/fuzz_data.py --runs 40 --seed 3 --targets dpo kto

Outcomes, output and exit status as ``fuzz_config.py``; ``--json PATH`` also records each run's file,
line and mutation.
"""

from __future__ import annotations

import json
import os
import random
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from fuzz_config import Targets, arguments, finished, outcome, prepared, run, run_all  # noqa: E402

HOSTILE_VALUES = [None, 0, -1, 1.5, True, [], ["a"], {}, {"x": 1}, "", " ", "\u0000", "x" * 20000, "\ud800"]
LINE_MUTATIONS = ["cut", "not-json", "empty-object", "array", "bom", "latin1", "nan", "blank-lines", "duplicate-key"]


def field_paths(record, prefix=()) -> list:
    """Every key path of a record, nested ones (``conversations[1].value``) included."""
    out = []
    if isinstance(record, dict):
        for key, value in record.items():
            out.append(prefix + (key,))
            out += field_paths(value, prefix + (key,))
    elif isinstance(record, list):
        for i, value in enumerate(record):
            out += field_paths(value, prefix + (i,))
    return out


def mutate(line: str, rng: random.Random):
    """``(new line as bytes, description)``."""
    record = json.loads(line)
    paths = field_paths(record)
    if rng.random() < 0.35 or not paths:
        kind = rng.choice(LINE_MUTATIONS)
        text = {"cut": line[: max(1, len(line) // 2)], "not-json": "this is not json", "empty-object": "{}",
                "array": json.dumps([record]), "bom": "\ufeff" + line, "nan": line[:-1] + ', "extra": NaN}',
                "blank-lines": "\n\n" + line, "duplicate-key": line[:-1] + ', ' + line[1:],
                "latin1": None}[kind]
        data = line.replace('"', '"\xe9', 1).encode("latin-1", errors="replace") if kind == "latin1" else text.encode()
        return data, kind
    path = rng.choice(paths)
    parent = record
    for key in path[:-1]:
        parent = parent[key]
    if rng.random() < 0.2:
        del parent[path[-1]]
        return json.dumps(record).encode(), f"{'.'.join(map(str, path))} removed"
    value = rng.choice(HOSTILE_VALUES)
    parent[path[-1]] = value
    shown = repr(value) if not (isinstance(value, str) and len(value) > 20) else f"'x' * {len(value)}"
    return json.dumps(record).encode(), f"{'.'.join(map(str, path))}={shown}"  # a lone surrogate as its \u escape


def main(argv=None) -> int:
    args = arguments(__doc__, 150, list(Targets.DATA_FILES)).parse_args(argv)
    work, targets = prepared(args, "fuzz_data_")
    rng = random.Random(args.seed)
    cases = []
    for i in range(args.runs):
        target = rng.choice(args.targets)
        key = rng.choice(Targets.DATA_FILES[target])
        original = targets.data[key]
        with open(original, encoding="utf-8") as f:
            lines = f.read().splitlines()
        row = rng.randrange(len(lines))
        data, what = mutate(lines[row], rng)
        path = os.path.join(work, "mutated", str(i), os.path.basename(original))
        os.makedirs(os.path.dirname(path))
        with open(path, "wb") as f:
            f.write(b"\n".join([l.encode() for l in lines[:row]] + [data] + [l.encode() for l in lines[row + 1:]]) + b"\n")
        cases.append((i, target, key, row + 1, what, original, path))

    def one(case):
        i, target, key, line, what, original, path = case
        cmd = [a.replace(original, path) for a in targets.command(target, os.path.join(work, "runs", str(i)))]
        rc, out = run(cmd, work, args.timeout_s)
        return {"target": target, "file": key, "line": line, "mutation": what, **outcome(rc, out)}

    return finished(work, run_all(cases, one, args.workers, args.json,
                                  lambda r: f"{r['target']} {r['file']}:{r['line']} {r['mutation']}"), args.keep)

if __name__ == "__main__":
    sys.exit(main())
