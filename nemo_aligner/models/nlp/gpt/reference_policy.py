"""A frozen reference policy for DPO-style training: the starting weights kept on the CPU and
swapped into the model to score sequences (one copy of the network on the device)."""

from __future__ import annotations

import torch

from nemo_aligner.models.nlp.gpt.megatron_gpt_ppo_actor import next_token_batch
from nemo_aligner.models.nlp.gpt.expert_lockstep import swapped_weights


REFERENCE_PREFIX = "reference_policy"  # NeMo-Aligner's key prefix for the reference weights in a checkpoint


class ReferencePolicyMixin:
    """For a :class:`MegatronGPTModel`: ``snapshot_reference_policy()`` then ``token_logps(...)``.

    A model whose reference changes during training (SPIN) sets ``saves_reference_policy``: its
    training checkpoints then carry the reference weights too (``reference_policy.<key>``, as
    NeMo-Aligner's), so a resumed run scores against the same reference."""

    ref_state = None
    saves_reference_policy = False

    def checkpoint_extras(self, model_sd: dict) -> dict:
        """Sharded entries a training checkpoint holds beside the model's own weights (``model_sd``,
        this model's sharded state dict)."""
        if not self.saves_reference_policy or self.ref_state is None:
            return {}
        from dataclasses import replace

        from megatron.core.dist_checkpointing.mapping import ShardedObject

        extras = {}
        for key, entry in model_sd.items():  # keys "model.<module's state-dict name>"
            name = key[len("model."):]
            if isinstance(entry, ShardedObject) or name not in self.ref_state:
                continue  # per-layer extra state (Transformer Engine): not weights
            extras[f"{REFERENCE_PREFIX}.{key}"] = replace(entry, key=f"{REFERENCE_PREFIX}.{entry.key}",
                                                          data=self.ref_state[name])
        return extras

    def load_checkpoint_extras(self, loaded: dict) -> None:
        """Take the reference weights back from a loaded checkpoint (:meth:`checkpoint_extras`' keys)."""
        prefix = REFERENCE_PREFIX + ".model."
        for key, value in loaded.items():
            if key.startswith(prefix) and torch.is_tensor(value):
                name = key[len(prefix):]
                if value.data_ptr() != self.ref_state[name].data_ptr():
                    self.ref_state[name].copy_(value)

    def snapshot_reference_policy(self) -> None:
        """Keep the current weights on the CPU as the reference policy."""
        self.ref_state = self.cpu_weights_copy()

    @torch.no_grad()
    def token_logps(self, tokens: torch.Tensor, rows_per_micro_batch: int, reference: bool = False) -> torch.Tensor:
        """Log-prob of each next token, ``[B, L-1]`` float32 on every rank, by the current policy or
        (``reference=True``) the snapshot; dropout off either way."""
        return self.batch_token_logps(next_token_batch(tokens), rows_per_micro_batch, reference)[:, :-1].contiguous()

    @torch.no_grad()
    def batch_token_logps(self, data: dict, rows_per_micro_batch: int, reference: bool = False) -> torch.Tensor:
        """Log-prob of each ``labels`` token of a batch (``tokens``, ``labels``, ``position_ids``, optionally
        ``attention_mask``), ``[B, L]`` float32 on every rank."""
        from megatron.core import parallel_state

        from nemo_aligner.utils.distributed import broadcast_from_last_stage

        if reference and self.ref_state is None:
            raise RuntimeError("snapshot_reference_policy() was not called")
        training = self.module.training
        self.eval()
        if reference:
            with swapped_weights(self.module, self.ref_state):
                outputs = self.forward_backward(data, None, True, rows_per_micro_batch)
        else:
            outputs = self.forward_backward(data, None, True, rows_per_micro_batch)
        if training:
            self.train()
        result = torch.zeros(data["tokens"].shape, dtype=torch.float32)
        if parallel_state.is_pipeline_last_stage():
            result = -torch.cat([o.float() for o in outputs]).cpu()  # results live on the host
        return broadcast_from_last_stage(result)
