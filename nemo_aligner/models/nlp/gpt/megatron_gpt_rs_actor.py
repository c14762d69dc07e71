"""The rejection-sampling actor (NeMo-Aligner's ``MegatronGPTRSActorModel``): the PPO actor's
generation and set-up, trained with the SFT loss on the responses it keeps."""

from __future__ import annotations

from typing import Dict, Tuple

import torch

from nemo_aligner.models.nlp.gpt.megatron_gpt_ppo_actor import MegatronGPTActorModel, next_token_batch
from nemo_aligner.utils import ppo_utils


class MegatronGPTRSActorModel(MegatronGPTActorModel):
    """``model.rs.*``: the actor's generation keys (``sampling_params``, ``length_params``,
    ``rollout_micro_batch_size``, ``forward_micro_batch_size``, ``offload_adam_states``). No reference
    policy is kept: rejection sampling has no KL term."""

    uses_reference_policy = False

    def __init__(self, cfg, tokenizer, precision="32", trainable: bool = True, section: str = "rs"):
        super().__init__(cfg, tokenizer, precision, trainable, section=section)

    def _rs_loss(self, mb, logits):
        logprobs, _ = self._token_logprobs(mb, logits)
        mask = mb["mask"] * mb["is_end"].unsqueeze(-1)
        loss = -ppo_utils.masked_mean(logprobs, mask)  # NLL per response token, as SFT
        return loss, {"loss": loss.detach().clone(), "tokens": mask.sum().detach()}

    def get_loss_and_metrics(self, batch: Dict[str, torch.Tensor], forward_only: bool,
                             **unused) -> Tuple[float, Dict[str, float]]:
        """One global batch of kept responses (``tokens``, ``mask`` over their response tokens,
        ``is_end``): the mean negative log-likelihood of the response tokens (responses cut at the
        length limit, without an end, are not trained on)."""
        data = dict(next_token_batch(batch["tokens"]))
        data["mask"] = batch["mask"]
        data["is_end"] = batch["is_end"].float()
        outputs = self.forward_backward(data, self._rs_loss, forward_only, self.micro_batch_size,
                                        forward_fn=self._ppo_forward)
        m = self.reduce_metrics(outputs, mean_keys=("loss",))
        return m["loss"], m
