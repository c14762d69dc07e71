"""SFT datasets in NeMo's jsonl formats: prompt/answer (``{"input","output"}``) and chat.

Each sample is a dict with ``input_ids`` (the whole sequence) and ``answer_start``
(index of the first token the loss is computed on) plus, for chat, a per-token
``target_mask``. ``collate_sft`` turns a list of samples into the model's batch:
``tokens``, ``labels`` (tokens shifted by one), ``loss_mask`` and ``position_ids``.
"""

from __future__ import annotations

import contextlib
import logging
import string
from typing import Dict, List, Optional, Sequence

import torch

from nemo_aligner.data.nlp.chat_template import (chat_ids_and_mask, chat_tokens, mask_roles,
                                                 render_conversation, validate_chat_record)
from nemo_aligner.data.nlp.jsonl import read_jsonl, require_fields
from nemo_aligner.utils.errors import ConfigError, DataError

logger = logging.getLogger(__name__)


def template_fields(template: str) -> List[str]:
    """Names used in a ``str.format`` template, in order; a template ``str.format`` cannot fill from
    a record's fields is a ConfigError naming it."""
    try:
        parsed = list(string.Formatter().parse(template))
    except ValueError as err:
        raise ConfigError(f"prompt_template={template!r} is not a valid template ({err}); write fields as {{name}} "
                          "and literal braces doubled, {{ and }}") from None
    names = []
    for _, name, _, _ in parsed:
        if name is None:
            continue
        if not name.isidentifier():
            raise ConfigError(f"prompt_template={template!r}: {{{name}}} is not a record field name (fields are "
                              "written {input}, {output}, ...)")
        names.append(name)
    return names


def truncate(ids: List[int], n_remove: int, method: str) -> List[int]:
    """Drop ``n_remove`` tokens from the right (keep the start) or the left (keep the end)."""
    if n_remove <= 0:
        return ids
    return ids[: max(len(ids) - n_remove, 0)] if method == "right" else ids[n_remove:]


@contextlib.contextmanager
def format_hint(record: Dict, chat: bool, chat_key: str):
    """A missing field of a record in the other SFT format (a chat record read as prompt/answer, or the
    reverse) names the ``chat_key`` value that reads it."""
    try:
        yield
    except DataError as err:
        if chat and "conversations" not in record and ("input" in record or "output" in record):
            raise DataError(f"{err}: a prompt/answer record; set {chat_key}=False to read them") from None
        if not chat and "conversations" in record:
            raise DataError(f"{err}: a chat record; set {chat_key}=True to read them") from None
        raise


class GPTSFTDataset(torch.utils.data.Dataset):
    """``{"input": ..., "output": ...}`` records rendered with ``prompt_template``.

    The text before ``{<label_key>}`` in the template is the context; the label value
    and anything after it is the answer. With ``answer_only_loss`` only answer tokens
    (and EOS) carry loss. Samples longer than ``max_seq_length`` tokens are truncated
    on the context first (``truncation_method`` right/left), then on the answer.
    """

    def __init__(self, file_path: str, tokenizer, max_seq_length: int, prompt_template: str = "{input} {output}",
                 label_key: str = "output", add_bos: bool = False, add_eos: bool = True, add_sep: bool = False,
                 truncation_method: str = "right", answer_only_loss: bool = True, records=None,
                 chat_key: str = "model.data.chat"):
        self.file_path = file_path
        self.tokenizer = tokenizer
        self.max_seq_length = int(max_seq_length)
        self.prompt_template = prompt_template
        self.label_key = label_key
        self.add_bos, self.add_eos, self.add_sep = add_bos, add_eos, add_sep
        if truncation_method not in ("right", "left"):
            raise ConfigError(f"truncation_method={truncation_method!r} must be 'right' or 'left'")
        self.truncation_method = truncation_method
        self.answer_only_loss = answer_only_loss
        marker = "{" + label_key + "}"
        if prompt_template is None:  # NeMo-Aligner's configs leave it null: only chat records do without one
            raise ConfigError(f"prompt_template=null: prompt/answer records need a template such as "
                              f"'{{input}} {{output}}' ({chat_key}=True reads chat records without one)")
        if marker not in prompt_template:
            raise ConfigError(f"prompt_template {prompt_template!r} does not contain {marker} (label_key={label_key!r})")
        self.fields = template_fields(prompt_template)
        self.context_template, self.answer_suffix = prompt_template.split(marker, 1)
        for part in (self.context_template, self.answer_suffix):
            template_fields(part)  # each half is formatted on its own
        self.records = records if records is not None else read_jsonl(file_path)
        for record in self.records:
            with format_hint(record, False, chat_key):
                require_fields(record, self.fields, file_path)
                require_fields(record, [label_key], file_path, non_empty=True)  # no answer: nothing to learn

    def __len__(self) -> int:
        return len(self.records)

    def _warn_truncated(self, record: Dict, overflow: int) -> None:
        """Over-long records are truncated (documented in docs/sft.md); the first one is named."""
        if not getattr(self, "_warned", False):
            self._warned = True
            logger.warning("%s:%s: %d tokens longer than max_seq_length=%d; truncated (%s side of the context, "
                           "then the answer); further truncations in this file are not reported",
                           record.get("__file__", self.file_path), record.get("__line__", "?"), overflow,
                           self.max_seq_length, self.truncation_method)

    def __getitem__(self, idx: int) -> Dict:
        if idx < 0:  # padding sample of a partial validation batch: no loss
            return {"input_ids": [self.tokenizer.eos_id] * 2, "answer_start": 2, "padding": True}
        sample, overflow = self._sample(idx)
        if overflow > 0:
            self._warn_truncated(self.records[idx], overflow)
        return sample

    def trained_tokens(self, sample: Dict) -> int:
        return len(sample["input_ids"]) - max(sample["answer_start"], 1)

    def _sample(self, idx: int):
        """``(sample, tokens cut)`` of record ``idx``."""
        record = self.records[idx]
        context = self.context_template.format(**record)
        answer = record[self.label_key] + self.answer_suffix.format(**record)
        ctx_ids = self.tokenizer.text_to_ids(context)
        ans_ids = self.tokenizer.text_to_ids(answer)
        prefix = [self.tokenizer.bos_id] if self.add_bos and self.tokenizer.bos_id is not None else []
        suffix = [self.tokenizer.eos_id] if self.add_eos else []
        # +1: the model sees input_ids[:-1], so max_seq_length tokens need max_seq_length + 1 ids.
        budget = self.max_seq_length + 1 - len(prefix) - len(suffix)
        overflow = len(ctx_ids) + len(ans_ids) - budget
        if overflow > 0:
            cut = min(overflow, max(len(ctx_ids) - 1, 0))
            ctx_ids = truncate(ctx_ids, cut, self.truncation_method)
            ans_ids = ans_ids[: max(budget - len(ctx_ids), 0)]
        input_ids = prefix + ctx_ids + ans_ids + suffix
        answer_start = len(prefix) + len(ctx_ids) if self.answer_only_loss else 1
        return {"input_ids": input_ids, "answer_start": answer_start}, max(overflow, 0)


class GPTSFTChatDataset(torch.utils.data.Dataset):
    """NeMo chat records: ``{"system", "conversations": [{"from", "value", "label"?}], "mask"?, "type"?}``,
    rendered, tokenized and masked exactly as NeMo's ``GPTSFTChatDataset`` does (``chat_template``):
    one string, no BOS/EOS (``add_eos`` does not apply), the first turn never trained, the answer ended
    by the trained ``turn_start`` of the next turn. Over-long samples keep their first
    ``max_seq_length + 1`` tokens. ``answer_only_loss=False`` trains every token.
    """

    def __init__(self, file_path: str, tokenizer, max_seq_length: int, chat_prompt_tokens: Optional[dict] = None,
                 add_eos: bool = False, answer_only_loss: bool = True, records=None,
                 chat_key: str = "model.data.chat"):
        self.file_path = file_path
        self.tokenizer = tokenizer
        self.max_seq_length = int(max_seq_length)
        self.tokens = chat_tokens(chat_prompt_tokens)
        self.answer_only_loss = answer_only_loss
        self._warned_empty = False
        self.records = records if records is not None else read_jsonl(file_path)
        for record in self.records:
            with format_hint(record, True, chat_key):
                require_fields(record, ["conversations"], file_path, types=(list,), non_empty=True)
            problem = validate_chat_record(record, f"{record.get('__file__', file_path)}:{record.get('__line__', '?')}")
            if problem:
                raise DataError(problem)

    def __len__(self) -> int:
        return len(self.records)

    def render(self, record: dict) -> str:
        """The conversation's text, as trained on."""
        return render_conversation(record, self.tokens)[2]

    def __getitem__(self, idx: int) -> Dict:
        if idx < 0:
            return {"input_ids": [self.tokenizer.eos_id] * 2, "answer_start": 2, "padding": True}
        sample, _ = self._sample(idx)
        if not self.trained_tokens(sample) and not self._warned_empty:
            self._warned_empty = True
            logger.warning("%s:%s: no trained token is left after truncation to max_seq_length=%d; "
                           "such samples carry no loss (raise model.encoder_seq_length)",
                           self.file_path, self.records[idx].get("__line__", "?"), self.max_seq_length)
        return sample

    def trained_tokens(self, sample: Dict) -> int:
        return sum(sample["target_mask"][1:])

    def _sample(self, idx: int):
        """``(sample, tokens cut)`` of record ``idx``."""
        record = self.records[idx]
        ids, mask = chat_ids_and_mask(record, self.tokenizer, self.tokens)
        if not any(mask[1:]):
            raise DataError(f"{record.get('__file__', self.file_path)}:{record.get('__line__', '?')}: no token to "
                            f"train on (NeMo's chat format trains the turns after the first that are not from the "
                            f"masked role {mask_roles(record)!r})")
        if not self.answer_only_loss:
            mask = [1] * len(ids)
        cut = max(len(ids) - (self.max_seq_length + 1), 0)
        ids, mask = ids[: self.max_seq_length + 1], mask[: self.max_seq_length + 1]
        return {"input_ids": ids, "answer_start": 0, "target_mask": mask}, cut


def chat_records_with_loss(records: Sequence[Dict], path: str, tokenizer, max_seq_length: int,
                           chat_prompt_tokens: Optional[dict] = None):
    """``(kept, dropped)``: the chat records that keep a trained token after truncation to
    ``max_seq_length`` (as :class:`GPTSFTChatDataset` cuts them), and one ``file:line: why`` line for
    each other record (too long, nothing to train on, or not a valid chat record)."""
    tokens = chat_tokens(chat_prompt_tokens)
    kept, dropped = [], []
    for record in records:
        where = f"{record.get('__file__', path)}:{record.get('__line__', '?')}"
        problem = validate_chat_record(record, where)
        if problem:
            dropped.append(problem)
            continue
        try:
            _, mask = chat_ids_and_mask(record, tokenizer, tokens)
        except DataError as err:
            dropped.append(str(err))
            continue
        if any(mask[1 : max_seq_length + 1]):
            kept.append(record)
        else:
            dropped.append(f"{where}: no trained token" + (f" in its first {max_seq_length + 1} tokens" if any(mask[1:]) else ""))
    return kept, dropped


def report_lengths(dataset, key: str) -> None:
    """Tokenize every sample once: log how many are longer than the sequence length (with the first
    file:line), and refuse a dataset in which no sample keeps a trained token."""
    from nemo_aligner.data.nlp.length_report import report_truncated

    cuts, empty = [], 0
    for idx in range(len(dataset)):
        sample, cut = dataset._sample(idx)
        record = dataset.records[idx]
        cuts.append((f"{record.get('__file__', dataset.file_path)}:{record.get('__line__', '?')}", cut))
        empty += dataset.trained_tokens(sample) <= 0
    total = len(dataset)
    if total and empty == total:
        raise DataError(f"{dataset.file_path}: every one of the {total} samples is left with no trained token at "
                        f"max_seq_length={dataset.max_seq_length} (model.encoder_seq_length / "
                        f"{key}.max_seq_length): raise it")
    how = "the context is cut first, then the answer" if isinstance(dataset, GPTSFTDataset) else "the end is cut"
    if report_truncated(dataset.file_path, cuts, dataset.max_seq_length, how,
                        f"; {empty} keep no trained token and carry no loss" if empty else ""):
        dataset._warned = dataset._warned_empty = True  # reported here, once


def collate_sft(samples: Sequence[Dict], pad_id: int, max_seq_length: int, pad_to_multiple_of: int = 8) -> Dict[str, torch.Tensor]:
    """Right-pad a list of samples into ``tokens``, ``labels``, ``loss_mask``, ``position_ids``, ``lengths``.

    The padded length is the longest sample rounded up to ``pad_to_multiple_of``,
    never above ``max_seq_length``. ``loss_mask[b, i]`` is 1 when ``labels[b, i]`` is a
    trained token (an answer token, or any token without answer-only loss).
    """
    longest = max(len(s["input_ids"]) - 1 for s in samples)
    multiple = max(int(pad_to_multiple_of or 1), 1)
    length = min(((longest + multiple - 1) // multiple) * multiple, max_seq_length)
    batch = len(samples)
    tokens = torch.full((batch, length), pad_id, dtype=torch.long)
    labels = torch.full((batch, length), pad_id, dtype=torch.long)
    loss_mask = torch.zeros((batch, length), dtype=torch.float32)
    lengths = torch.zeros((batch,), dtype=torch.long)
    for b, sample in enumerate(samples):
        ids = torch.tensor(sample["input_ids"][: length + 1], dtype=torch.long)
        n = ids.numel() - 1
        tokens[b, :n] = ids[:-1]
        labels[b, :n] = ids[1:]
        if sample.get("padding"):
            continue
        lengths[b] = n
        if "target_mask" in sample:
            loss_mask[b, :n] = torch.tensor(sample["target_mask"][1 : n + 1], dtype=torch.float32)
        else:
            # label position i predicts input_ids[i + 1]; train where i + 1 >= answer_start.
            start = max(sample["answer_start"] - 1, 0)
            loss_mask[b, start:n] = 1.0
    position_ids = torch.arange(length, dtype=torch.long).unsqueeze(0).expand(batch, length).contiguous()
    return {"tokens": tokens, "labels": labels, "loss_mask": loss_mask, "position_ids": position_ids,
            "lengths": lengths}
