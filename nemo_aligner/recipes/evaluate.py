"""Score a ``.nemo`` policy's greedy responses to held-out prompts with a reward function (the
built-in task's rule-based score, say) or a reward model, in this process."""

from __future__ import annotations

from contextlib import contextmanager
from typing import Callable, List, Sequence

from omegaconf import OmegaConf


def greedy_responses(nemo: str, prompts: Sequence[str], max_new_tokens: int = 9, batch_size: int = 64) -> List[str]:
    """The policy's greedy response to each prompt (EOS dropped), one process on the CPU or one GPU."""
    from nemo_aligner.models.nlp.gpt.generation import LengthParams, SamplingParams
    from nemo_aligner.models.nlp.gpt.loading import load_model
    from nemo_aligner.models.nlp.gpt.megatron_gpt_model import MegatronGPTModel
    from nemo_aligner.models.nlp.gpt.text_generation import generate_texts

    with _single_process():
        model = load_model(MegatronGPTModel, OmegaConf.create({}), "32", nemo, trainable=False)
        return generate_texts(model, prompts, SamplingParams(use_greedy=True), LengthParams(max_length=max_new_tokens),
                              batch_size=batch_size)


def reward_model_scores(rm_nemo: str, texts: Sequence[str], batch_size: int = 64) -> List[float]:
    """A reward model's reward for each full text (prompt + response), one process on the CPU or one GPU."""
    import torch

    from nemo_aligner.data.nlp.reward_datasets import texts_to_tokens
    from nemo_aligner.models.nlp.gpt.loading import load_model
    from nemo_aligner.models.nlp.gpt.megatron_gpt_reward_model import MegatronGPTRewardModel

    with _single_process():
        model = load_model(MegatronGPTRewardModel, OmegaConf.create({}), "32", rm_nemo, trainable=False)
        model.prepare_for_inference()
        rewards: List[float] = []
        for start in range(0, len(texts), batch_size):
            # As the reward model was trained and as the servers take them: EOS appended, right-padded.
            tokens, lengths = texts_to_tokens(model.tokenizer, texts[start : start + batch_size])
            rewards += model.infer(torch.as_tensor(tokens), torch.as_tensor(lengths)).reshape(len(tokens), -1)[:, 0].tolist()
        return rewards


@contextmanager
def _single_process():
    """A one-rank process group and model-parallel state for the duration, unless one exists already."""
    import torch.distributed as dist

    from nemo_aligner.utils import distributed as D

    started = not dist.is_initialized()
    if started:
        D.init_distributed()
        D.initialize_model_parallel(1, 1)
    try:
        yield
    finally:
        if started:
            D.destroy()


def greedy_score(nemo: str, prompts: Sequence[str], reward_fn: Callable[[str, str], float],
                 max_new_tokens: int = 9) -> float:
    """The mean of ``reward_fn(prompt, greedy response)`` over ``prompts``."""
    return mean_reward(prompts, greedy_responses(nemo, prompts, max_new_tokens), reward_fn)


def mean_reward(prompts: Sequence[str], responses: Sequence[str], reward_fn: Callable[[str, str], float]) -> float:
    """The mean of ``reward_fn(prompt, response)`` over the pairs."""
    return sum(float(reward_fn(p, r)) for p, r in zip(prompts, responses)) / max(len(prompts), 1)
