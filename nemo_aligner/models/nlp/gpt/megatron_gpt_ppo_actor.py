"""The PPO actor: generates rollouts, scores them with its own and the initial policy's log-probs,
and trains on the clipped surrogate objective. The initial policy's weights live on the CPU and
are swapped in when its log-probs are needed, so there is never a second copy on the device."""

from __future__ import annotations

import functools
import logging
from typing import Dict, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F

from nemo_aligner.models.alignable_interface import AlignableGenerativeInterface
from nemo_aligner.models.nlp.gpt import expert_lockstep
from nemo_aligner.models.nlp.gpt.expert_lockstep import swapped_weights
from nemo_aligner.models.nlp.gpt.megatron_gpt_model import MegatronGPTModel, split_micro_batches
from nemo_aligner.models.nlp.gpt.shared_prompt_forward import packed_forward, prompt_sharing_unsupported
from nemo_aligner.utils import ppo_utils, prompt_sharing
from nemo_aligner.models.nlp.gpt.generation import (GenerationOutput, LengthParams, SamplingParams,
                                                    built_attention_window, generate)

logger = logging.getLogger(__name__)


def vocab_parallel_entropy(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of softmax(logits) over a vocabulary split across tensor-parallel ranks (differentiable)."""
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region

    logits = logits.float()
    peak = logits.detach().max(dim=-1, keepdim=True).values
    if parallel_state.get_tensor_model_parallel_world_size() > 1:
        dist.all_reduce(peak, op=dist.ReduceOp.MAX, group=parallel_state.get_tensor_model_parallel_group())
    shifted = logits - peak
    exp = shifted.exp()
    total = reduce_from_tensor_model_parallel_region(exp.sum(dim=-1))
    probs = exp / total.unsqueeze(-1)
    return total.log() - reduce_from_tensor_model_parallel_region((probs * shifted).sum(dim=-1))


def next_token_batch(tokens: torch.Tensor) -> Dict[str, torch.Tensor]:
    """``tokens``, ``position_ids`` and ``labels`` (the next token; the last position repeats itself)."""
    labels = prompt_sharing.next_tokens(tokens)
    positions = torch.arange(tokens.shape[1]).unsqueeze(0).expand_as(tokens).contiguous()
    return {"tokens": tokens, "position_ids": positions, "labels": labels}


class MegatronGPTActorModel(MegatronGPTModel, AlignableGenerativeInterface):
    """``model.<section>.*`` (``ppo``, or ``reinforce`` for REINFORCE/RLOO): ``rollout_micro_batch_size``,
    ``forward_micro_batch_size``, ``entropy_bonus``, ``ratio_eps``, ``offload_adam_states``,
    ``sampling_params``, ``length_params``, ``share_prompt_prefix``."""

    supports_sequence_parallel = False  # generation decodes one token at a time

    def __init__(self, cfg, tokenizer, precision="32", trainable: bool = True, section: str = "ppo"):
        super().__init__(cfg, tokenizer, precision, trainable)
        ppo = cfg.get(section) or {}
        self.micro_batch_size = int(cfg.get("micro_batch_size", 1))
        self.forward_micro_batch_size = int(ppo.get("forward_micro_batch_size") or self.micro_batch_size)
        self.entropy_bonus = float(ppo.get("entropy_bonus", 0.0) or 0.0)
        self.ratio_eps = float(ppo.get("ratio_eps", 0.2))
        # GRPO: beta * KL(policy || initial) in the loss (k3 estimator) instead of in the reward.
        self.kl_loss_coef = float(ppo.get("reference_policy_kl_penalty", 0.0) or 0.0)
        self.offload_adam_states = bool(ppo.get("offload_adam_states", True))
        self.sampling_params = SamplingParams.from_cfg(ppo.get("sampling_params"))
        self.length_params = LengthParams.from_cfg(ppo.get("length_params"))
        self.init_policy_state: Optional[Dict[str, torch.Tensor]] = None
        # Responses to one prompt (GRPO/RLOO groups) packed so the prompt is computed once.
        self.share_prompt_prefix = bool(ppo.get("share_prompt_prefix", True))
        if self.share_prompt_prefix:
            reason = prompt_sharing_unsupported(self.module, self.transformer_config)
            if reason:
                logger.info("model.%s.share_prompt_prefix: off, %s", section, reason)
                self.share_prompt_prefix = False

    # ----------------------------------------------------------------- initial policy
    uses_reference_policy = True  # log-probs of the initial policy: the KL terms

    def snapshot_initial_policy(self) -> None:
        """Keep a CPU copy of the current weights as the initial (reference) policy."""
        self.init_policy_state = self.cpu_weights_copy()

    # ----------------------------------------------------------------- inference
    def prepare_for_inference(self) -> None:
        self.eval()
        if self.offload_adam_states and self.device.type == "cuda" and self.optimizer is not None:
            self.optimizer_offload.offload()

    def finish_inference(self) -> None:
        expert_lockstep.drain(self.module)
        self.train()

    def prepare_for_training(self) -> None:
        if self.offload_adam_states and self.device.type == "cuda" and self.optimizer is not None:
            self.optimizer_offload.restore()

    def finish_training(self) -> None:
        pass

    @torch.no_grad()
    def infer(self, prompts: Sequence[Sequence[int]], seed: Optional[int] = None,
              sampling: Optional[SamplingParams] = None, length: Optional[LengthParams] = None) -> GenerationOutput:
        """Generate responses for token-id prompts (collective over the tensor-parallel group)."""
        return generate(self.module, self.tokenizer, prompts, sampling or self.sampling_params,
                        length or self.length_params, max_sequence_length=int(self.cfg.encoder_seq_length), seed=seed)

    @torch.no_grad()
    def get_logprobs(self, tokens: torch.Tensor, prompt_lengths: Optional[torch.Tensor] = None,
                     response_lengths: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Log-prob of each next token, [B, T-1], from the training forward (no sampling adjustments).

        With the rows' ``prompt_lengths`` and ``response_lengths`` (prompt + response tokens),
        responses to a repeated prompt are computed with the prompt once (``share_prompt_prefix``);
        positions after a row's response are then 0.
        """
        from megatron.core import parallel_state

        from nemo_aligner.utils.distributed import broadcast_from_last_stage

        batch = next_token_batch(tokens)
        mbs = self.forward_micro_batch_size if tokens.shape[0] % self.forward_micro_batch_size == 0 else 1
        packed = self._pack_by_prompt(batch, prompt_lengths, response_lengths, mbs)
        if packed is None:
            outputs = self.forward_backward(batch, None, True, mbs)
        else:
            micro_batches, shape = packed

            def forward(model, mb):
                logits = packed_forward(model, mb)
                if not parallel_state.is_pipeline_last_stage():
                    return logits
                logprobs, _ = self._token_logprobs(mb, logits)
                return F.pad(-logprobs * mb["valid"][:, :-1], (0, 1))  # [B, T], as the rows' loss

            outputs = self.forward_backward(micro_batches, None, True, mbs, forward_fn=forward,
                                            seq_length=shape.length, sequences_per_micro_batch=shape.groups)
        result = torch.zeros(tokens.shape[0], tokens.shape[1], dtype=torch.float32)
        if parallel_state.is_pipeline_last_stage():
            result = -torch.cat([o.float() for o in outputs], dim=0).cpu()  # results live on the host
        return broadcast_from_last_stage(result)[:, :-1].contiguous()

    def get_init_policy_logprobs(self, tokens: torch.Tensor, prompt_lengths: Optional[torch.Tensor] = None,
                                 response_lengths: Optional[torch.Tensor] = None,
                                 seconds: Optional[dict] = None) -> torch.Tensor:
        """Log-probs under the initial policy, its weights swapped in from the CPU for the call;
        ``seconds`` receives the swap's ``swap_in`` and ``swap_out`` times (``swapped_weights``)."""
        if self.init_policy_state is None:
            raise RuntimeError("snapshot_initial_policy() was not called")
        with swapped_weights(self.module, self.init_policy_state, seconds):
            return self.get_logprobs(tokens, prompt_lengths, response_lengths)

    def _pack_by_prompt(self, batch: Dict[str, torch.Tensor], prompt_lengths: Optional[torch.Tensor],
                        response_lengths: Optional[torch.Tensor], micro_batch_size: int):
        """``batch`` (with ``tokens``) as micro-batches packed by prompt, and their common shape; None
        when packing is off, the lengths are unknown, or it would not compute fewer positions."""
        if not self.share_prompt_prefix or prompt_lengths is None or response_lengths is None:
            return None
        rows = dict(batch, prompt_lengths=prompt_lengths, response_lengths=response_lengths)
        parts = split_micro_batches(rows, micro_batch_size)
        groups = [prompt_sharing.prompt_groups(p["tokens"], p["prompt_lengths"]) for p in parts]
        shapes = [prompt_sharing.pack_shape(p["tokens"], p["prompt_lengths"], p["response_lengths"], g)
                  for p, g in zip(parts, groups)]
        shape = functools.reduce(prompt_sharing.PackShape.merge, shapes)
        width = batch["tokens"].shape[1]
        window = built_attention_window(self.module)
        if window is not None and width > window + 1:  # packed rows would need the window by position
            return None
        if shape.responses < 2 or not prompt_sharing.saves_tokens([shape] * len(parts), len(rows["tokens"]), width):
            return None
        micro_batches = []
        for part, part_groups in zip(parts, groups):
            packed = prompt_sharing.pack(part["tokens"], part["prompt_lengths"], part["response_lengths"], shape,
                                         part_groups)
            micro_batches.append(dict(part, tokens=packed.tokens, position_ids=packed.positions,
                                      attention_mask=packed.attention_mask, source=packed.source,
                                      valid=packed.valid, first_tokens=packed.first_tokens))
        return micro_batches, shape

    # ----------------------------------------------------------------- training
    def _ppo_forward(self, model, mb):
        return model(mb["tokens"], mb["position_ids"], None)  # logits [B, T, V/TP] on the last stage

    def _token_logprobs(self, mb, logits):
        """Log-prob of each next token [B, T-1] and, with an entropy bonus, each prediction's entropy,
        from the rows' logits or from a micro-batch packed by prompt (never expanded to rows' logits)."""
        from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

        if "source" not in mb:
            logits = logits[:, :-1].float()
            entropy = vocab_parallel_entropy(logits) if self.entropy_bonus else None
            return -vocab_parallel_cross_entropy(logits.clone(), mb["labels"][:, :-1]), entropy
        logits = logits.float()  # [G, L, V/TP]
        prompt_slots = mb["attention_mask"].shape[-1] - mb["attention_mask"].shape[-2]
        responses = mb["first_tokens"].shape[1]
        # The last prompt slot predicts every response's first token: one row of logits per response.
        last_prompt = logits[:, prompt_slots - 1].unsqueeze(1).expand(-1, responses, -1)
        losses = prompt_sharing.per_token_values(
            vocab_parallel_cross_entropy(logits.clone(), prompt_sharing.next_tokens(mb["tokens"])),
            vocab_parallel_cross_entropy(last_prompt.clone(), mb["first_tokens"]))
        logprobs = -prompt_sharing.to_rows(losses, mb["source"])[:, :-1]
        entropy = None
        if self.entropy_bonus:
            per_slot = vocab_parallel_entropy(logits)
            values = prompt_sharing.per_token_values(
                per_slot, per_slot[:, prompt_slots - 1].unsqueeze(1).expand(-1, responses))
            entropy = prompt_sharing.to_rows(values, mb["source"])[:, :-1]
        return logprobs, entropy

    def _ppo_loss(self, mb, logits, absolute_kl: bool = True):
        logprobs, entropy = self._token_logprobs(mb, logits)
        mask = mb["mask"] * mb["is_end"].float().unsqueeze(-1)
        # Without rollout log-probs the rollouts are trained on once, in this one optimizer step,
        # by the weights that generated them: the old policy's log-probs are these (ratio 1).
        old = mb["logprobs"] if "logprobs" in mb else logprobs.detach()
        loss, stats = ppo_utils.ppo_actor_loss(logprobs, old, mb["advantages"], mask, self.ratio_eps,
                                               entropy=entropy, entropy_bonus=self.entropy_bonus,
                                               init_logprobs=mb.get("init_logprobs"), kl_loss_coef=self.kl_loss_coef)
        if "logprobs" not in mb:  # the rollout-time KL metric, from this forward instead
            kl = ppo_utils.calculate_kl_penalty(logprobs.detach(), mb["init_logprobs"], absolute_kl)
            stats["init_policy_kl"] = ppo_utils.masked_mean(kl, mb["mask"])
        stats["tokens"] = mask.sum()  # weights the per-token metrics (over ``mask``) across micro-batches
        return loss, {"loss": loss.detach().clone(), **{k: v.detach() for k, v in stats.items()}}

    def get_loss_and_metrics(self, batch: Dict[str, torch.Tensor], forward_only: bool,
                             use_absolute_kl: bool = True) -> Tuple[float, Dict[str, float]]:
        """One global batch of PPO data (``tokens``, ``logprobs``, ``advantages``, ``mask``, ``is_end``;
        with ``prompt_lengths`` and ``response_lengths`` the rows may be packed by prompt).

        ``logprobs`` None: the rollouts' own log-probs were not computed (one update per rollout
        batch); the old policy is this forward's detached log-probs, and the KL-to-initial-policy
        metric (``init_policy_kl``, absolute when ``use_absolute_kl``) is measured here.
        """
        data = dict(next_token_batch(batch["tokens"]))
        data.update({k: batch[k] for k in ("advantages", "mask")})
        reuse = batch.get("logprobs") is None
        if not reuse:
            data["logprobs"] = batch["logprobs"]
        if self.kl_loss_coef or reuse:
            data["init_logprobs"] = batch["init_logprobs"]
        data["is_end"] = batch["is_end"].float()
        loss_fn = functools.partial(self._ppo_loss, absolute_kl=bool(use_absolute_kl))
        packed = self._pack_by_prompt(data, batch.get("prompt_lengths"), batch.get("response_lengths"),
                                      self.micro_batch_size)
        if packed is None:
            outputs = self.forward_backward(data, loss_fn, forward_only, self.micro_batch_size,
                                            forward_fn=self._ppo_forward)
        else:
            micro_batches, shape = packed
            outputs = self.forward_backward(micro_batches, loss_fn, forward_only, self.micro_batch_size,
                                            forward_fn=packed_forward, seq_length=shape.length,
                                            sequences_per_micro_batch=shape.groups)
        per_token = ("clip_fraction", "approx_kl", "entropy", "ratio_mean") + (("kl_loss",) if self.kl_loss_coef else ())
        m = self.reduce_metrics(outputs, mean_keys=("loss",) + (("init_policy_kl",) if reuse else ()),
                                token_mean_keys=per_token)
        return m["loss"], m
