"""SPINTrainer (self-play fine-tuning, NeMo-Aligner's): ``max_iterations`` rounds of
``max_epochs`` epochs over SFT data. Each step, the reference policy (the previous round's
weights) answers the step's prompts; the policy is trained with the DPO loss to prefer the
data's answers over those generations. At the end of a round the policy becomes the reference."""

from __future__ import annotations

import logging
from typing import Dict, List, Tuple

from nemo_aligner.algorithms.supervised import SupervisedTrainer
from nemo_aligner.data.nlp.builders import limit_batches, sampler_of
from nemo_aligner.data.nlp.spin_dataset import spin_pairs
from nemo_aligner.utils.errors import ConfigError

logger = logging.getLogger(__name__)


def plan_spin_steps(cfg, train_dataloader) -> Tuple[int, int, int]:
    """``(max_steps, steps_per_epoch, steps_per_iteration)`` of ``trainer.spin``: every iteration is
    ``max_epochs`` epochs; ``max_steps`` (>= 0) caps the whole run."""
    iterations = int(cfg.get("max_iterations", 1) or 0)
    if iterations < 1:
        raise ConfigError(f"trainer.spin.max_iterations={cfg.get('max_iterations')} must be >= 1")
    epochs = cfg.get("max_epochs")
    if epochs is None or int(epochs) < 1:
        raise ConfigError(f"trainer.spin.max_epochs={epochs} must be >= 1 (epochs per iteration)")
    steps_per_epoch = limit_batches(cfg.get("limit_train_batches"), sampler_of(train_dataloader).batches_per_epoch)
    per_iteration = steps_per_epoch * int(epochs)
    max_steps = per_iteration * iterations
    cap = cfg.get("max_steps")
    if cap is not None and int(cap) >= 0:
        max_steps = min(max_steps, int(cap))
    return max_steps, steps_per_epoch, per_iteration


def answer_agreement(generated: List[List[int]], answers: List[List[int]]) -> Dict[str, float]:
    """How close the generations are to the data's answers: ``generated_answer_match``, the fraction
    identical to their answer (such pairs carry no signal: SPIN has converged on them), and
    ``generated_token_agreement``, the fraction of answer tokens a generation has at the same place."""
    exact = sum(g == a for g, a in zip(generated, answers))
    same = sum(sum(x == y for x, y in zip(g, a)) for g, a in zip(generated, answers))
    total = sum(len(a) for a in answers)
    n = max(len(answers), 1)
    return {"generated_answer_match": exact / n, "generated_token_agreement": same / max(total, 1)}


class SPINTrainer(SupervisedTrainer):
    """Train a ``SelfPlayInterface`` model; ``cfg`` is ``trainer.spin`` (``max_iterations``,
    ``max_epochs`` per iteration, ``max_steps``, ``val_check_interval``, ``save_interval``,
    ``limit_train_batches``, ``limit_val_batches``, ``gradient_clip_val``, ``max_time``). Batches come
    from :func:`~nemo_aligner.data.nlp.spin_dataset.collate_spin`; validation is the SFT loss."""

    def __init__(self, cfg, model, optimizer, scheduler, train_dataloader, val_dataloader, logger_,
                 ckpt_callback, run_timer=None, seed: int = 1234, name: str = "spin"):
        super().__init__(cfg, model, optimizer, scheduler, train_dataloader, val_dataloader, logger_,
                         ckpt_callback, run_timer, name=name)
        self.max_steps, _, self.steps_per_iteration = plan_spin_steps(cfg, train_dataloader)
        self.max_iterations = int(cfg.get("max_iterations", 1))
        self.seed = int(seed)
        self.pad_id = model.tokenizer.eos_id
        self.seq_length = int(model.cfg.encoder_seq_length)

    @property
    def iteration(self) -> int:
        return self.step // self.steps_per_iteration

    def state_dict(self) -> dict:
        return dict(super().state_dict(), iteration=self.iteration)

    def load_checkpoint(self, path: str) -> None:
        super().load_checkpoint(path)  # the checkpoint holds this iteration's reference policy too
        logger.info("SPIN resumed in iteration %d of %d", self.iteration, self.max_iterations)

    # ----------------------------------------------------------------- steps
    def _step_seed(self) -> int:
        from megatron.core import parallel_state

        # one seed per step and data-parallel rank: a resumed run samples the same generations
        return (self.seed * 1_000_003 + self.step * 1009 + parallel_state.get_data_parallel_rank()) % (2 ** 31)

    def generate(self, prompts: List[List[int]]) -> Tuple[List[List[int]], Dict[str, float]]:
        """The reference policy's responses to ``prompts``, ``rollout_micro_batch_size`` prompts per call."""
        chunk = self.model.rollout_micro_batch_size
        responses: List[List[int]] = []
        ended = 0
        self.model.prepare_for_inference()
        try:
            for start in range(0, len(prompts), chunk):
                out = self.model.infer(prompts[start:start + chunk], seed=self._step_seed() + start)
                for row in range(out.tokens.shape[0]):
                    p, r = int(out.prompt_lengths[row]), int(out.response_lengths[row])
                    responses.append(out.tokens[row, p:r].tolist())
                ended += int(out.is_end.sum())
        finally:
            self.model.finish_inference()
        lengths = [len(r) for r in responses]
        return responses, {"generated_length": sum(lengths) / max(len(lengths), 1),
                           "generated_ended": ended / max(len(lengths), 1)}

    def train_single_step(self, batch) -> Tuple[float, Dict[str, float]]:
        iteration = self.iteration
        self.model.set_KL_penalty_by_iteration(iteration)
        generated, gen_metrics = self.generate(batch["prompts"])
        gen_metrics.update(answer_agreement(generated, batch["answers"]))
        pairs = spin_pairs(batch["prompts"], batch["answers"], generated, self.pad_id, self.seq_length)
        loss, metrics = super().train_single_step(pairs)
        if (self.step + 1) % self.steps_per_iteration == 0:
            # the round ends with this step: its weights answer the next round's prompts (before the
            # checkpoint of this step, so a resumed run starts the next round with them)
            self.model.update_reference_policy()
        metrics.update(gen_metrics, iteration=float(iteration), beta=float(self.model.beta))
        return loss, metrics

    def validation_loss(self, batch) -> Tuple[float, Dict[str, float]]:
        return self.model.get_loss_and_metrics_vanilla_sft(batch, forward_only=True)

    def summary(self, seconds: float) -> Dict[str, float]:
        # iterations begun: one that max_steps or max_time cut short counts (2 steps of a 25-step iteration: 1)
        begun = -(-self.step // self.steps_per_iteration)
        return dict(super().summary(seconds), iterations=min(begun, self.max_iterations))
