"""Multi-turn episodes for critic-free RL (GRPO, REINFORCE/RLOO) with an environment.

One episode::

    context = prompt
    for turn in 1..max_rollout_turns:
        response = policy.generate(context)                 # the policy's tokens: trained on
        reward, done, observation = environment.step(conversation so far)
        total_reward += reward                              # every turn's reward counts
        if done or the response did not end: stop
        context = context + response + observation         # the observation's tokens: not trained on

The episode is one row (prompt, then turns and observations); its loss mask covers the policy's
tokens only and its reward is the sum over turns, as NeMo-RL's multi-turn rollouts.
"""

from __future__ import annotations

import logging
from concurrent.futures import Future
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch

from nemo_aligner.algorithms.ppo import is_mp_source, mp_broadcast
from nemo_aligner.data.nlp.dpo_dataset import pad_rows

logger = logging.getLogger(__name__)

Span = Tuple[int, int]


def policy_token_mask(spans: Sequence[Sequence[Span]], width: int) -> torch.Tensor:
    """1 on the log-prob positions of the policy's own tokens, [B, width]: tokens ``[s, e)`` of a row
    are predicted at log-prob positions ``s-1 .. e-2`` (see ``ppo_utils``)."""
    mask = torch.zeros(len(spans), width)
    for row, row_spans in enumerate(spans):
        for start, end in row_spans:
            mask[row, max(start - 1, 0): max(end - 1, 0)] = 1.0
    return mask


class EpisodeStats:
    """Turns played and episodes cut by the turn or length limit (warned about once per run)."""

    def __init__(self):
        self.warned = False

    def report(self, cut: int, total: int, max_turns: int, key: str) -> None:
        if cut and not self.warned:
            self.warned = True
            logger.warning("%d of %d episodes were still going after %d turns (or at the sequence length limit) and "
                           "were cut there; raise %s (or model.encoder_seq_length) to play them out", cut, total,
                           max_turns, key)


def play_episodes(model, source, prompts: List[List[int]], metadata: Optional[List[dict]], micro_batch_size: int,
                  seed: int, sampling, max_turns: int, timer, stats: EpisodeStats, key: str) -> Dict:
    """Episodes from ``prompts`` as one right-padded rollout batch: ``tokens``, ``prompt_lengths``,
    ``response_lengths`` (the whole row), ``is_end`` (the last turn ended), ``policy_mask`` [B, T-1],
    ``turns`` and ``_futures`` (the summed rewards, on the model-parallel source rank)."""
    tok = model.tokenizer
    n = len(prompts)
    rows = [list(p) for p in prompts]
    conversations = [[{"role": "user", "content": tok.ids_to_text(list(p))}] for p in prompts]
    spans: List[List[Span]] = [[] for _ in range(n)]
    rewards = np.zeros(n, dtype=np.float32)
    ended, done, turns = [False] * n, [False] * n, [0] * n
    limit = int(model.cfg.encoder_seq_length)
    cut = 0
    for turn in range(max_turns):
        active = [i for i in range(n) if not done[i]]
        if not active:
            break
        for offset in range(0, len(active), micro_batch_size):
            chunk = active[offset: offset + micro_batch_size]
            with timer("generate"):
                out = model.infer([rows[i] for i in chunk], seed=seed + 100003 * turn + offset, sampling=sampling)
            for j, i in enumerate(chunk):
                new = out.tokens[j, int(out.prompt_lengths[j]): int(out.response_lengths[j])].tolist()
                spans[i].append((len(rows[i]), len(rows[i]) + len(new)))
                rows[i] += new
                ended[i], turns[i] = bool(out.is_end[j]), turns[i] + 1
                text = new[:-1] if new and new[-1] == tok.eos_id else new
                conversations[i].append({"role": "assistant", "content": tok.ids_to_text(text)})
        answer = None
        if is_mp_source():
            with timer("environment"):
                answer = source.step([conversations[i] for i in active],
                                     [metadata[i] for i in active] if metadata is not None else None,
                                     need_observations=turn + 1 < max_turns)
        step_rewards, step_done, observations = mp_broadcast(answer)
        for k, i in enumerate(active):
            rewards[i] += step_rewards[k]
            if step_done[k] or not ended[i]:
                done[i] = True
                continue
            observation = tok.text_to_ids(observations[k]["content"]) if turn + 1 < max_turns else []
            if turn + 1 == max_turns or len(rows[i]) + len(observation) >= limit - 1:
                done[i] = True
                cut += 1
                continue
            rows[i] += observation
            conversations[i].append(dict(observations[k]))
    stats.report(cut, n, max_turns, key)
    width = max(len(r) for r in rows)
    tokens = pad_rows(rows, width, tok.eos_id)
    future = None
    if is_mp_source():
        future = Future()
        future.set_result(rewards)
    return {
        "tokens": tokens,
        "prompt_lengths": torch.tensor([len(p) for p in prompts], dtype=torch.long),
        "response_lengths": torch.tensor([len(r) for r in rows], dtype=torch.long),
        "is_end": torch.tensor(ended, dtype=torch.bool),
        "policy_mask": policy_token_mask(spans, width - 1),
        "turns": torch.tensor(turns, dtype=torch.float32),
        "_futures": [future],
    }
