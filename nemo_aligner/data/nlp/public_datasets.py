"""Public alignment datasets, from their published files (local copies) to the formats the training
scripts read: Dolly (SFT), Anthropic HH (reward-model comparisons, PPO prompts, DPO pairs, KTO),
HelpSteer / HelpSteer2 / OpenAssistant (SteerLM chat data) and chat data to regression reward-model
data. The scripts in ``examples/nlp/data/`` are thin command lines over these functions."""

from __future__ import annotations

import random
from typing import Callable, Dict, Iterable, List, Optional, Sequence, Tuple

from nemo_aligner.data.nlp.chat_template import turns_problem
from nemo_aligner.data.nlp.jsonl import require_fields
from nemo_aligner.data.nlp.steerlm_labels import NEMO_ATTRIBUTES, assistant_turn_texts
from nemo_aligner.utils.errors import DataError

OASST_ATTRIBUTES = ("quality", "toxicity", "humor", "creativity")
STEERLM_SYSTEM = ("A chat between a curious user and an artificial intelligence assistant. The assistant gives "
                  "helpful, detailed, and polite answers to the user's questions.")


def _where(record: Dict, path: str) -> str:
    return f"{record.get('__file__', path)}:{record.get('__line__', '?')}"


# ----------------------------------------------------------------------------------------- Dolly
def dolly_to_sft(records: Iterable[Dict], path: str, seed: int = 1234) -> List[Dict]:
    """databricks-dolly-15k lines (``instruction``, ``context``, ``response``, ``category``) to SFT
    ``{"input", "output", "category"}`` as NeMo's Dolly preparation writes them: a non-empty context
    goes before or after the instruction (a seeded coin), separated by a blank line."""
    rng = random.Random(seed)
    out = []
    for record in records:
        require_fields(record, ["instruction", "response"], path, types=(str,))
        context = str(record.get("context") or "").strip()
        instruction = record["instruction"]
        if context:
            if not instruction.strip():
                raise DataError(f"{_where(record, path)}: field 'instruction' is empty")
            instruction = instruction.strip()
            prompt = f"{context}\n\n{instruction}" if rng.randint(0, 1) == 0 else f"{instruction}\n\n{context}"
        else:
            prompt = instruction
        out.append({"input": prompt, "output": record["response"], "category": record.get("category")})
    return out


# ----------------------------------------------------------------------------------- Anthropic HH
def parse_hh_transcript(text: str, where: str) -> List[Tuple[str, str]]:
    """``"\\n\\nHuman: ...\\n\\nAssistant: ..."`` to ``[(role, text), ...]`` (roles Human/Assistant)."""
    turns: List[Tuple[str, str]] = []
    rest = text
    markers = {"\n\nHuman: ": "Human", "\n\nAssistant: ": "Assistant"}
    if not any(rest.startswith(m) for m in markers):
        raise DataError(f"{where}: a transcript must start with '\\n\\nHuman: ', got {text[:30]!r}")
    while rest:
        marker = next(m for m in markers if rest.startswith(m))
        body = rest[len(marker):]
        nxt = min((i for i in (body.find(m) for m in markers) if i >= 0), default=len(body))
        turns.append((markers[marker], body[:nxt]))
        rest = body[nxt:]
    return turns


def hh_pair(record: Dict, path: str) -> Optional[Tuple[List[Tuple[str, str]], str, str]]:
    """``(shared turns before the last answer, chosen answer, rejected answer)`` of an HH record, or
    None when the two transcripts do not share everything but their last Assistant turn."""
    require_fields(record, ["chosen", "rejected"], path, types=(str,))
    where = _where(record, path)
    chosen, rejected = parse_hh_transcript(record["chosen"], where), parse_hh_transcript(record["rejected"], where)
    if len(chosen) < 2 or chosen[-1][0] != "Assistant" or rejected[-1][0] != "Assistant":
        return None
    if chosen[:-1] != rejected[:-1]:
        return None
    return chosen[:-1], chosen[-1][1], rejected[-1][1]


def hh_prompt_text(turns: Sequence[Tuple[str, str]]) -> str:
    """NeMo's HH template: ``User: ...\\n\\nAssistant: ...``, ending with ``\\n\\nAssistant:``."""
    parts = [f"{'User' if role == 'Human' else 'Assistant'}: {text}" for role, text in turns]
    return "\n\n".join(parts) + "\n\nAssistant:"


def hh_to_rlhf(records: Iterable[Dict], path: str) -> Dict[str, List[Dict]]:
    """Anthropic HH rows to ``prompts`` (PPO: ``{"text"}``), ``comparisons`` (reward model: chosen and
    rejected ``{"text"}`` on consecutive lines), ``dpo`` (``{"prompt", "chosen_response",
    "rejected_response"}``) and ``kto`` (one line per response with ``preference``). Rows whose two
    transcripts differ before the last answer are skipped (counted in ``skipped``)."""
    out: Dict[str, List[Dict]] = {"prompts": [], "comparisons": [], "dpo": [], "kto": [], "skipped": []}
    for record in records:
        pair = hh_pair(record, path)
        if pair is None:
            out["skipped"].append(_where(record, path))
            continue
        turns, good, bad = pair
        prompt = hh_prompt_text(turns)
        out["prompts"].append({"text": prompt})
        out["comparisons"] += [{"text": f"{prompt} {good}"}, {"text": f"{prompt} {bad}"}]
        out["dpo"].append({"prompt": prompt + " ", "chosen_response": good, "rejected_response": bad})
        out["kto"] += [{"prompt": prompt + " ", "response": good, "preference": "chosen"},
                       {"prompt": prompt + " ", "response": bad, "preference": "rejected"}]
    return out


def hh_chat_messages(transcript: str) -> Optional[List[Dict]]:
    """An HH transcript as chat messages (``{"role": "User"|"Assistant", "content"}``), read as NeMo-Aligner's
    Constitutional AI preparation reads it: each human turn must have exactly one answer and neither
    may be empty, else None (the record is dropped)."""
    messages: List[Dict] = []
    for segment in (s.strip() for s in transcript.split("\n\nHuman: ")):
        if not segment:
            continue
        parts = segment.split("\n\nAssistant: ")
        if len(parts) != 2:
            return None
        body, response = parts
        for tail in ("\n\nHuman", "\n\nHuman:", "\n\nHuman: "):
            if response.endswith(tail):
                response = response[: -len(tail)]
                break
        body, response = body.strip(), response.strip()
        if not body or not response:
            return None
        messages += [{"role": "User", "content": body}, {"role": "Assistant", "content": response}]
    return messages or None


def hh_to_chat_comparisons(records: Iterable[Dict], path: str, format_messages: Callable[[List[Dict]], str],
                           eos: str = "") -> Tuple[List[Dict], int]:
    """Anthropic HH rows to ``{"prompt", "chosen", "rejected"}`` in a chat template: ``prompt`` is every
    turn before the last answer, formatted; ``chosen``/``rejected`` the whole conversation, formatted,
    plus ``eos``. Rows that do not parse or whose two prompts differ are dropped; returns the pairs and
    the count dropped."""
    pairs, dropped = [], 0
    for record in records:
        require_fields(record, ["chosen", "rejected"], path, types=(str,))
        chosen, rejected = hh_chat_messages(record["chosen"]), hh_chat_messages(record["rejected"])
        prompt = format_messages(chosen[:-1]) if chosen else ""
        if not chosen or not rejected or not prompt or prompt != format_messages(rejected[:-1]):
            dropped += 1
            continue
        pairs.append({"prompt": prompt, "chosen": format_messages(chosen) + eos,
                      "rejected": format_messages(rejected) + eos})
    return pairs, dropped


# ------------------------------------------------------------------------------- SteerLM sources
def _steerlm_record(prompt: str, response: str, label: Optional[str]) -> Dict:
    return {"conversations": [{"value": prompt, "from": "User", "label": None},
                              {"value": response, "from": "Assistant", "label": label}],
            "system": STEERLM_SYSTEM, "mask": "User", "type": "VALUE_TO_TEXT"}


def _label(record: Dict, names: Sequence[str], where: str) -> str:
    parts = []
    for name in names:
        if name in record and record[name] is not None:
            value = record[name]
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise DataError(f"{where}: field {name!r} must be a number, got {value!r}")
            parts.append(f"{name}:{value:g}" if isinstance(value, float) else f"{name}:{value}")
    return ",".join(parts)


def helpsteer_to_steerlm(records: Iterable[Dict], path: str, only_helpfulness: bool = False) -> List[Dict]:
    """HelpSteer / HelpSteer2 rows (``prompt``, ``response``, attribute scores 0-4) to SteerLM chat
    records labelled ``helpfulness:3,correctness:4,...`` (``only_helpfulness``: that one only)."""
    names = ("helpfulness",) if only_helpfulness else NEMO_ATTRIBUTES
    out = []
    for record in records:
        require_fields(record, ["prompt", "response"], path, types=(str,))
        out.append(_steerlm_record(record["prompt"], record["response"], _label(record, names, _where(record, path))))
    return out


def helpsteer2_preference_to_steerlm(records: Iterable[Dict], path: str) -> Tuple[List[Dict], List[Dict]]:
    """HelpSteer2's preference rows (``prompt``, ``response_1``, ``response_2``, ``preference_strength``,
    ``split``) to (train, validation) SteerLM records, each response labelled ``quality:<strength>``
    as NeMo-Aligner's ``--preference`` mode does."""
    train, val = [], []
    for record in records:
        require_fields(record, ["prompt", "response_1", "response_2"], path, types=(str,))
        strength = record.get("preference_strength")
        if isinstance(strength, bool) or not isinstance(strength, (int, float)):
            raise DataError(f"{_where(record, path)}: field 'preference_strength' must be a number")
        target = train if record.get("split", "train") == "train" else val
        for response in (record["response_1"], record["response_2"]):
            target.append(_steerlm_record(record["prompt"], response, f"quality:{strength:g}"))
    return train, val


def oasst_threads(tree: Dict, where: str) -> List[List[Dict]]:
    """Every root-to-leaf thread of an OpenAssistant message tree (``prompt`` with nested ``replies``)."""
    root = tree.get("prompt")
    if not isinstance(root, dict):
        raise DataError(f"{where}: field 'prompt' must be a message object")
    threads: List[List[Dict]] = []

    def walk(message: Dict, path: List[Dict]) -> None:
        if not isinstance(message, dict) or not isinstance(message.get("text"), str) or \
                message.get("role") not in ("prompter", "assistant"):
            raise DataError(f"{where}: a message needs 'text' and a role prompter/assistant")
        path = path + [message]
        replies = message.get("replies") or []
        if not replies:
            threads.append(path)
        for reply in replies:
            walk(reply, path)

    walk(root, [])
    return threads


def oasst_to_steerlm(trees: Iterable[Dict], path: str, val_fraction: float = 0.05,
                     seed: int = 10) -> Tuple[List[Dict], List[Dict]]:
    """OpenAssistant trees to (train, validation) SteerLM records: one conversation per thread of more
    than one turn; Assistant turns with ``labels`` labelled ``quality:..,toxicity:..,humor:..,
    creativity:..`` (values 0-1 scaled to 0-4); trees split at random (seeded) as NeMo-Aligner does."""
    trees = list(trees)
    random.Random(seed).shuffle(trees)
    n_val = len(trees) - int(len(trees) * (1 - val_fraction))  # NeMo-Aligner: the first 95% train
    out: Tuple[List[Dict], List[Dict]] = ([], [])
    for index, tree in enumerate(trees):
        where = _where(tree, path)
        for thread in oasst_threads(tree, where):
            if len(thread) <= 1:
                continue
            turns = []
            for message in thread:
                turn = {"value": message["text"], "from": "User" if message["role"] == "prompter" else "Assistant",
                        "label": None}
                labels = message.get("labels") or {}
                if turn["from"] == "Assistant" and labels:
                    turn["label"] = ",".join(f"{name}:{round(float(labels[name]['value']) * 4)}"
                                             for name in OASST_ATTRIBUTES if name in labels)
                turns.append(turn)
            record = {"conversations": turns, "system": STEERLM_SYSTEM, "mask": "User", "type": "VALUE_TO_TEXT"}
            out[0 if index < len(trees) - n_val else 1].append(record)
    return out


def chat_to_regression(records: Iterable[Dict], path: str, chat_tokens: Optional[dict] = None,
                       attributes: Sequence[str] = NEMO_ATTRIBUTES, missing: float = -100.0) -> List[Dict]:
    """SteerLM chat records to regression reward-model lines ``{"text", "label": [...]}``: one line per
    labelled Assistant turn, the conversation up to that turn rendered as the annotator scores it
    (``attribute_annotate.py``), the label a list in ``attributes`` order with ``missing`` where absent."""
    from nemo_aligner.data.nlp.steerlm_labels import parse_label

    out = []
    for record in records:
        require_fields(record, ["conversations"], path, types=(list,), non_empty=True)
        where = _where(record, path)
        problem = turns_problem(record["conversations"], where)
        if problem:
            raise DataError(problem)
        for turn_no, text in assistant_turn_texts(record, chat_tokens):
            label = record["conversations"][turn_no].get("label")
            if not label:
                continue
            values = parse_label(label, f"{where}: conversations[{turn_no}].label")
            unknown = sorted(set(values) - set(attributes))
            if unknown:
                raise DataError(f"{where}: conversations[{turn_no}].label has attributes {unknown} outside "
                                f"--attributes {','.join(attributes)}")
            out.append({"text": text, "label": [values.get(name, missing) for name in attributes]})
    return out


def clean(records: Iterable[Dict]) -> List[Dict]:
    """Records without the reader's ``__line__``/``__file__`` bookkeeping."""
    return [{k: v for k, v in r.items() if not k.startswith("__")} for r in records]


# ------------------------------------------------------------------------------- command lines
def split_file(directory: str, name: str) -> str:
    """``<directory>/<name>.jsonl`` or ``.jsonl.gz`` (the published files, or an export of them)."""
    import os

    for suffix in (".jsonl", ".jsonl.gz", ".json"):
        path = os.path.join(directory, name + suffix)
        if os.path.isfile(path):
            return path
    raise DataError(f"{directory}: no {name}.jsonl or {name}.jsonl.gz (the dataset's {name} split; nothing is "
                    "downloaded: save the published file there first)")


def hh_splits(input_dir: str):
    """``(split, its file, hh_to_rlhf's output)`` for Anthropic HH's train and test files in ``input_dir``."""
    from nemo_aligner.data.nlp.jsonl import read_jsonl

    for split in ("train", "test"):
        path = split_file(input_dir, split)
        yield split, path, hh_to_rlhf(read_jsonl(path), path)


def write(path: str, records: Iterable[Dict]) -> int:
    """Write ``records`` (atomically) and print where; returns their count."""
    from nemo_aligner.data.nlp.jsonl import write_jsonl

    records = clean(records)
    write_jsonl(path, records)
    print(f"{len(records)} records -> {path}")
    return len(records)
