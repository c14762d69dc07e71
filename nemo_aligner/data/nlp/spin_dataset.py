"""SPIN's data: NeMo's SFT records (prompt/answer or chat) split into the prompt the policy answers
and the data's answer, and the preference pairs of a step (the data's answer chosen, the
reference policy's generation rejected)."""

from __future__ import annotations

from typing import Dict, List, Sequence, Tuple

import torch

from nemo_aligner.data.nlp.dpo_dataset import collate_dpo
from nemo_aligner.data.nlp.sft_dataset import collate_sft


def prompt_and_answer(sample: Dict) -> Tuple[List[int], List[int]]:
    """``(prompt ids, answer ids)`` of one SFT sample: the answer is the last trained span (a chat's
    last trained turn, or a prompt/answer record's answer with its EOS), the prompt all before it."""
    ids = list(sample["input_ids"])
    if "target_mask" in sample:
        mask = list(sample["target_mask"])
        end = max(i for i, m in enumerate(mask) if m) + 1 if any(mask[1:]) else len(ids)
        start = end
        while start > 1 and mask[start - 1]:
            start -= 1
        return ids[:start], ids[start:end]
    start = max(int(sample["answer_start"]), 1)
    return ids[:start], ids[start:]


def collate_spin(samples: Sequence[Dict], pad_id: int, max_seq_length: int, pad_to_multiple_of: int = 8) -> Dict:
    """The SFT batch (``tokens``, ``labels``, ``loss_mask``, ``position_ids``, ``lengths``: the validation
    loss) plus ``prompts`` and ``answers``, token-id lists per sample (the pairs of a training step)."""
    batch = collate_sft(samples, pad_id, max_seq_length, pad_to_multiple_of)
    split = [prompt_and_answer(s) for s in samples]
    batch["prompts"] = [p for p, _ in split]
    batch["answers"] = [a for _, a in split]
    return batch


def spin_pairs(prompts: Sequence[Sequence[int]], answers: Sequence[Sequence[int]],
               generated: Sequence[Sequence[int]], pad_id: int, seq_length: int,
               pad_to_multiple_of: int = 8) -> Dict[str, torch.Tensor]:
    """A DPO batch of ``prompt + answer`` (chosen) against ``prompt + generated`` (rejected) per sample."""
    samples = [{"chosen": list(p) + list(a), "rejected": list(p) + list(g), "chosen_prompt": len(p),
                "rejected_prompt": len(p), "rewards": (1.0, 0.0)} for p, a, g in zip(prompts, answers, generated)]
    return collate_dpo(samples, pad_id, seq_length, pad_to_multiple_of)
