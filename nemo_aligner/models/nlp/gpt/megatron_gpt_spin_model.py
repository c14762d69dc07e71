"""SPIN (self-play fine-tuning, NeMo-Aligner's ``MegatronGPTSPINModel``): the DPO loss with the data's
response as chosen and the reference policy's own generation as rejected; the reference is the
previous iteration's weights, kept on the CPU and swapped in to generate and to score."""

from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Tuple

import torch

from nemo_aligner.models.alignable_interface import SelfPlayInterface
from nemo_aligner.models.nlp.gpt import expert_lockstep
from nemo_aligner.models.nlp.gpt.expert_lockstep import swapped_weights
from nemo_aligner.models.nlp.gpt.generation import GenerationOutput, LengthParams, SamplingParams, generate
from nemo_aligner.models.nlp.gpt.gpt_sft_model import masked_token_loss
from nemo_aligner.models.nlp.gpt.megatron_gpt_dpo_model import MegatronGPTDPOModel
from nemo_aligner.utils.errors import ConfigError


def kl_penalty_schedule(spin_cfg) -> List[float]:
    """``model.spin.ref_policy_kl_penalty``: one beta, or a list with one per iteration; each > 0."""
    value = spin_cfg.get("ref_policy_kl_penalty", 0.2)
    is_list = not isinstance(value, (int, float, str)) and hasattr(value, "__len__")
    values = list(value) if is_list else [value]
    if not values:
        raise ConfigError("model.spin.ref_policy_kl_penalty=[] needs one value, or one per iteration")
    out = []
    for v in values:
        try:
            beta = float(v)
        except (TypeError, ValueError):
            raise ConfigError(f"model.spin.ref_policy_kl_penalty={value!r} must be a number or a list of "
                              "numbers (one per iteration)") from None
        if not beta > 0:
            raise ConfigError(f"model.spin.ref_policy_kl_penalty={value!r}: each beta must be > 0")
        out.append(beta)
    return out


class MegatronGPTSPINModel(MegatronGPTDPOModel, SelfPlayInterface):
    """``model.spin.*``: ``ref_policy_kl_penalty`` (beta, or one per iteration),
    ``log_prob_forward_micro_batch_size``, ``rollout_micro_batch_size``, ``offload_adam_states``,
    ``sampling_params``, ``length_params``."""

    section = "spin"
    saves_reference_policy = True  # the reference moves each iteration: checkpoints keep it
    supports_sequence_parallel = False  # generation decodes one token at a time

    def __init__(self, cfg, tokenizer, precision="32", trainable: bool = True):
        spin = cfg.get("spin") or {}
        self.kl_schedule = kl_penalty_schedule(spin)
        super().__init__(cfg, tokenizer, precision, trainable)
        self.rollout_micro_batch_size = int(spin.get("rollout_micro_batch_size") or 0)
        if self.rollout_micro_batch_size < 1:
            raise ConfigError(f"model.spin.rollout_micro_batch_size={spin.get('rollout_micro_batch_size')} "
                              "must be >= 1 (prompts per generation call)")
        self.offload_adam_states = bool(spin.get("offload_adam_states", True))
        self.sampling_params = SamplingParams.from_cfg(spin.get("sampling_params"))
        self.length_params = LengthParams.from_cfg(spin.get("length_params"))
        if self.length_params.max_length < 1:
            raise ConfigError(f"model.spin.length_params.max_length={self.length_params.max_length} must be >= 1")

    @classmethod
    def initial_beta(cls, section_cfg) -> float:
        return kl_penalty_schedule(section_cfg)[0]

    def check_iterations(self, max_iterations: int) -> None:
        """A per-iteration schedule must cover every iteration (checked before training starts)."""
        if len(self.kl_schedule) > 1 and len(self.kl_schedule) < max_iterations:
            raise ConfigError(f"model.spin.ref_policy_kl_penalty has {len(self.kl_schedule)} values for "
                              f"trainer.spin.max_iterations={max_iterations}: give one value, or one per iteration")

    # ----------------------------------------------------------------- iterations
    def set_KL_penalty_by_iteration(self, iteration: int) -> None:
        self.beta = self.kl_schedule[min(iteration, len(self.kl_schedule) - 1)]

    def update_reference_policy(self) -> None:
        self.snapshot_reference_policy()

    # ----------------------------------------------------------------- inference
    def prepare_for_inference(self) -> None:
        self.eval()
        if self.offload_adam_states and self.device.type == "cuda" and self.optimizer is not None:
            self.optimizer_offload.offload()

    def finish_inference(self) -> None:
        expert_lockstep.drain(self.module)
        if self.offload_adam_states and self.device.type == "cuda" and self.optimizer is not None:
            self.optimizer_offload.restore()
        self.train()

    @torch.no_grad()
    def infer(self, prompts: Sequence[Sequence[int]], seed: Optional[int] = None,
              sampling: Optional[SamplingParams] = None, length: Optional[LengthParams] = None) -> GenerationOutput:
        """Responses of the reference policy to token-id prompts (collective over the model-parallel group)."""
        if self.ref_state is None:
            raise RuntimeError("snapshot_reference_policy() was not called")
        with swapped_weights(self.module, self.ref_state):
            return generate(self.module, self.tokenizer, prompts, sampling or self.sampling_params,
                            length or self.length_params, max_sequence_length=int(self.cfg.encoder_seq_length),
                            seed=seed)

    # ----------------------------------------------------------------- validation
    def _sft_loss(self, mb, per_token_ce):
        mean, total, count = masked_token_loss(per_token_ce, mb["loss_mask"])
        return mean, {"loss": mean.detach().clone(), "loss_sum": total.detach(), "tokens": count.detach()}

    def get_loss_and_metrics_vanilla_sft(self, batch: Dict[str, torch.Tensor],
                                         forward_only: bool = True) -> Tuple[float, Dict[str, float]]:
        """Mean negative log-likelihood of the response tokens of an SFT batch (``tokens``, ``labels``,
        ``loss_mask``, ``position_ids``): SPIN's validation, as NeMo-Aligner's."""
        data = {k: batch[k] for k in ("tokens", "labels", "loss_mask", "position_ids")}
        outputs = self.forward_backward(data, self._sft_loss, forward_only, self.micro_batch_size)
        m = self.reduce_metrics(outputs, sum_keys=("loss_sum", "tokens"), mean_keys=("loss",))
        m["loss"] = m["loss_sum"] / max(m["tokens"], 1.0)
        return m["loss"], m
