"""Data preparation fuzzing: run the scripts of ``examples/nlp/data/`` and the Constitutional AI
preparation of Anthropic HH on small inputs in their published formats, with one hostile record (as
``fuzz_data.py`` makes them: a field null, a number, a list, a dict, empty, 20k characters, a lone
surrogate, or missing; a line cut short, not JSON, not UTF-8, ...), and report every run that ended in
a traceback or a hang instead of a one-line refusal or a finished run.

    python tests/reliability/fuzz_prep.py                       # 150 runs, seed 0, every script
    python tests/reliability/fuzz_prep.py --runs 40 --seed 3 --targets hh helpsteer2

Outcomes, output and exit status as ``fuzz_config.py``; ``--json PATH`` also records each run's file,
line and mutation.
"""

from __future__ import annotations

import json
import os
import random
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from fuzz_config import arguments, check_base, finished, outcome, run, run_all, tokenizer_directory  # noqa: E402
from fuzz_data import mutate  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DATA = os.path.join(REPO, "examples", "nlp", "data")
CAI = os.path.join(REPO, "examples", "nlp", "cai")

HH = [{"chosen": "\n\nHuman: Hi there\n\nAssistant: Hello!\n\nHuman: What is 2+2?\n\nAssistant: 4.",
       "rejected": "\n\nHuman: Hi there\n\nAssistant: Hello!\n\nHuman: What is 2+2?\n\nAssistant: 5."},
      {"chosen": "\n\nHuman: Name a colour.\n\nAssistant: Blue.",
       "rejected": "\n\nHuman: Name a colour.\n\nAssistant: I will not."}]
HELPSTEER = {"prompt": "Sort ba", "response": "ab", "helpfulness": 3, "correctness": 4, "coherence": 4,
             "complexity": 1, "verbosity": 0}
PREFERENCE = {"prompt": "p", "response_1": "a", "response_2": "b", "preference_strength": -2, "split": "train"}
CHAT = {"system": "S", "mask": "User", "type": "VALUE_TO_TEXT", "conversations": [
    {"from": "User", "value": "Sort ba", "label": None},
    {"from": "Assistant", "value": "ab", "label": "helpfulness:3,verbosity:0"}]}
DOLLY = {"instruction": "When did it start?", "context": "It started in 2000.", "response": "In 2000.",
         "category": "closed_qa"}

# target: (input files {path under the run directory: records}, the file fuzzed, script, arguments);
# "{w}" is the run directory, "{tok}" a Hugging Face tokenizer directory.
TARGETS = {
    "hh": ({"train.jsonl": HH, "test.jsonl": HH}, "train.jsonl", "anthropichh/process_anthropic_hh.py",
           ["--input-dir", "{w}", "--output-dir", "{w}/out"]),
    "kto": ({"train.jsonl": HH, "test.jsonl": HH}, "test.jsonl", "kto/preprocess_anthropichh_data.py",
            ["--input-dir", "{w}", "--output-dir", "{w}/out"]),
    "cai_hh": ({"helpful-base/train.jsonl": HH, "helpful-base/test.jsonl": HH}, "helpful-base/train.jsonl",
               os.path.join(CAI, "process_anthropic_hh_using_chat_prompt.py"),
               ["--input-dir", "{w}", "--output-dir", "{w}/out", "--dataset-dir-name", "helpful-base"]),
    "helpsteer": ({"train.jsonl": [HELPSTEER] * 2, "validation.jsonl": [HELPSTEER]}, "train.jsonl",
                  "steerlm/preprocess_helpsteer_data.py", ["--input-dir", "{w}", "-dir", "{w}/out"]),
    "helpsteer2": ({"train.jsonl": [HELPSTEER] * 2, "validation.jsonl": [HELPSTEER]}, "validation.jsonl",
                   "steerlm/preprocess_helpsteer2_data.py", ["--input-dir", "{w}", "-dir", "{w}/out"]),
    "helpsteer2_preference": ({"train.jsonl": [HELPSTEER], "validation.jsonl": [HELPSTEER],
                               "preference.jsonl": [PREFERENCE, dict(PREFERENCE, split="val")]}, "preference.jsonl",
                              "steerlm/preprocess_helpsteer2_data.py", ["--input-dir", "{w}", "-dir", "{w}/out", "-pref"]),
    "regression": ({"chat.jsonl": [CHAT] * 2}, "chat.jsonl", "steerlm/process_to_regression_format.py",
                   ["--input-file", "{w}/chat.jsonl", "--output-file", "{w}/regression.jsonl"]),
    "dolly": ({"dolly.jsonl": [DOLLY] * 2}, "dolly.jsonl", "sft/preprocess_dolly.py",
              ["--input", "{w}/dolly.jsonl", "--output", "{w}/sft.jsonl"]),
    "long_dialogues": ({"chat.jsonl": [CHAT] * 2}, "chat.jsonl", "sft/remove_long_dialogues.py",
                       ["--tokenizer_path", "{tok}", "--dataset_file", "{w}/chat.jsonl", "--output_file",
                        "{w}/kept.jsonl", "--seq_len", "64"]),
    "packed_sft": ({"sft.jsonl": [{"input": "Sort ba", "output": "ab"}] * 6}, "sft.jsonl",
                   "sft/prepare_packed_ft_dataset.py",
                   ["model.data.train_ds.file_names=[{w}/sft.jsonl]", "model.data.train_ds.max_seq_length=64",
                    "+output_dir={w}/out", "+pack_sizes=[64]"]),
    "packed_dpo": ({"dpo.jsonl": [{"prompt": "Sort ba", "chosen_response": "ab", "rejected_response": "ba"}] * 6},
                   "dpo.jsonl", "dpo/prepare_packed_dpo_dataset.py",
                   ["model.data.data_prefix={w}/dpo.jsonl", "model.encoder_seq_length=64", "+output_dir={w}/out",
                    "+pack_sizes=[64]"]),
}


def write_inputs(target: str, directory: str) -> None:
    for rel, records in TARGETS[target][0].items():
        path = os.path.join(directory, rel)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w", encoding="utf-8") as f:
            f.write("".join(json.dumps(r) + "\n" for r in records))


def command(target: str, directory: str, tokenizer: str) -> list:
    script = TARGETS[target][2]
    return [sys.executable, script if os.path.isabs(script) else os.path.join(DATA, script)] + \
        [a.format(w=directory, tok=tokenizer) for a in TARGETS[target][3]]


def main(argv=None) -> int:
    import tempfile

    args = arguments(__doc__, 150, list(TARGETS)).parse_args(argv)
    work = tempfile.mkdtemp(prefix="fuzz_prep_")
    tokenizer = tokenizer_directory(os.path.join(work, "tokenizer"))
    for target in args.targets:  # each script must pass on its unchanged inputs
        directory = os.path.join(work, "base", target)
        write_inputs(target, directory)
        check_base(target, command(target, directory, tokenizer), work, args.timeout_s)
    rng = random.Random(args.seed)
    cases = []
    for i in range(args.runs):
        target = rng.choice(args.targets)
        directory = os.path.join(work, "runs", str(i))
        write_inputs(target, directory)
        fuzzed = os.path.join(directory, TARGETS[target][1])
        with open(fuzzed, encoding="utf-8") as f:
            lines = f.read().splitlines()
        row = rng.randrange(len(lines))
        data, what = mutate(lines[row], rng)
        with open(fuzzed, "wb") as f:
            f.write(b"\n".join([l.encode() for l in lines[:row]] + [data] + [l.encode() for l in lines[row + 1:]]) + b"\n")
        cases.append((i, target, f"{TARGETS[target][1]}:{row + 1}", what, directory))

    def one(case):
        i, target, where, what, directory = case
        rc, out = run(command(target, directory, tokenizer), work, args.timeout_s)
        return {"target": target, "line": where, "mutation": what, **outcome(rc, out)}

    return finished(work, run_all(cases, one, args.workers, args.json,
                                  lambda r: f"{r['target']} {r['line']} {r['mutation']}"), args.keep)


if __name__ == "__main__":
    sys.exit(main())
