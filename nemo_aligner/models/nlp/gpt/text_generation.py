"""Text in, text out: batched generation from a loaded GPT model (strings, not token ids)."""

from __future__ import annotations

from typing import List, Optional, Sequence

import torch

from nemo_aligner.models.nlp.gpt.generation import LengthParams, SamplingParams, generate


def generate_texts(model, prompts: Sequence[str], sampling: Optional[SamplingParams] = None,
                   length: Optional[LengthParams] = None, seed: Optional[int] = None, batch_size: int = 16,
                   strip_end_strings: bool = True) -> List[str]:
    """Responses to ``prompts`` from a :class:`MegatronGPTModel` (collective over model parallelism:
    every rank passes the same prompts). EOS is dropped and, with ``strip_end_strings``, a trailing
    end string too."""
    sampling = sampling or SamplingParams(use_greedy=True)
    length = length or LengthParams()
    tokenizer = model.tokenizer
    training = model.module.training
    model.eval()
    responses: List[str] = []
    for start in range(0, len(prompts), max(int(batch_size), 1)):
        chunk = [tokenizer.text_to_ids(p) for p in prompts[start : start + batch_size]]
        out = generate(model.module, tokenizer, chunk, sampling, length,
                       max_sequence_length=int(model.cfg.encoder_seq_length),
                       seed=None if seed is None else seed + start)
        for b in range(len(chunk)):
            ids = out.tokens[b, int(out.prompt_lengths[b]) : int(out.response_lengths[b])].tolist()
            if ids and ids[-1] == tokenizer.eos_id:
                ids = ids[:-1]
            text = tokenizer.ids_to_text(ids)
            if strip_end_strings:
                for end in sampling.end_strings:
                    if end and text.endswith(end):
                        text = text[: -len(end)]
                        break
            responses.append(text)
    if training:
        model.train()
    return responses


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
