"""PPOTrainer: the actor's side of PPO (DESIGN section 4).

One step::

    rollouts  = generate(prompts)                     # micro-batches, each sent to the critic at once
    logprobs  = actor.logprobs(rollouts)              # training forward (skipped with one update per
                                                      #   rollout batch and no KL in the reward)
    init_lp   = actor.init_policy_logprobs(rollouts)  # initial weights swapped in from the CPU
    rewards, values = futures.result()
    advantages, returns = GAE(rewards - beta * KL, values)
    critic.train(returns, values) (asynchronous) ; actor.train(clipped surrogate) ; log ; validate ; save
"""

from __future__ import annotations

import dataclasses
import logging
import time
from contextlib import contextmanager
from typing import Dict, List, Optional, Tuple

import numpy as np
import torch
import torch.distributed as dist

from nemo_aligner.algorithms.supervised import progress_bar
from nemo_aligner.data.nlp.builders import sampler_of
from nemo_aligner.algorithms.callbacks import CallbackList
from nemo_aligner.algorithms.step_plumbing import StepSchedule, optimizer_update
from nemo_aligner.utils import ppo_utils
from nemo_aligner.utils.distributed import comm_device, host_all_reduce, is_global_rank_zero
from nemo_aligner.utils.errors import ConfigError
from nemo_aligner.models.alignable_interface import SamplingParams
from nemo_aligner.utils.run_control import NonFiniteGuard, RunTimer, compute_max_steps, interval_steps
from nemo_aligner.utils.shared_work import SharedWork
from nemo_aligner.utils.train_checkpoint import load_train_checkpoint, run_identity

logger = logging.getLogger(__name__)


def _mp_group_and_src():
    """This data-parallel replica's model-parallel group and the global rank that talks to servers."""
    from megatron.core import parallel_state

    group = parallel_state.get_model_parallel_group()
    return group, dist.get_global_rank(group, 0)


def mp_broadcast(obj):
    """Share an object from the model-parallel source rank with the rest of its model-parallel group."""
    group, src = _mp_group_and_src()
    if dist.get_world_size(group) == 1:
        return obj
    holder = [obj]
    dist.broadcast_object_list(holder, src=src, group=group)
    return holder[0]


def is_mp_source() -> bool:
    return dist.get_rank() == _mp_group_and_src()[1]


def pad_columns(t: torch.Tensor, width: int, value) -> torch.Tensor:
    if t.shape[1] >= width:
        return t
    return torch.nn.functional.pad(t, (0, width - t.shape[1]), value=value)


class SharedAnswers:
    """The server's answers for micro-batches shared out by ``SharedWork``: each rank waits for those
    it sent, then every rank gets those of its own rows (collective over the data-parallel group)."""

    def __init__(self, work: SharedWork, futures: Dict[int, object]):
        self.work = work
        self.futures = futures

    def collect(self) -> Optional[list]:
        sent = {index: f.result() for index, f in self.futures.items()} if is_mp_source() else None
        return self.work.mine(sent)


class Timer:
    """Seconds spent per named phase in the current step."""

    def __init__(self):
        self.seconds: Dict[str, float] = {}

    @contextmanager
    def __call__(self, name: str):
        start = time.monotonic()
        try:
            yield
        finally:
            self.seconds[name] = self.seconds.get(name, 0.0) + time.monotonic() - start


class PPOTrainer(StepSchedule):
    """Runs PPO steps for an actor (``MegatronGPTActorModel``) against a critic/reward server."""

    def __init__(self, cfg, model, optimizer, scheduler, train_dataloader, val_dataloader, rm_critic, logger_,
                 ckpt_callback, run_timer: Optional[RunTimer] = None, ppo_cfg=None, seed: int = 1234,
                 responses_per_prompt: int = 1, name: str = "ppo"):
        from megatron.core import parallel_state

        self.cfg = cfg
        self.model = model
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.train_dataloader = train_dataloader
        self.val_dataloader = val_dataloader
        self.rm_critic = rm_critic
        self.logger = logger_
        self.ckpt_callback = ckpt_callback
        self.timer = run_timer or RunTimer(None)
        self.seed = int(seed)
        ppo_cfg = ppo_cfg or {}
        self.rollout_micro_batch_size = int(ppo_cfg.get("rollout_micro_batch_size", 8))
        self.val_rollout_micro_batch_size = int(ppo_cfg.get("val_rollout_micro_batch_size")
                                                or self.rollout_micro_batch_size)
        self.dp = parallel_state.get_data_parallel_world_size()
        self.dp_group = parallel_state.get_data_parallel_group()
        self.dp_rank = parallel_state.get_data_parallel_rank()
        self.sampler = sampler_of(train_dataloader)
        self.name = name
        self.has_critic = True  # critic-free subclasses (REINFORCE, GRPO) set False
        self.prompts_per_step = self.sampler.global_batch_size
        self.responses_per_prompt = int(responses_per_prompt)
        self.num_rollout_samples = self.prompts_per_step * self.responses_per_prompt
        self.global_batch_size = int(model.cfg.global_batch_size)
        rows, what = self.trained_rows_per_step()
        if rows % self.global_batch_size:
            raise ConfigError(f"{what} is not a multiple of model.global_batch_size={self.global_batch_size}")
        if (self.global_batch_size // self.dp) % model.micro_batch_size:
            raise ConfigError(f"model.global_batch_size={self.global_batch_size} / data parallel {self.dp} is not "
                              f"a multiple of model.micro_batch_size={model.micro_batch_size}")
        self.steps_per_epoch = self.sampler.batches_per_epoch
        self.max_steps = compute_max_steps(cfg.get("max_steps"), cfg.get("max_epochs"), self.steps_per_epoch,
                                           key=f"trainer.{name}")
        # ints, or a fraction of an epoch (Lightning's float form, as the supervised trainers take)
        self.val_check_interval = interval_steps(cfg.get("val_check_interval"), self.steps_per_epoch)
        self.save_interval = interval_steps(cfg.get("save_interval"), self.steps_per_epoch)
        self.critic_warmup_steps = int(cfg.get("critic_warmup_steps", 0) or 0)
        self.val_at_start = bool(cfg.get("val_at_start", True))
        self.kl_penalty = float(cfg.get("initial_policy_kl_penalty", 0.01))
        # One optimizer step per rollout batch and no KL in the reward: the rollouts' log-probs
        # equal the training forward's (same weights), so that forward pass is skipped.
        self.rollout_logprobs_needed = self.num_rollout_samples != self.global_batch_size or self.kl_penalty != 0.0
        self.use_absolute_kl = bool(cfg.get("use_absolute_kl", True))
        self.discount = float(cfg.get("discount_factor", 1.0))
        self.gae_lambda = float(cfg.get("gae_lambda", 0.95))
        self.normalize_advantages = bool(cfg.get("normalize_advantages", True))
        # NeMo-Aligner's batch_iterator.use_flask: the data-parallel ranks share out the rollout
        # micro-batches as they go (see utils/shared_work.py), then each trains on its own rows.
        self.share_rollouts = bool((cfg.get("batch_iterator") or {}).get("use_flask", False))
        ep = parallel_state.get_expert_model_parallel_world_size()
        if self.share_rollouts and ep > 1:
            # sharing talks over the data-parallel ranks between generation calls, while expert-parallel
            # ranks generate in rounds of their expert group (expert_lockstep)
            raise ConfigError(f"trainer.{name}.batch_iterator.use_flask=True is not supported with "
                              f"model.expert_model_parallel_size={ep}; set it to False")
        self.step = 0
        self.consumed_samples = 0
        self.ppo_optimization_step = 0
        self.last_val: Dict[str, float] = {}
        self.best_val_reward: Optional[float] = None
        self.callbacks = CallbackList()  # the Python API sets its own
        self.nonfinite = NonFiniteGuard(cfg.get("max_consecutive_nonfinite_steps", 10),
                                        f"trainer.{name}.max_consecutive_nonfinite_steps", what="actor updates",
                                        advice="check the rewards")

    def trained_rows_per_step(self) -> Tuple[int, str]:
        """Rollouts trained on per step (a whole number of global batches), and the keys that set it."""
        what = (f"model.{self.name}.num_rollout_samples={self.prompts_per_step}" if self.responses_per_prompt == 1 else
                f"model.{self.name}.num_rollout_samples={self.prompts_per_step} x "
                f"num_responses_per_prompt={self.responses_per_prompt}")
        return self.num_rollout_samples, what

    # ----------------------------------------------------------------- state
    @property
    def epoch(self) -> int:
        return self.consumed_samples // max(self.steps_per_epoch * self.prompts_per_step, 1)

    def state_dict(self) -> dict:
        return {"step": self.step, "consumed_samples": self.consumed_samples, "epoch": self.epoch,
                "ppo_optimization_step": self.ppo_optimization_step, "best_val_reward": self.best_val_reward,
                **run_identity(self.name, self.sampler)}

    def load_checkpoint(self, path: str) -> None:
        state = load_train_checkpoint(path, self.model, self.optimizer, self.scheduler,
                                      identity=run_identity(self.name, self.sampler), key=f"trainer.{self.name}")
        self.step = int(state["step"])
        self.consumed_samples = int(state["consumed_samples"])
        self.ppo_optimization_step = int(state.get("ppo_optimization_step", 0))
        self.best_val_reward = state.get("best_val_reward")
        logger.info("actor resumed at %s step %d (%d prompts consumed)", self.name.upper(), self.step, self.consumed_samples)

    # ----------------------------------------------------------------- rollouts
    def generate_rollouts(self, prompts: List[List[int]], micro_batch_size: int, seed: int,
                          sampling: Optional[SamplingParams], timer: Timer,
                          metadata: Optional[List[dict]] = None) -> Dict[str, torch.Tensor]:
        """Generate for this rank's prompts; each micro-batch goes to the critic/RM server at once
        (with its rows' prompt ``metadata``, for reward functions and environments).

        With ``batch_iterator.use_flask`` the micro-batches of all data-parallel ranks are shared
        out as ranks become free; each rank still ends with the rows of its own prompts, generated
        with the seeds it would have used itself."""
        chunks = [(prompts[i : i + micro_batch_size], metadata[i : i + micro_batch_size] if metadata is not None
                   else None, seed + i) for i in range(0, len(prompts), micro_batch_size)]
        work = SharedWork(chunks, self.dp_group, is_mp_source(), mp_broadcast) if self.share_rollouts else None
        outputs, futures = {}, {}
        for index, (chunk, rows, chunk_seed) in (work if work is not None else enumerate(chunks)):
            with timer("generate"):
                out = self.model.infer(chunk, seed=chunk_seed, sampling=sampling)
            outputs[index] = out
            futures[index] = self.request_scores(out, rows) if is_mp_source() else None
        if work is None:
            batch = self.rollout_batch(list(outputs.values()))
            batch["_futures"] = list(futures.values())
        else:
            with timer("generate_share"):
                batch = self.rollout_batch(work.mine(outputs))
            batch["_futures"] = SharedAnswers(work, futures)
        return batch

    def rollout_batch(self, outputs: List) -> Dict[str, torch.Tensor]:
        """One batch from the generated micro-batches (right-padded to the longest)."""
        if not outputs:  # a rank with no prompts (the end of a validation set) that shared out work
            empty = torch.zeros(0, dtype=torch.long)
            return {"tokens": torch.zeros(0, 1, dtype=torch.long), "prompt_lengths": empty,
                    "response_lengths": empty, "is_end": torch.zeros(0, dtype=torch.bool)}
        width = max(o.tokens.shape[1] for o in outputs)
        tokens = torch.cat([pad_columns(o.tokens, width, self.model.tokenizer.eos_id) for o in outputs])
        return {
            "tokens": tokens,
            "prompt_lengths": torch.cat([o.prompt_lengths for o in outputs]),
            "response_lengths": torch.cat([o.response_lengths for o in outputs]),
            "is_end": torch.cat([o.is_end for o in outputs]),
        }

    def request_scores(self, out, metadata: Optional[List[dict]] = None):
        """Ask the critic/reward server about one generated micro-batch; returns a future (the
        server scores tokens: ``metadata`` is for reward functions and environments)."""
        return self.rm_critic.infer_rm_critic(out.tokens.numpy(), out.response_lengths.numpy())

    def resolve_rewards(self, batch: Dict, timer: Timer) -> None:
        """Wait for the server's answers; add ``rewards`` [B] and ``values`` [B, T] to the batch."""
        answers = None
        futures = batch.pop("_futures")
        with timer("critic_infer_wait"):
            if isinstance(futures, SharedAnswers):
                answers = futures.collect()
            elif is_mp_source():
                answers = [f.result() for f in futures]
            answers = mp_broadcast(answers)
        if answers:
            self.store_answers(batch, answers)
        else:  # no rows on this rank
            batch["rewards"] = torch.zeros(0)
            batch["values"] = torch.zeros(0, batch["tokens"].shape[1])

    def store_answers(self, batch: Dict, answers: list) -> None:
        width = batch["tokens"].shape[1]
        batch["rewards"] = torch.tensor(np.concatenate([r for r, _ in answers]), dtype=torch.float32)
        batch["values"] = torch.cat([pad_columns(torch.tensor(v, dtype=torch.float32), width, 0.0) for _, v in answers])

    def make_rollout_batch(self, prompts: List[List[int]], timer: Timer, step_seed: int,
                           metadata: Optional[List[dict]] = None) -> Dict[str, torch.Tensor]:
        self.model.prepare_for_inference()
        try:
            batch = self.generate_rollouts(prompts, self.rollout_micro_batch_size, step_seed, None, timer, metadata)
            batch["logprobs"] = None
            if self.rollout_logprobs_needed:
                with timer("logprobs"):
                    batch["logprobs"] = self.model.get_logprobs(*self.rollout_rows(batch))
            swap = {}
            with timer("init_logprobs"):
                batch["init_logprobs"] = self.model.get_init_policy_logprobs(*self.rollout_rows(batch), seconds=swap)
            timer.seconds.update({f"init_policy_{k}": v for k, v in swap.items()})  # parts of init_logprobs
            self.resolve_rewards(batch, timer)
        finally:
            self.model.finish_inference()
        return batch

    @staticmethod
    def rollout_rows(batch: Dict[str, torch.Tensor]):
        """Tokens and lengths of the rollouts, as the actor's log-prob passes take them (the lengths
        let it compute a prompt shared by several rollouts once)."""
        return batch["tokens"], batch["prompt_lengths"], batch["response_lengths"]

    def rollout_kl(self, batch: Dict[str, torch.Tensor], mask: torch.Tensor) -> torch.Tensor:
        """Per-token KL of the rollout policy to the initial one (zeros when the rollouts' log-probs
        were skipped: then no reward uses it and the actor update reports the metric)."""
        if batch["logprobs"] is None:
            return torch.zeros_like(mask)
        return ppo_utils.calculate_kl_penalty(batch["logprobs"], batch["init_logprobs"], self.use_absolute_kl) * mask

    def compute_advantages(self, batch: Dict[str, torch.Tensor]) -> Dict[str, float]:
        """KL-penalised per-token rewards, GAE advantages and returns, masks (DESIGN section 4, step 5)."""
        width = batch["tokens"].shape[1] - 1
        mask = ppo_utils.create_mask(batch["prompt_lengths"], batch["response_lengths"], width)
        values = batch["values"][:, :width] * mask
        kl = self.rollout_kl(batch, mask)
        rewards = ppo_utils.calculate_ppo_rewards(batch["rewards"], batch["response_lengths"], kl, self.kl_penalty)
        advantages, returns = ppo_utils.calculate_advantages_and_returns(values, rewards, self.discount,
                                                                         self.gae_lambda, mask)
        if self.normalize_advantages:
            advantages = ppo_utils.normalize_advantages(advantages, mask, self.dp_group)
        batch.update(mask=mask, advantages=advantages, returns=returns, prev_values=values)
        # Metrics over all data-parallel ranks.
        stats = torch.tensor([batch["rewards"].sum(), batch["rewards"].numel(), (kl * mask).sum(), mask.sum(),
                              (batch["response_lengths"] - batch["prompt_lengths"]).float().sum(),
                              batch["is_end"].float().sum(), (values * mask).sum()], dtype=torch.float64)
        stats = host_all_reduce(stats, group=self.dp_group)
        n = max(float(stats[1]), 1.0)
        return {"rewards": float(stats[0]) / n, "init_policy_kl": float(stats[2]) / max(float(stats[3]), 1.0),
                "response_length": float(stats[4]) / n, "ended_fraction": float(stats[5]) / n,
                "values": float(stats[6]) / max(float(stats[3]), 1.0)}

    # ----------------------------------------------------------------- critic
    def send_critic_train(self, batch: Dict[str, torch.Tensor]):
        """Gather this step's critic data over DP on global rank 0 and send it (asynchronous)."""
        local = {k: batch[k].numpy() for k in ("tokens", "returns", "prev_values", "mask")}
        if self.dp > 1:
            gathered = [None] * dist.get_world_size()
            dist.all_gather_object(gathered, local if self.model_parallel_rank() == 0 else None)
            parts = [g for g in gathered if g is not None]
        else:
            parts = [local]
        if dist.get_rank() != 0:
            return None
        width = max(p["tokens"].shape[1] for p in parts)
        tokens = np.concatenate([np.pad(p["tokens"], ((0, 0), (0, width - p["tokens"].shape[1])),
                                        constant_values=self.model.tokenizer.eos_id) for p in parts])
        rest = {k: np.concatenate([np.pad(p[k], ((0, 0), (0, width - 1 - p[k].shape[1]))) for p in parts])
                for k in ("returns", "prev_values", "mask")}
        return self.rm_critic.train(tokens, rest["returns"], rest["prev_values"], rest["mask"])

    @staticmethod
    def model_parallel_rank() -> int:
        from megatron.core import parallel_state

        return dist.get_rank(parallel_state.get_model_parallel_group())

    def critic_loss(self, future) -> float:
        value = torch.tensor([0.0], dtype=torch.float64)
        if future is not None:
            value[0] = float(np.asarray(future.result()).reshape(-1)[0])
        if dist.get_world_size() > 1:
            value = value.to(comm_device())
            dist.broadcast(value, src=0)
        return float(value[0])

    # ----------------------------------------------------------------- actor
    def train_actor(self, batch: Dict[str, torch.Tensor]) -> Dict[str, float]:
        """Each rollout once, in global batches; one optimizer step per global batch."""
        local_gbs = self.global_batch_size // self.dp
        rows = batch["tokens"].shape[0]
        metrics: List[Dict[str, float]] = []
        self.model.prepare_for_training()
        try:
            for begin in range(0, rows - local_gbs + 1, local_gbs):
                part = {k: None if batch[k] is None else batch[k][begin : begin + local_gbs] for k in
                        ("tokens", "prompt_lengths", "response_lengths", "logprobs", "init_logprobs",
                         "advantages", "mask", "is_end")}
                self.model.prepare_for_training_step()
                loss, m = self.model.get_loss_and_metrics(part, forward_only=False, use_absolute_kl=self.use_absolute_kl)
                if not self.nonfinite.check(loss, self.model):
                    metrics.append(self._skip_nonfinite_update())
                    continue
                m = {**m, "grad_norm": 0.0, **optimizer_update(self.optimizer, self.scheduler)}
                self.ppo_optimization_step += 1
                metrics.append(m)
        finally:
            self.model.finish_training()
        keys = dict.fromkeys(k for m in metrics for k in m)
        return {k: float(np.mean([m[k] for m in metrics if k in m])) for k in keys}

    def _skip_nonfinite_update(self) -> Dict[str, float]:
        """Drop an actor update whose loss or gradients are not finite; stop after too many in a row."""
        self.nonfinite.skip(self.optimizer, self.step + 1)
        return {"skipped_updates": 1.0}

    # ----------------------------------------------------------------- validation
    @torch.no_grad()
    def validate(self) -> Dict[str, float]:
        """Greedy responses to the validation prompts, scored by the reward model."""
        if self.val_dataloader is None:
            return {}
        timer = Timer()
        self.model.prepare_for_inference()
        total = torch.zeros(2, dtype=torch.float64)
        table = []
        try:
            for data in self.val_dataloader:
                if not data["tokens"] and not self.share_rollouts:  # shared out: every rank takes part
                    continue
                # greedy, with the configured end strings (a chat model's turn ends at one, not at EOS)
                greedy = dataclasses.replace(self.model.sampling_params, use_greedy=True)
                batch = self.generate_rollouts(data["tokens"], self.val_rollout_micro_batch_size, self.seed,
                                               greedy, timer, data.get("metadata"))
                self.resolve_rewards(batch, timer)
                total += torch.tensor([batch["rewards"].sum(), batch["rewards"].numel()], dtype=torch.float64)
                if not table and data["tokens"]:
                    table = self.sample_rows(data["text"], batch, 4)
        finally:
            self.model.finish_inference()
        total = host_all_reduce(total, group=self.dp_group)
        reward = float(total[0] / max(float(total[1]), 1.0))
        self.logger.log_metrics({"global_rewards": reward}, step=self.step, prefix="val/")
        if table:
            self.logger.log_table("val/samples", ["prompt", "response", "reward"], table, step=self.step)
        self.best_val_reward = reward if self.best_val_reward is None else max(self.best_val_reward, reward)
        self.last_val = {"val_global_rewards": reward}
        return self.last_val

    def sample_rows(self, texts, batch, n: int) -> list:
        rows = []
        tok = self.model.tokenizer
        for i in range(min(n, len(texts))):
            p, l = int(batch["prompt_lengths"][i]), int(batch["response_lengths"][i])
            rows.append([texts[i], tok.ids_to_text(batch["tokens"][i, p:l].tolist()), round(float(batch["rewards"][i]), 4)])
        return rows

    # ----------------------------------------------------------------- checkpoints
    def save(self, val_metrics: Optional[Dict[str, float]] = None) -> None:
        """Save the actor (and ask the critic to save), scored by this step's validation if it ran
        (an earlier step's score would let pruning prefer this checkpoint over the one that earned it)."""
        critic_future = self.rm_critic.save() if self.has_critic and dist.get_rank() == 0 else None
        if self.ckpt_callback is not None:
            metrics = dict(val_metrics or {})
            metrics.setdefault("val_global_rewards", float("nan"))
            self.ckpt_callback.save(self.model, self.optimizer, self.scheduler, self.state_dict(), metrics)
        if critic_future is not None:
            critic_future.result()  # the critic's checkpoint is written before we go on

    # ----------------------------------------------------------------- loop
    def run_step(self, prompts, texts, metadata: Optional[List[dict]] = None) -> Dict[str, float]:
        timer = Timer()
        step_seed = self.seed + 1000003 * (self.step + 1) + 7919 * self.dp_rank
        start = time.monotonic()
        batch = self.make_rollout_batch(prompts, timer, step_seed, metadata)
        with timer("advantages"):
            metrics = self.compute_advantages(batch)
        critic_future = None
        if self.has_critic:
            with timer("critic_train_send"):
                critic_future = self.send_critic_train(batch)
        with timer("train"):
            actor = self.train_actor(batch)
        if self.has_critic:
            with timer("critic_train_wait"):
                metrics["critic_loss"] = self.critic_loss(critic_future)
        metrics.update({f"actor_{k}" if k in ("loss", "grad_norm", "lr") else k: v for k, v in actor.items()})
        metrics.update({f"time/{k}": v for k, v in timer.seconds.items()})
        metrics["time/step"] = time.monotonic() - start
        if is_global_rank_zero():
            per_prompt = max(len(batch["tokens"]) // max(len(texts), 1), 1)  # rows of the trained batch per prompt
            texts = [t for t in texts for _ in range(per_prompt)]
            self.logger.log_table("train/samples", ["prompt", "response", "reward"], self.sample_rows(texts, batch, 4),
                                  step=self.step + 1)
        return metrics

    def critic_warmup(self, prompts) -> None:
        for i in range(self.critic_warmup_steps):
            timer = Timer()
            batch = self.make_rollout_batch(prompts, timer, self.seed + 17 * (i + 1) + 7919 * self.dp_rank)
            self.compute_advantages(batch)
            loss = self.critic_loss(self.send_critic_train(batch))
            logger.info("critic warm-up %d/%d: critic loss %.4f", i + 1, self.critic_warmup_steps, loss)

    def fit(self) -> Dict[str, float]:
        if self.step >= self.max_steps:
            logger.info("already trained %d of %d %s steps; nothing to do", self.step, self.max_steps, self.name)
            return self.summary(0.0)
        start = time.monotonic()
        if self.step == 0 and self.val_at_start:
            val = self.validate()  # the starting point, logged at step 0
            if val and is_global_rank_zero():
                print(f"step 0: validation reward {val['val_global_rewards']:.4f}", flush=True)
        bar = progress_bar(self.max_steps, self.step, self.name)
        stop = False
        last: Dict[str, float] = {}
        self.callbacks.on_train_begin()
        try:
            while self.step < self.max_steps and not stop:
                self.sampler.consumed_samples = self.consumed_samples
                for data in self.train_dataloader:
                    if self.step >= self.max_steps:
                        break
                    if self.step == 0 and self.critic_warmup_steps:
                        self.critic_warmup(data["tokens"])
                    self.callbacks.on_step_begin(self.step + 1)
                    epoch_before = self.epoch
                    metrics = self.run_step(data["tokens"], data["text"], data.get("metadata"))
                    self.step += 1
                    self.consumed_samples += self.prompts_per_step
                    metrics.update(consumed_samples=self.consumed_samples, epoch=self.epoch,
                                   ppo_optimization_step=self.ppo_optimization_step)
                    self.logger.log_metrics(metrics, step=self.step, prefix="train/")
                    last = metrics
                    bar.update(1)
                    bar.set_postfix(refresh=False, **self.progress_postfix(metrics))
                    stop = self.end_of_step(metrics, epoch_before, bar, lambda val: (
                        f"step {self.step}: train reward {metrics['rewards']:.4f}, "
                        f"validation reward {val['val_global_rewards']:.4f}"))
                    if stop:
                        break
        finally:
            bar.close()
        summary = self.summary(time.monotonic() - start)
        summary["final_train_reward"] = last.get("rewards", float("nan"))
        self.callbacks.on_train_end(summary)
        return summary

    def progress_postfix(self, metrics: Dict[str, float]) -> Dict[str, str]:
        return {"reward": f"{metrics['rewards']:.3f}", "kl": f"{metrics['init_policy_kl']:.4f}",
                "critic": f"{metrics['critic_loss']:.3f}"}

    def summary(self, seconds: float) -> Dict[str, float]:
        return {"steps": self.step, "epochs": self.epoch, "consumed_samples": self.consumed_samples,
                "final_train_reward": float("nan"),  # set by fit() after a step
                "final_val_reward": self.last_val.get("val_global_rewards", float("nan")),
                "best_val_reward": self.best_val_reward if self.best_val_reward is not None else float("nan"),
                "seconds": seconds}
