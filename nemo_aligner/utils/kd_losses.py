"""Knowledge-distillation losses over a teacher's top-k tokens (NeMo-Aligner's ``kd_loss``): both
distributions renormalised over the teacher's k token ids of each position."""

from __future__ import annotations

import torch

KD_LOSSES = ("fwd_kl", "bwd_kl")


def topk_kd_loss(student_topk_logits: torch.Tensor, teacher_topk_logits: torch.Tensor,
                 kind: str = "fwd_kl") -> torch.Tensor:
    """Per-position KL between teacher and student over the teacher's top-k ids, ``[..., k] -> [...]``.

    ``fwd_kl``: KL(teacher || student) = sum_k p_t (log p_t - log p_s); ``bwd_kl``: KL(student || teacher).
    ``student_topk_logits`` are the student's logits at the teacher's ids, in the teacher's order.
    """
    if kind not in KD_LOSSES:
        raise ValueError(f"kd_loss={kind!r} must be one of {list(KD_LOSSES)}")
    log_p_s = torch.log_softmax(student_topk_logits.float(), dim=-1)
    log_p_t = torch.log_softmax(teacher_topk_logits.float(), dim=-1)
    if kind == "fwd_kl":
        return (log_p_t.exp() * (log_p_t - log_p_s)).sum(-1)
    return (log_p_s.exp() * (log_p_s - log_p_t)).sum(-1)
