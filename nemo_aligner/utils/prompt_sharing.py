"""Shared-prompt packing: rollouts that repeat a prompt (GRPO/RLOO groups) run their prompt once.

A group of ``n`` consecutive rows with the same prompt becomes one packed row
``[prompt, left-padded to P][response 1][response 2]...[response n]``, each response in a slot of
``R`` tokens. Every response attends to its group's prompt and causally to itself, with the
positions it has in its own row, so each output equals the unpacked row's (up to float rounding)
while the prompt's tokens are computed once per group instead of ``n`` times.

The layout reaches the attention as a boolean mask ``[G * n, 1, R, P + R]`` (True hides a key, as
megatron-core's masks do) whose key length differs from the packed sequence's ``P + n * R``: that
is how :func:`shared_prompt_attention` tells it from an ordinary mask, and a plain tensor survives
megatron-core's activation checkpointing. Rows are right-padded ``[prompt][response][padding]``
with ``response_lengths`` = prompt + response tokens, as rollouts are everywhere else.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Tuple

import torch

from nemo_aligner.utils.sdpa import scaled_dot_product_attention


@dataclass(frozen=True)
class PackShape:
    """Packed micro-batch dimensions: ``groups`` rows of ``responses`` response slots of
    ``response_slots`` tokens after ``prompt_slots`` prompt tokens."""

    groups: int
    responses: int
    prompt_slots: int
    response_slots: int

    @property
    def length(self) -> int:
        return self.prompt_slots + self.responses * self.response_slots

    def merge(self, other: "PackShape") -> "PackShape":
        """The smallest shape both fit in (pipeline stages need one activation shape per call)."""
        return PackShape(*(max(a, b) for a, b in zip(self.as_tuple(), other.as_tuple())))

    def as_tuple(self) -> Tuple[int, int, int, int]:
        return self.groups, self.responses, self.prompt_slots, self.response_slots


@dataclass
class PackedRollouts:
    """One micro-batch packed by prompt.

    ``tokens``/``positions`` [G, L] feed the model; ``attention_mask`` is the layout mask above.
    Per-token results come back to the rows through ``source`` [B, T]: an index into
    :func:`per_token_values`' vector, the packed slot that predicts token ``t + 1`` of row ``b``
    (``g * L + slot``) or, for a response's first token, which the group's last prompt slot predicts
    for every response, that response's own entry (``G * L + g * n + i``; its token is
    ``first_tokens[g, i]``). ``valid`` [B, T] is False after a row's response and at its last
    position, where ``source`` points at an arbitrary entry.
    """

    tokens: torch.Tensor
    positions: torch.Tensor
    attention_mask: torch.Tensor
    source: torch.Tensor
    valid: torch.Tensor
    first_tokens: torch.Tensor
    shape: PackShape


def prompt_groups(tokens: torch.Tensor, prompt_lengths: torch.Tensor) -> List[Tuple[int, int]]:
    """``(first row, row count)`` of each run of consecutive rows with the same prompt."""
    groups: List[Tuple[int, int]] = []
    for b in range(tokens.shape[0]):
        p = int(prompt_lengths[b])
        if groups:
            first, count = groups[-1]
            if int(prompt_lengths[first]) == p and torch.equal(tokens[first, :p], tokens[b, :p]):
                groups[-1] = (first, count + 1)
                continue
        groups.append((b, 1))
    return groups


def pack_shape(tokens: torch.Tensor, prompt_lengths: torch.Tensor, response_lengths: torch.Tensor,
               groups: Optional[List[Tuple[int, int]]] = None) -> PackShape:
    """The packed shape of one micro-batch (``groups``: its :func:`prompt_groups`, when known)."""
    groups = groups or prompt_groups(tokens, prompt_lengths)
    responses = (response_lengths - prompt_lengths).clamp(min=1)
    return PackShape(len(groups), max(count for _, count in groups), int(prompt_lengths.max()),
                     int(responses.max()))


def saves_tokens(shapes: List[PackShape], rows: int, width: int) -> bool:
    """Whether packing computes fewer token positions than the ``rows`` x ``width`` unpacked batch."""
    return sum(s.groups * s.length for s in shapes) < rows * width


def pack(tokens: torch.Tensor, prompt_lengths: torch.Tensor, response_lengths: torch.Tensor,
         shape: Optional[PackShape] = None, groups: Optional[List[Tuple[int, int]]] = None) -> PackedRollouts:
    """Pack right-padded rollouts ``tokens`` [B, T] by prompt; ``shape`` (at least this batch's
    :func:`pack_shape`) pads every micro-batch of a call to one shape; ``groups``: the batch's
    :func:`prompt_groups`, when known."""
    groups = groups or prompt_groups(tokens, prompt_lengths)
    mine = pack_shape(tokens, prompt_lengths, response_lengths, groups)
    shape = shape or mine
    if shape.merge(mine) != shape:
        raise ValueError(f"pack shape {shape} is smaller than the batch's {mine}")
    G, n, P, R = shape.as_tuple()
    if n < 2:  # one response slot would give the mask the sequence's key length: nothing to share anyway
        raise ValueError("shared-prompt packing needs a group of at least 2 rows")
    L = shape.length
    B, T = tokens.shape
    packed = torch.zeros(G, L, dtype=tokens.dtype)
    positions = torch.zeros(G, L, dtype=torch.long)
    prompt_hidden = torch.ones(G, P, dtype=torch.bool)
    source = torch.zeros(B, T, dtype=torch.long)
    valid = torch.zeros(B, T, dtype=torch.bool)
    first_tokens = torch.zeros(G, n, dtype=tokens.dtype)
    steps = torch.arange(T)
    for g, (first, count) in enumerate(groups):
        p = int(prompt_lengths[first])
        packed[g, P - p : P] = tokens[first, :p]
        positions[g, P - p : P] = torch.arange(p)
        prompt_hidden[g, P - p :] = False
        for i in range(count):
            b = first + i
            r = min(int(response_lengths[b]) - p, R)
            start = P + i * R
            packed[g, start : start + r] = tokens[b, p : p + r]
            positions[g, start : start + R] = torch.arange(p, p + R)
            if r > 0:
                first_tokens[g, i] = tokens[b, p]
            # Position t predicts token t + 1: from a prompt token's own slot, from this response's
            # entry for its first token, then from the previous response token's slot.
            index = torch.where(steps < p - 1, g * L + P - p + steps, g * L + start + steps - p)
            index[p - 1] = G * L + g * n + i
            row_valid = steps < p + r - 1
            source[b] = torch.where(row_valid, index, torch.zeros_like(steps))
            valid[b] = row_valid
    response_hidden = torch.ones(R, R, dtype=torch.bool).triu(1)
    mask = torch.cat((prompt_hidden[:, None, None, :].expand(G, n, R, P),
                      response_hidden.expand(G, n, R, R)), dim=-1)
    return PackedRollouts(packed, positions, mask.reshape(G * n, 1, R, P + R), source, valid, first_tokens, shape)


def is_shared_prompt_mask(attention_mask: Optional[torch.Tensor], sequence_length: int) -> bool:
    """Whether ``attention_mask`` is a packed layout (its key length is not the sequence's)."""
    return attention_mask is not None and attention_mask.dim() == 4 and attention_mask.shape[-1] != sequence_length


def shared_prompt_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor,
                            scale: Optional[float]) -> torch.Tensor:
    """Attention over a packed layout: ``query``/``key``/``value`` [L, G, heads, d] (megatron-core's
    layout, one head count), ``mask`` from :func:`pack`; returns [L, G, heads * d].

    The prompt attends causally to itself; each response to its group's prompt and causally to
    itself, as two ``scaled_dot_product_attention`` calls. Differentiable: the prompt's keys and
    values collect the gradients of every response in the group.
    """
    L, G, heads, d = query.shape
    Gn, _, R, PR = mask.shape
    P, n = PR - R, Gn // G
    if Gn != G * n or L != P + n * R:
        raise ValueError(f"shared-prompt mask {tuple(mask.shape)} does not fit a packed sequence of {L} x {G}")

    # split, not sliced: the backward of a split concatenates its parts' gradients, where each
    # slice's would fill a zero tensor of the whole and add them up
    (q_prompt, q_responses), (k_prompt, k_responses), (v_prompt, v_responses) = (
        t.split((P, L - P)) for t in (query, key, value))

    def prompt(part):  # [P, G, heads, d] -> [G, heads, P, d]
        return part.permute(1, 2, 0, 3)

    def responses(part):  # [n * R, G, heads, d] -> [G * n, heads, R, d]
        return part.reshape(n, R, G, heads, part.shape[-1]).permute(2, 0, 3, 1, 4).reshape(Gn, heads, R, part.shape[-1])

    def with_prompt(prompt_part, own):  # each response's keys or values: its group's prompt, then its own
        d_part = own.shape[-1]
        shared = prompt(prompt_part).unsqueeze(1).expand(G, n, heads, P, d_part).reshape(Gn, heads, P, d_part)
        return torch.cat((shared, responses(own)), dim=2)

    real = ~mask[::n, 0, 0, :P]  # [G, P]: the prompt's real (not padding) slots
    eye = torch.eye(P, dtype=torch.bool, device=mask.device)
    # A padding slot attends to itself only, so no query row is empty (its output is never used).
    prompt_allowed = (eye.logical_not().tril() & real[:, None, :]) | eye
    out_prompt = scaled_dot_product_attention(prompt(q_prompt), prompt(k_prompt), prompt(v_prompt),
                                              attn_mask=prompt_allowed.unsqueeze(1), scale=scale)
    out_responses = scaled_dot_product_attention(responses(q_responses), with_prompt(k_prompt, k_responses),
                                                 with_prompt(v_prompt, v_responses), attn_mask=~mask, scale=scale)
    dv = value.shape[-1]
    out_prompt = out_prompt.permute(2, 0, 1, 3).reshape(P, G, heads * dv)
    out_responses = out_responses.reshape(G, n, heads, R, dv).permute(1, 3, 0, 2, 4).reshape(n * R, G, heads * dv)
    return torch.cat((out_prompt, out_responses), dim=0)


def next_tokens(tokens: torch.Tensor) -> torch.Tensor:
    """Each packed slot's next token [G, L], the label of the slot's prediction wherever ``source``
    points at a slot (a region's last slot gets its neighbour's, and is never pointed at)."""
    return torch.cat((tokens[:, 1:], tokens[:, -1:]), dim=1)


def per_token_values(per_slot: torch.Tensor, first: torch.Tensor) -> torch.Tensor:
    """The vector ``source`` indexes: values of every packed slot [G, L], then of each response's
    first-token prediction [G, n]."""
    return torch.cat((per_slot.reshape(-1), first.reshape(-1)))


def to_rows(values: torch.Tensor, source: torch.Tensor) -> torch.Tensor:
    """Per-row values [B, T] from :func:`per_token_values`' vector."""
    return values.index_select(0, source.reshape(-1)).view(source.shape)
