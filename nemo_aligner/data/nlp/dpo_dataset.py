"""Preference pairs for DPO-style training: ``{"prompt", "chosen_response", "rejected_response"}``.

The prompt may be a string or a list of chat messages (``{"role"|"from", "content"|"value"}``),
rendered with the SFT chat template; the responses strings, or (NeMo-Aligner's chat format) assistant
messages ``{"role": "assistant", "content": ...}`` rendered with their turn header and the next turn's
start; ``chosen_reward``/``rejected_reward`` are optional (RPO).
Each response gets EOS (``model.data.append_eod``, True here); the loss mask covers the response tokens only.
"""

from __future__ import annotations

import logging
import math
from typing import Dict, List, Optional, Sequence

import torch

from nemo_aligner.data.nlp.jsonl import require_fields
from nemo_aligner.data.nlp.length_report import report_truncated
from nemo_aligner.data.nlp.reward_datasets import read_files, warn_identical_pairs
from nemo_aligner.data.nlp.chat_template import DEFAULT_CHAT_TOKENS, render_turn
from nemo_aligner.data.nlp.chat_template import chat_tokens as resolve_chat_tokens
from nemo_aligner.utils.errors import DataError

logger = logging.getLogger(__name__)

_ROLE_NAMES = {"system": "System", "user": "User", "assistant": "Assistant"}


def render_chat_prompt(messages: list, where: str, chat_tokens: Optional[dict] = None,
                       assistant_header: bool = True) -> str:
    """A chat prompt in the SFT chat template, ending with the Assistant header the response follows
    (without it for NeMo-Aligner's chat format, whose responses carry the header)."""
    t = dict(DEFAULT_CHAT_TOKENS, **(chat_tokens or {}))
    system, turns = "", []
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise DataError(f"{where}: prompt[{i}] must be an object with a role and content")
        role = message.get("role", message.get("from"))
        content = message.get("content", message.get("value"))
        if role is None or content is None:
            raise DataError(f"{where}: prompt[{i}] needs 'role' (or 'from') and 'content' (or 'value')")
        for field, value in (("role" if "role" in message else "from", role),
                             ("content" if "content" in message else "value", content)):
            if not isinstance(value, str):
                raise DataError(f"{where}: prompt[{i}].{field} must be str, got {type(value).__name__}")
        role = role.strip()
        if not role:
            raise DataError(f"{where}: prompt[{i}] has an empty role")
        name = _ROLE_NAMES.get(role.lower(), role)
        if name == "System":
            system = content
        else:
            turns.append(f"{t['turn_start']}{name}{t['end_of_name']}{content}{t['end_of_turn']}")
    return (f"{t['system_turn_start']}System{t['end_of_name']}{system}{t['end_of_turn']}" + "".join(turns)
            + (f"{t['turn_start']}Assistant{t['end_of_name']}" if assistant_header else ""))


def chat_response(value, where: str, field: str) -> Optional[str]:
    """The content of NeMo-Aligner's chat-format response (``{"role": "assistant", "content": ...}``, or a
    one-element list of it); None when ``value`` is a plain string."""
    if isinstance(value, str):
        return None
    if isinstance(value, list) and len(value) == 1:
        value = value[0]
    if not isinstance(value, dict) or not isinstance(value.get("content"), str) or \
            str(value.get("role", "assistant")).lower() != "assistant":
        raise DataError(f"{where}: field {field!r} must be a string or an assistant message "
                        "{\"role\": \"assistant\", \"content\": ...}")
    return value["content"]


def chat_response_text(content: str, chat_tokens: Optional[dict] = None) -> str:
    """A response turn as NeMo-Aligner's chat DPO renders it: the Assistant header, the content, the end
    of turn and the next turn's start (``\x11Assistant\n{content}\n\x11``), all scored."""
    t = resolve_chat_tokens(chat_tokens)
    return render_turn({"from": "Assistant", "value": content}, "VALUE_TO_TEXT", t) + t["turn_start"]


def prompt_text(record: dict, where: str, chat_tokens: Optional[dict] = None) -> str:
    """The record's ``prompt``: a string as is, a list of chat messages rendered with the template."""
    prompt = record["prompt"]
    return render_chat_prompt(prompt, where, chat_tokens) if isinstance(prompt, list) else prompt


def encode_prompt_response(tokenizer, prompt_ids: List[int], response: str, seq_length: int, add_eos: bool = True):
    """``(prompt + response [+ EOS] ids, prompt length)`` within ``seq_length + 1`` tokens: the response
    keeps its start, the prompt is cut from the left."""
    ids, prompt_length, _ = encode_and_count_cut(tokenizer, prompt_ids, response, seq_length, add_eos)
    return ids, prompt_length


def encode_and_count_cut(tokenizer, prompt_ids: List[int], response: str, seq_length: int, add_eos: bool = True):
    """:func:`encode_prompt_response` and the number of tokens cut to fit."""
    response_ids = tokenizer.text_to_ids(response) + ([tokenizer.eos_id] if add_eos else [])
    budget = seq_length + 1
    full = len(prompt_ids) + len(response_ids)
    response_ids = response_ids[:budget - 1] if len(response_ids) >= budget else response_ids
    prompt_ids = prompt_ids[len(prompt_ids) - min(len(prompt_ids), budget - len(response_ids)):]
    return prompt_ids + response_ids, len(prompt_ids), full - len(prompt_ids) - len(response_ids)


class TruncationWarning:
    """Logs the first over-long sample of a dataset (file and line) and how much was cut; the rest
    of that dataset's truncations are not reported."""

    def __init__(self, seq_length: int, how: str):
        self.seq_length, self.how, self.warned = seq_length, how, False

    def __call__(self, where: str, cut: int) -> None:
        if cut > 0 and not self.warned:
            self.warned = True
            logger.warning("%s: %d tokens longer than the sequence length %d; %s; further truncations in this "
                           "dataset are not reported", where, cut, self.seq_length, self.how)


def response_mask(lengths_and_prompts, width: int) -> torch.Tensor:
    """``[B, width - 1]`` mask of the log-prob positions that predict response tokens."""
    mask = torch.zeros((len(lengths_and_prompts), width - 1), dtype=torch.float32)
    for b, (length, prompt_length) in enumerate(lengths_and_prompts):
        # log-prob position i predicts token i + 1: response tokens start at the prompt length.
        # Without a prompt nothing predicts the first response token: the loss starts at the second.
        mask[b, max(prompt_length - 1, 0) : length - 1] = 1.0
    return mask


def padded_length(longest: int, seq_length: int, multiple: int) -> int:
    """``longest`` rounded up to ``multiple`` without exceeding ``seq_length + 1`` (unless longer)."""
    multiple = max(int(multiple or 1), 1)
    return max(min(-(-longest // multiple) * multiple, seq_length + 1), longest)


def pad_rows(rows: Sequence[List[int]], width: int, pad_id: int) -> torch.Tensor:
    """``[B, width]`` long tensor of the rows, right-padded with ``pad_id``."""
    tokens = torch.full((len(rows), width), pad_id, dtype=torch.long)
    for b, ids in enumerate(rows):
        tokens[b, : len(ids)] = torch.tensor(ids, dtype=torch.long)
    return tokens


class DPOPairDataset(torch.utils.data.Dataset):
    """Tokenized (prompt, chosen, rejected) triples; prompts are truncated from the left to fit."""

    def __init__(self, paths, tokenizer, seq_length: int, key: str = "model.data.data_prefix.train", records=None,
                 default_chosen_reward: float = 1.0, default_rejected_reward: float = 0.0, chat_tokens=None,
                 add_eos: bool = True):
        self.tokenizer = tokenizer
        self.add_eos = add_eos  # model.data.append_eod
        self.seq_length = int(seq_length)
        records = records if records is not None else read_files(paths, key)
        self.items = []
        identical = []
        for record in records:
            path = record.get("__file__", str(paths))
            where = f"{path}:{record['__line__']}"
            require_fields(record, ["prompt"], path, types=(str, list))
            require_fields(record, ["chosen_response", "rejected_response"], path, types=(str, dict, list),
                           non_empty=True)
            contents = [chat_response(record[f], where, f) for f in ("chosen_response", "rejected_response")]
            if (contents[0] is None) != (contents[1] is None):
                raise DataError(f"{where}: chosen_response and rejected_response must both be strings or both "
                                "assistant messages")
            if contents[0] is not None:  # NeMo-Aligner's chat format: list prompt, message responses
                if not isinstance(record["prompt"], list):
                    raise DataError(f"{where}: assistant-message responses need a list of messages as prompt")
                prompt = render_chat_prompt(record["prompt"], where, chat_tokens, assistant_header=False)
                chosen, rejected = (chat_response_text(c, chat_tokens) for c in contents)
            else:
                prompt = prompt_text(record, where, chat_tokens)
                chosen, rejected = record["chosen_response"], record["rejected_response"]
            rewards = []
            for field, default in (("chosen_reward", default_chosen_reward), ("rejected_reward", default_rejected_reward)):
                value = record.get(field, default)
                if not isinstance(value, (int, float)) or isinstance(value, bool):
                    raise DataError(f"{where}: field {field!r} must be a number, got {type(value).__name__}")
                if not math.isfinite(value):
                    raise DataError(f"{where}: field {field!r} must be a finite number, got {value}")
                rewards.append(float(value))
            if chosen == rejected:
                identical.append(where)
            self.items.append((prompt, chosen, rejected, rewards, where))
        warn_identical_pairs(identical)
        how = "the prompt is cut from the left, then the response from the right"
        self._warn_truncated = TruncationWarning(self.seq_length, how)
        self._warn_truncated.warned = bool(report_truncated(
            str(paths), ((where, self._cut(prompt, chosen, rejected)) for prompt, chosen, rejected, _, where
                         in self.items), self.seq_length, how))

    def _cut(self, prompt: str, chosen: str, rejected: str) -> int:
        prompt_ids = self.tokenizer.text_to_ids(prompt)
        return max(encode_and_count_cut(self.tokenizer, prompt_ids, chosen, self.seq_length, self.add_eos)[2],
                   encode_and_count_cut(self.tokenizer, prompt_ids, rejected, self.seq_length, self.add_eos)[2])

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, idx: int) -> Dict:
        if idx < 0:  # padding of a partial validation batch
            eos = self.tokenizer.eos_id
            return {"chosen": [eos, eos], "rejected": [eos, eos], "chosen_prompt": 2, "rejected_prompt": 2,
                    "rewards": [0.0, 0.0], "padding": True}
        prompt, chosen, rejected, rewards, where = self.items[idx]
        prompt_ids = self.tokenizer.text_to_ids(prompt)
        chosen_ids, chosen_prompt, chosen_cut = encode_and_count_cut(self.tokenizer, prompt_ids, chosen,
                                                                     self.seq_length, self.add_eos)
        rejected_ids, rejected_prompt, rejected_cut = encode_and_count_cut(self.tokenizer, prompt_ids, rejected,
                                                                           self.seq_length, self.add_eos)
        self._warn_truncated(where, max(chosen_cut, rejected_cut))
        return {"chosen": chosen_ids, "rejected": rejected_ids, "chosen_prompt": chosen_prompt,
                "rejected_prompt": rejected_prompt, "rewards": rewards}


def collate_dpo(samples: Sequence[Dict], pad_id: int, seq_length: int, pad_to_multiple_of: int = 8) -> Dict:
    """``chosen``/``rejected`` [B, L], their response masks on log-prob positions [B, L-1], rewards, weights."""
    longest = max(max(len(s["chosen"]), len(s["rejected"])) for s in samples)
    length = padded_length(longest, seq_length, pad_to_multiple_of)
    out = {}
    for side in ("chosen", "rejected"):
        out[side] = pad_rows([s[side] for s in samples], length, pad_id)
        out[f"{side}_mask"] = response_mask([(1, 1) if s.get("padding") else (len(s[side]), s[f"{side}_prompt"])
                                             for s in samples], length)
    out["chosen_rewards"] = torch.tensor([s["rewards"][0] for s in samples], dtype=torch.float32)
    out["rejected_rewards"] = torch.tensor([s["rewards"][1] for s in samples], dtype=torch.float32)
    out["weight"] = torch.tensor([0.0 if s.get("padding") else 1.0 for s in samples])
    out["position_ids"] = torch.arange(length).unsqueeze(0).expand(len(samples), length).contiguous()
    return out
