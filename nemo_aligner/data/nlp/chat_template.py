"""NeMo's SFT chat format: the conversation string and its loss mask, as NeMo's ``GPTSFTChatDataset``
builds them (``gpt_sft_chat_dataset.py``: ``_add_speaker_and_signal``, ``preprocess``, ``_mask_targets``).

A record ``{"system", "conversations": [{"from", "value", "label"?}], "mask"?, "type"?}`` becomes

    <system_turn_start>System<end_of_name>{system}<end_of_turn>
    <turn_start>{from}<end_of_name>{value}<end_of_turn>          (per turn; labels only with "type")
    <turn_start>                                                  (when the last turn is not masked)

tokenized as one string, with no BOS and no EOS. Trained tokens: each turn from a role not in
``mask`` minus its ``<turn_start>{from}<end_of_name>`` (and the label, for ``VALUE_TO_TEXT``); the
``<turn_start>`` opening every masked turn after the second, which ends the answer before it; the
trailing ``<turn_start>``. Turn 0 is never trained. ``TEXT_TO_VALUE`` trains the label after the value.
"""

from __future__ import annotations

from typing import Dict, List, Mapping, Optional, Sequence, Tuple

DEFAULT_CHAT_TOKENS = {
    "system_turn_start": "\x00",
    "turn_start": "\x11",
    "label_start": "\x12",
    "end_of_turn": "\x0a",
    "end_of_name": "\x0a",
}
# NeMo tokenizes a turn after this string and drops its ids, so that a tokenizer's leading-space
# token (SentencePiece's dummy prefix) is not counted in the turn.
PREFIX_STR = "\x00"
SYSTEM_TOKEN = "System"
CHAT_TYPES = ("VALUE_TO_TEXT", "TEXT_TO_VALUE")


def chat_tokens(overrides: Optional[Mapping] = None) -> Dict[str, str]:
    """NeMo's chat strings with ``overrides`` (``model.data.chat_prompt_tokens``) applied."""
    return dict(DEFAULT_CHAT_TOKENS, **{k: str(v) for k, v in (overrides or {}).items()})


def mask_roles(record: Mapping) -> str:
    """The record's ``mask`` (comma-separated roles; default ``User``). NeMo tests a speaker with
    ``speaker in mask``, a substring test, and so does this module."""
    mask = record.get("mask", "User")
    return "User" if mask is None else mask


def label_text(label, t: Mapping[str, str]) -> str:
    return "" if label is None else f"{t['label_start']}{label}{t['end_of_name']}"


def render_turn(turn: Mapping, chat_type: Optional[str], t: Mapping[str, str]) -> str:
    """One turn's text, as ``_add_speaker_and_signal`` writes it."""
    head = f"{t['turn_start']}{turn['from']}{t['end_of_name']}"
    if chat_type is None:
        return head + turn["value"] + t["end_of_turn"]
    if chat_type == "VALUE_TO_TEXT":
        return head + label_text(turn.get("label"), t) + turn["value"] + t["end_of_turn"]
    return head + turn["value"] + t["end_of_turn"] + label_text(turn.get("label"), t)


def render_header(system: str, t: Mapping[str, str]) -> str:
    return f"{t['system_turn_start']}{SYSTEM_TOKEN}{t['end_of_name']}{system}{t['end_of_turn']}"


def render_conversation(record: Mapping, t: Mapping[str, str]) -> Tuple[str, List[str], str]:
    """``(header, turn texts, whole conversation)`` of a record."""
    chat_type = record.get("type")
    header = render_header(record.get("system") or "", t)
    turns = [render_turn(turn, chat_type, t) for turn in record["conversations"]]
    text = header + "".join(turns)
    if turns and record["conversations"][-1]["from"] not in mask_roles(record):
        text += t["turn_start"]  # trained: the model learns to end its answer here
    return header, turns, text


def _tail_ids(tokenizer, text: str) -> List[int]:
    """``text``'s ids when it follows other text (NeMo's PREFIX_STR trick)."""
    prefix = tokenizer.text_to_ids(PREFIX_STR)
    return tokenizer.text_to_ids(PREFIX_STR + text)[len(prefix):]


def _find(sub: Sequence[int], seq: Sequence[int]) -> int:
    n = len(sub)
    for i in range(len(seq) - n + 1):
        if list(seq[i:i + n]) == list(sub):
            return i
    return -1


def chat_ids_and_mask(record: Mapping, tokenizer, t: Mapping[str, str]) -> Tuple[List[int], List[int]]:
    """The conversation's token ids and their loss mask (1: trained), by NeMo's rules.

    The record must already be valid (``validate_chat_record``)."""
    header, turns, text = render_conversation(record, t)
    ids = tokenizer.text_to_ids(text)
    header_len = len(tokenizer.text_to_ids(header))
    mask = [1] * len(ids)
    mask[:header_len] = [0] * min(header_len, len(ids))
    chat_type = record.get("type")
    roles = mask_roles(record)
    label_start = _tail_ids(tokenizer, t["label_start"])
    name_end = _tail_ids(tokenizer, t["end_of_name"])
    turn_start_len = len(_tail_ids(tokenizer, t["turn_start"]))

    def zero(start: int, stop: int) -> None:
        for k in range(max(start, 0), min(stop, len(ids))):
            mask[k] = 0

    cur = header_len
    for i, (turn, turn_text) in enumerate(zip(record["conversations"], turns)):
        s_id = _tail_ids(tokenizer, turn_text)
        n = len(s_id)
        speaker = turn["from"]
        skip = len(_tail_ids(tokenizer, t["turn_start"] + speaker + t["end_of_name"]))
        location = _find(label_start, s_id) if label_start else -1
        if location >= 0:
            if chat_type == "VALUE_TO_TEXT":
                newline = _find(name_end, s_id[skip:]) if name_end else -1
                if newline < 0:  # a turn holding only part of a label: nothing trained (NeMo's `continue`)
                    zero(cur, cur + n)
                    continue
                skip += newline + len(name_end)
            elif chat_type == "TEXT_TO_VALUE":
                skip = location + len(label_start)
        if cur >= len(ids):
            break
        if i == 0 and chat_type in (None, "VALUE_TO_TEXT"):
            zero(cur, cur + n)  # the first turn is context, whoever speaks it
        elif speaker in roles and i == 1 and chat_type == "TEXT_TO_VALUE":
            zero(cur + turn_start_len, cur + n)
        elif speaker in roles and i > 1:
            zero(cur + turn_start_len, cur + n)  # its turn start stays trained: it ends the answer before it
        elif speaker in roles:
            zero(cur, cur + n)
        else:
            zero(cur, cur + skip)
        cur += n
    return ids, mask


def turns_problem(conversations: list, where: str) -> Optional[str]:
    """The first turn of ``conversations`` that is not ``{"from": str, "value": str, "label": str or null}``,
    as a message naming ``where`` (file:line), or None."""
    for turn_no, turn in enumerate(conversations):
        if not isinstance(turn, dict) or "from" not in turn or "value" not in turn:
            return f"{where}: conversations[{turn_no}] must be an object with 'from' and 'value'"
        for field in ("from", "value", "label"):
            value = turn.get(field)
            if (value is not None or field != "label") and not isinstance(value, str):
                return f"{where}: conversations[{turn_no}].{field} must be str, got {type(value).__name__}"
    return None


def validate_chat_record(record: Mapping, where: str) -> Optional[str]:
    """The first problem of a chat record as a message naming ``where`` (file:line), or None."""
    conversations = record.get("conversations")
    if not isinstance(conversations, list) or not conversations:
        return f"{where}: field 'conversations' must be a non-empty list of turns"
    for field in ("system", "mask"):
        if record.get(field) is not None and not isinstance(record[field], str):
            return f"{where}: field {field!r} must be str, got {type(record[field]).__name__}"
    chat_type = record.get("type")
    if chat_type is not None and chat_type not in CHAT_TYPES:
        return f"{where}: field 'type' must be VALUE_TO_TEXT or TEXT_TO_VALUE (or absent), got {chat_type!r}"
    problem = turns_problem(conversations, where)
    if problem:
        return problem
    speakers = [turn["from"] for turn in conversations]
    for role in mask_roles(record).split(","):
        if role not in speakers:
            return (f"{where}: the masked role {role!r} (field 'mask', default 'User') speaks no turn; NeMo's chat "
                    f"format needs it (speakers: {sorted(set(speakers))})")
    return None
