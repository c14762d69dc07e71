"""Reward models: pairwise (Bradley-Terry) ranking and multi-attribute regression (SteerLM)."""

from __future__ import annotations

from typing import Dict, Optional, Tuple

import torch
import torch.nn.functional as F

from nemo_aligner.models.alignable_interface import Inferrable, SupervisedInterface
from nemo_aligner.models.nlp.gpt.gpt_builder import build_gpt_model, precision_dtype
from nemo_aligner.models.nlp.gpt.gpt_reward_model import GPTRewardModel
from nemo_aligner.models.nlp.gpt.megatron_gpt_model import MegatronGPTModel
from nemo_aligner.utils.errors import ConfigError
from nemo_aligner.utils.preference_losses import BT_LOSSES, preference_pair_sums

REWARD_MODEL_TYPES = ("binary_ranking", "regression")


def pairwise_sums(chosen: torch.Tensor, rejected: torch.Tensor, weight: Optional[torch.Tensor] = None):
    """Sums over (weighted) pairs: ``loss_sum`` of ``-log sigmoid(r_chosen - r_rejected)``, ``correct``
    (``r_chosen > r_rejected``) and ``pairs``; the training loss and the logged metrics both come from these."""
    weight = torch.ones_like(chosen) if weight is None else weight.to(chosen.dtype)
    return {"loss_sum": -(weight * F.logsigmoid(chosen - rejected)).sum(),
            "correct": (weight * (chosen > rejected).to(chosen.dtype)).sum(), "pairs": weight.sum()}


def pairwise_loss(chosen: torch.Tensor, rejected: torch.Tensor, weight: Optional[torch.Tensor] = None):
    """``-log sigmoid(r_chosen - r_rejected)`` averaged over (weighted) pairs, and the accuracy."""
    sums = pairwise_sums(chosen, rejected, weight)
    count = sums["pairs"].clamp(min=1.0)
    return sums["loss_sum"] / count, sums["correct"] / count


def masked_mse(pred: torch.Tensor, labels: torch.Tensor, mask_value: float = -100.0):
    """Mean squared error over the entries whose label is not ``mask_value``; per-attribute sums and counts."""
    mask = (labels != mask_value).to(pred.dtype)
    squared = (pred - labels) ** 2 * mask
    loss = squared.sum() / mask.sum().clamp(min=1.0)
    return loss, squared.sum(0), mask.sum(0)


HELPFULNESS_INDEX = 4  # the reward a BT loss trains: "helpfulness" among NeMo's nine SteerLM attributes


def regression_attribute_names(cfg) -> list:
    """A regression reward model's attribute names from its config: ``model.regression.attribute_names``,
    NeMo's 9 SteerLM attributes for 9 unnamed outputs, else ``attr<i>``."""
    regression = cfg.get("regression") or {}
    count = int(regression.get("num_attributes", 1) or 1)
    names = regression.get("attribute_names")
    if names is not None and len(names) == count:
        return [str(n) for n in names]
    if count == 9 and names is None:
        from nemo_aligner.data.nlp.reward_datasets import STEERLM_ATTRIBUTES

        return list(STEERLM_ATTRIBUTES)
    return [f"attr{i}" for i in range(count)]


class MegatronGPTRewardModel(MegatronGPTModel, SupervisedInterface, Inferrable):
    """A GPT with a reward head (``model.reward_model_type``: ``binary_ranking`` or ``regression``).

    ``model.force_head_dtype`` (float32) keeps the head in full precision under bf16;
    ``model.use_avg_pool`` pools over the sequence instead of reading the last token;
    ``model.reward_standardization.{enable, mean, std}`` rescales rewards at inference.
    """

    supports_sequence_parallel = False  # the head would see sequence-scattered hidden states
    lora_trainable = ("rm_head",)  # with LoRA the head trains beside the adapters (as peft's modules_to_save)

    def __init__(self, cfg, tokenizer, precision="32", trainable: bool = True):
        self.reward_model_type = str(cfg.get("reward_model_type", "binary_ranking") or "binary_ranking")
        if self.reward_model_type not in REWARD_MODEL_TYPES:
            raise ConfigError(f"model.reward_model_type={self.reward_model_type!r} must be one of {list(REWARD_MODEL_TYPES)}")
        regression = cfg.get("regression") or {}
        self.num_attributes = int(regression.get("num_attributes", 1) or 1) if self.reward_model_type == "regression" else 1
        self.loss_mask_val = float(regression.get("loss_mask_val", -100.0))
        self.regression_loss = str(regression.get("loss_func", "regression") or "regression")
        head = cfg.get("force_head_dtype", "float32")
        self.head_dtype = precision_dtype(precision) if head in (None, "null") else precision_dtype(
            head, key="model.force_head_dtype")
        super().__init__(cfg, tokenizer, precision, trainable)
        self.micro_batch_size = int(cfg.get("micro_batch_size", 1))
        std = cfg.get("reward_standardization") or {}
        self.standardize = bool(std.get("enable", False))
        if self.standardize and (std.get("mean") is None or std.get("std") is None):
            raise ConfigError("model.reward_standardization.enable=True needs model.reward_standardization.mean and .std")
        self.reward_mean = float(std.get("mean") or 0.0)
        self.reward_std = float(std.get("std") or 1.0)

    # ----------------------------------------------------------------- building
    def head_kwargs(self) -> dict:
        regression = self.cfg.get("regression") or {}
        weights = regression.get("attribute_weights")
        return dict(
            model_cls=GPTRewardModel,
            num_attributes=self.num_attributes,
            head_dtype=self.head_dtype,
            use_avg_pool=bool(self.cfg.get("use_avg_pool", False)),
            output_sequence=bool(self.cfg.get("output_sequence", False)),
            merge_attributes=bool(regression.get("merge_attributes", False)) and self.reward_model_type == "regression",
            attribute_weights=list(weights) if weights is not None else None,
            head_seed=int(self.cfg.get("seed", 1234) or 1234),
        )

    @property
    def output_width(self) -> int:
        """Values per sequence: 1, or the number of attributes of an unmerged regression head."""
        return 1 if self.head_kwargs()["merge_attributes"] else self.num_attributes

    def build_module(self) -> torch.nn.Module:
        return build_gpt_model(self.cfg, vocab_size=self.cfg.padded_vocab_size, precision=self.precision,
                               config=self.transformer_config, **self.head_kwargs())

    def restore_fp32_parts(self, module: torch.nn.Module) -> None:
        if getattr(module, "rm_head", None) is not None:
            module.rm_head.to(self.head_dtype)

    # ----------------------------------------------------------------- forward
    @staticmethod
    def _pairs_forward(model, mb):
        tokens = torch.cat([mb["chosen"], mb["rejected"]], dim=0)
        lengths = torch.cat([mb["chosen_length"], mb["rejected_length"]], dim=0)
        positions = torch.cat([mb["position_ids"], mb["position_ids"]], dim=0)
        return model(tokens, lengths, positions, None)

    @staticmethod
    def _single_forward(model, mb):
        return model(mb["tokens"], mb["lengths"], mb["position_ids"], None)

    def _ranking_loss(self, mb, output):
        rewards = output.float().reshape(output.shape[0], -1)[:, 0]
        half = rewards.shape[0] // 2
        chosen, rejected = rewards[:half], rewards[half:]
        weight = mb["weight"]
        sums = pairwise_sums(chosen, rejected, weight)
        loss = sums["loss_sum"] / sums["pairs"].clamp(min=1.0)
        return loss, {
            "loss": loss.detach().clone(),
            **{k: v.detach() for k, v in sums.items()},
            "chosen_sum": (weight * chosen).sum().detach(),
            "rejected_sum": (weight * rejected).sum().detach(),
        }

    def _regression_loss(self, mb, output):
        pred = output.float()
        if pred.shape != mb["labels"].shape:  # broadcasting would silently fit the wrong values
            raise ConfigError(f"the reward head outputs {list(pred.shape)} values per micro-batch but the labels are "
                              f"{list(mb['labels'].shape)}: check model.regression.num_attributes")
        loss, per_attr_sq, per_attr_n = masked_mse(pred, mb["labels"], self.loss_mask_val)
        metrics = {"loss": loss.detach().clone(), "sq_sum": per_attr_sq.sum().detach(), "count": per_attr_n.sum().detach()}
        for i in range(self.num_attributes):
            metrics[f"sq_{i}"] = per_attr_sq[i].detach()
            metrics[f"n_{i}"] = per_attr_n[i].detach()
        return loss, metrics

    def preference_index(self) -> int:
        """The output a Bradley-Terry loss trains: "helpfulness" where the attributes are named, else 4."""
        names = self.attribute_names()
        return names.index("helpfulness") if "helpfulness" in names else HELPFULNESS_INDEX

    def _pair_bt_loss(self, mb, output):
        """Consecutive records (0, 1), (2, 3), ... are pairs; the first's attribute 0 is the strength."""
        rewards = output.float()[:, self.preference_index()]
        labels = mb["labels"]
        strength = labels[0::2, 0]
        weight = (strength != self.loss_mask_val).to(rewards.dtype)  # padding pairs carry no loss
        sums = preference_pair_sums(rewards[0::2], rewards[1::2], strength * weight, self.regression_loss, weight)
        loss = sums["loss_sum"] / sums["pairs"].clamp(min=1.0)
        return loss, {"loss": loss.detach().clone(), **{k: v.detach() for k, v in sums.items()}}

    def get_loss_and_metrics(self, batch: Dict[str, torch.Tensor], forward_only: bool) -> Tuple[float, Dict[str, float]]:
        if self.reward_model_type == "regression" and self.regression_loss in BT_LOSSES:
            outputs = self.forward_backward(batch, self._pair_bt_loss, forward_only, self.micro_batch_size,
                                            forward_fn=self._single_forward)
            m = self.reduce_metrics(outputs, sum_keys=("loss_sum", "correct", "pairs"), mean_keys=("loss",))
            pairs = max(m["pairs"], 1.0)
            return m["loss"], {"loss": m["loss_sum"] / pairs, "accuracy": m["correct"] / pairs, "pairs": m["pairs"]}
        if self.reward_model_type == "binary_ranking":
            outputs = self.forward_backward(
                batch, self._ranking_loss, forward_only, self.micro_batch_size, forward_fn=self._pairs_forward,
                seq_length=batch["chosen"].shape[1], sequences_per_micro_batch=2 * self.micro_batch_size)
            m = self.reduce_metrics(outputs, sum_keys=("loss_sum", "correct", "pairs", "chosen_sum", "rejected_sum"),
                                    mean_keys=("loss",))
            pairs = max(m["pairs"], 1.0)
            # "loss" is the exact mean over the pairs of the global batch (padding excluded).
            return m["loss"], {"loss": m["loss_sum"] / pairs, "accuracy": m["correct"] / pairs,
                               "rewards_chosen_mean": m["chosen_sum"] / pairs,
                               "rewards_rejected_mean": m["rejected_sum"] / pairs, "pairs": m["pairs"]}
        outputs = self.forward_backward(batch, self._regression_loss, forward_only, self.micro_batch_size,
                                        forward_fn=self._single_forward)
        per_attr = [f"sq_{i}" for i in range(self.num_attributes)] + [f"n_{i}" for i in range(self.num_attributes)]
        m = self.reduce_metrics(outputs, sum_keys=("sq_sum", "count", *per_attr), mean_keys=("loss",))
        mse = m["sq_sum"] / max(m["count"], 1.0)
        metrics = {"loss": mse, "mse": mse, "labels": m["count"]}
        for i, name in enumerate(self.attribute_names()):
            metrics[f"mse_{name}"] = m[f"sq_{i}"] / max(m[f"n_{i}"], 1.0)
            metrics[f"labels_{name}"] = m[f"n_{i}"]  # what mse_<name> is a mean over (validation weights it)
        return m["loss"], metrics

    def attribute_names(self):
        """Names of the regression attributes (``model.regression.attribute_names`` or ``attr<i>``)."""
        return regression_attribute_names(self.cfg)

    # ----------------------------------------------------------------- inference
    def prepare_for_inference(self) -> None:
        self.eval()

    def finish_inference(self) -> None:
        self.train()

    @torch.no_grad()
    def infer(self, tokens: torch.Tensor, lengths: torch.Tensor, micro_batch_size: Optional[int] = None) -> torch.Tensor:
        """Rewards [B] (or [B, A] for unmerged multi-attribute heads) for right-padded ``tokens`` [B, S].

        Collective over the model-parallel group; every rank of it gets the result. ``B``
        must be a multiple of ``micro_batch_size`` (the server pads the batch).
        """
        from megatron.core import parallel_state

        from nemo_aligner.utils.distributed import broadcast_from_last_stage

        mbs = micro_batch_size or tokens.shape[0]
        seq = tokens.shape[1]
        batch = {"tokens": tokens.long(), "lengths": lengths.long(),
                 "position_ids": torch.arange(seq).unsqueeze(0).expand(tokens.shape[0], seq).contiguous()}
        outputs = self.forward_backward(batch, None, True, mbs, forward_fn=self._single_forward)
        rewards = torch.zeros(tokens.shape[0], self.output_width, dtype=torch.float32)
        if parallel_state.is_pipeline_last_stage():
            rewards = torch.cat([o.float().reshape(o.shape[0], -1) for o in outputs], dim=0).cpu()  # on the host
        rewards = broadcast_from_last_stage(rewards)
        if self.standardize:
            rewards = (rewards - self.reward_mean) / self.reward_std
        return rewards[:, 0] if rewards.shape[1] == 1 else rewards
