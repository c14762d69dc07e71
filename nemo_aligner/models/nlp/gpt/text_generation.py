"""Text in, text out: batched generation from a loaded GPT model (strings, not token ids)."""

from __future__ import annotations

from typing import Dict, List, Optional, Sequence

import torch

from nemo_aligner.models.nlp.gpt import expert_lockstep
from nemo_aligner.models.nlp.gpt.generation import LengthParams, SamplingParams, generate


def generate_texts(model, prompts: Sequence[str], sampling: Optional[SamplingParams] = None,
                   length: Optional[LengthParams] = None, seed: Optional[int] = None, batch_size: int = 16,
                   strip_end_strings: bool = True, data_parallel: bool = False) -> List[str]:
    """Responses to ``prompts`` from a :class:`MegatronGPTModel` (collective over model parallelism:
    every rank passes the same prompts). EOS is dropped and, with ``strip_end_strings``, a trailing
    end string too.

    The prompts go in batches of ``batch_size``, batch ``k`` sampling with ``seed + k * batch_size``.
    ``data_parallel``: the batches are shared out over the data-parallel ranks (batch ``k`` to rank
    ``k % dp``) and the responses gathered on every rank, the same as one rank generating them all."""
    sampling = sampling or SamplingParams(use_greedy=True)
    length = length or LengthParams()
    tokenizer = model.tokenizer
    training = model.module.training
    model.eval()
    size = max(int(batch_size), 1)
    starts = list(range(0, len(prompts), size))
    dp, dp_rank, dp_group = 1, 0, None
    if data_parallel and torch.distributed.is_initialized():
        from megatron.core import parallel_state

        dp, dp_rank = parallel_state.get_data_parallel_world_size(), parallel_state.get_data_parallel_rank()
        dp_group = parallel_state.get_data_parallel_group()
    responses: Dict[int, List[str]] = {}
    for start in starts[dp_rank::dp]:
        chunk = [tokenizer.text_to_ids(p) for p in prompts[start : start + size]]
        out = generate(model.module, tokenizer, chunk, sampling, length,
                       max_sequence_length=int(model.cfg.encoder_seq_length),
                       seed=None if seed is None else seed + start)
        responses[start] = [_response_text(tokenizer, out, b, sampling.end_strings if strip_end_strings else ())
                            for b in range(len(chunk))]
    expert_lockstep.drain(model.module)  # expert-parallel peers may still be generating
    if dp > 1:
        parts = [None] * dp
        torch.distributed.all_gather_object(parts, responses, group=dp_group)
        responses = {start: texts for part in parts for start, texts in part.items()}
    if training:
        model.train()
    return [text for start in starts for text in responses[start]]


def _response_text(tokenizer, out, row: int, end_strings: Sequence[str]) -> str:
    """Row ``row``'s response as text: EOS dropped, then the first of ``end_strings`` it ends with."""
    ids = out.tokens[row, int(out.prompt_lengths[row]) : int(out.response_lengths[row])].tolist()
    if ids and ids[-1] == tokenizer.eos_id:
        ids = ids[:-1]
    text = tokenizer.ids_to_text(ids)
    for end in end_strings:
        if end and text.endswith(end):
            return text[: -len(end)]
    return text


@torch.no_grad()
def sentence_logprobs(model, texts: Sequence[str], batch_size: int = 16) -> List[List[float]]:
    """Each text's per-token log-probabilities (of tokens 2..n given the ones before), by a
    :class:`MegatronGPTModel`; collective over model parallelism (every rank passes the same texts)."""
    from megatron.core import parallel_state

    from nemo_aligner.models.nlp.gpt.megatron_gpt_ppo_actor import next_token_batch
    from nemo_aligner.utils.distributed import broadcast_from_last_stage

    tokenizer = model.tokenizer
    training = model.module.training
    model.eval()
    result: List[List[float]] = []
    for start in range(0, len(texts), max(int(batch_size), 1)):
        ids = [tokenizer.text_to_ids(t)[: int(model.cfg.encoder_seq_length)] for t in texts[start : start + batch_size]]
        width = max(len(i) for i in ids)
        tokens = torch.full((len(ids), width), tokenizer.eos_id, dtype=torch.long)
        for b, row in enumerate(ids):
            tokens[b, : len(row)] = torch.tensor(row, dtype=torch.long)
        outputs = model.forward_backward(next_token_batch(tokens), None, True, len(ids))
        ce = torch.zeros(tokens.shape, dtype=torch.float32)
        if parallel_state.is_pipeline_last_stage():
            ce = torch.cat([o.float() for o in outputs]).cpu()
        logps = -broadcast_from_last_stage(ce)
        result += [logps[b, : len(row) - 1].tolist() for b, row in enumerate(ids)]
    if training:
        model.train()
    return result
