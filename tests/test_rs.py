"""Rejection sampling: the top-n selection against a hand computation, the SFT loss on the kept
responses, bad settings, and the actor job raising the built-in task's score with a reward function."""

import re

import numpy as np
import pytest
import torch

from conftest import read_metrics, run_script, tiny_optim
from nemo_aligner.utils.ppo_utils import select_top_n


def test_top_n_per_group_by_hand():
    rewards = torch.tensor([0.1, 0.9, 0.5, 0.9, 2.0, -1.0, 3.0, 0.0])
    groups = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1])
    # group 0: 0.9 (row 1) and 0.9 (row 3) tie: the earlier row first; group 1: 3.0 (row 6), 2.0 (row 4)
    assert select_top_n(rewards, groups, 1).tolist() == [1, 6]
    assert select_top_n(rewards, groups, 2).tolist() == [1, 3, 4, 6]
    assert select_top_n(rewards, groups, 4).tolist() == list(range(8))
    # rows cut at the length limit are taken only when a group has too few ended ones
    ended = torch.tensor([True, False, True, False, True, True, False, True])
    assert select_top_n(rewards, groups, 1, valid=ended).tolist() == [2, 4]
    assert select_top_n(rewards, groups, 3, valid=ended).tolist() == [0, 1, 2, 4, 5, 7]
    # groups need not be contiguous or sorted
    shuffled = torch.tensor([1, 0, 1, 0])
    assert select_top_n(torch.tensor([5.0, 1.0, 7.0, 2.0]), shuffled, 1).tolist() == [2, 3]


def test_rs_loss_is_the_mean_nll_of_the_kept_response_tokens(mcore_single):
    """The actor's loss on a batch equals the masked mean of -log p(token) computed from the model's
    own logits (prompt tokens, padding and responses without an end excluded)."""
    from omegaconf import OmegaConf

    from conftest import TINY_ARCH, forward_logits
    from nemo_aligner.models.nlp.gpt.megatron_gpt_rs_actor import MegatronGPTRSActorModel
    from nemo_aligner.utils import ppo_utils
    from nemo_aligner.utils.tokenizers import ByteTokenizer

    torch.manual_seed(3)
    cfg = OmegaConf.create(dict(TINY_ARCH, micro_batch_size=2, global_batch_size=4, encoder_seq_length=32,
                                rs={"rollout_micro_batch_size": 4}))
    model = MegatronGPTRSActorModel(cfg, ByteTokenizer())
    tokens = torch.randint(3, 200, (4, 12))
    prompt_lengths, response_lengths = torch.tensor([3, 5, 2, 4]), torch.tensor([9, 12, 6, 10])
    is_end = torch.tensor([True, True, False, True])
    mask = ppo_utils.create_mask(prompt_lengths, response_lengths, 11)
    loss, metrics = model.get_loss_and_metrics({"tokens": tokens, "mask": mask, "is_end": is_end,
                                                "prompt_lengths": prompt_lengths,
                                                "response_lengths": response_lengths}, forward_only=True)
    logprobs = torch.log_softmax(forward_logits(model, tokens).double(), -1)[:, :-1]
    token_logprobs = logprobs.gather(-1, tokens[:, 1:].unsqueeze(-1)).squeeze(-1)
    keep = mask.double() * is_end.double().unsqueeze(-1)
    # two micro-batches of 2 rows, each its own masked mean, then averaged (as SFT)
    expected = np.mean([float(-(token_logprobs[i:i + 2] * keep[i:i + 2]).sum() / keep[i:i + 2].sum())
                        for i in (0, 2)])
    assert loss == pytest.approx(expected, rel=1e-5)
    assert metrics["loss"] == pytest.approx(expected, rel=1e-5)


@pytest.mark.parametrize("settings, message", [
    ({"num_rollouts_per_prompt": 4, "top_n_rollouts": 5},
     "model.rs.top_n_rollouts=5 must be within 1..model.rs.num_rollouts_per_prompt=4"),
    ({"num_rollouts_per_prompt": 0}, "model.rs.num_rollouts_per_prompt=0 must be >= 1"),
])
def test_rollout_counts_out_of_range_are_named(settings, message):
    from nemo_aligner.algorithms.rs import check_rs_sampling
    from nemo_aligner.utils.errors import ConfigError

    with pytest.raises(ConfigError, match=re.escape(message)):
        check_rs_sampling(settings)
    assert check_rs_sampling({"num_rollouts_per_prompt": 8, "top_n_rollouts": 2}) == (8, 2)


def test_kept_rows_must_fill_whole_global_batches(tmp_path, weak_policy):
    """Checked by the script before any rollout: one ``error:`` line, exit 1, no traceback."""
    model, data = weak_policy
    proc = run_script("train_gpt_rs_actor.py", [
        f"pretrained_checkpoint.restore_from_path={model}",
        f"++model.data.data_prefix={{train: [{data['prompts_train']}], validation: [{data['prompts_val']}]}}",
        "reward_fn=nemo_aligner.data.nlp.builtin_task:reward", f"exp_manager.explicit_log_dir={tmp_path / 'bad'}",
        "model.micro_batch_size=2", "model.rs.num_rollout_samples=6", "model.rs.top_n_rollouts=1",
        "model.global_batch_size=4"], check=False)
    assert proc.returncode == 1
    assert ("error: model.rs.num_rollout_samples=6 x top_n_rollouts=1 is not a multiple of model.global_batch_size=4"
            in proc.stderr and "Traceback" not in proc.stderr), proc.stderr[-2000:]


@pytest.mark.learning
@pytest.mark.parametrize("seed", [1234, 7, 11])
def test_rejection_sampling_raises_the_task_score(tmp_path, weak_policy, seed):
    """From a partly trained SFT model, 200 steps of best-of-4 with the built-in task's reward
    function, for 3 sampling seeds: the kept responses score above the sampled mean, the mean
    sampled reward of the last 20 steps is above the first 20's, and greedy validation rises."""
    model, data = weak_policy
    log_dir = tmp_path / "rs"
    proc = run_script("train_gpt_rs_actor.py", [
        f"pretrained_checkpoint.restore_from_path={model}",
        f"++model.data.data_prefix={{train: [{data['prompts_train']}], validation: [{data['prompts_val']}]}}",
        "reward_fn=nemo_aligner.data.nlp.builtin_task:reward", f"exp_manager.explicit_log_dir={log_dir}",
        "trainer.rs.max_steps=200", "trainer.rs.max_epochs=100", "trainer.rs.val_check_interval=100",
        "model.rs.num_rollout_samples=32", "model.rs.num_rollouts_per_prompt=4", "model.rs.top_n_rollouts=1",
        "model.global_batch_size=32", "model.micro_batch_size=16", "model.rs.rollout_micro_batch_size=32",
        "model.rs.num_val_samples=64", "model.rs.length_params.max_length=9",
        *tiny_optim(5e-5, 5e-5, 0), "model.optim.sched.name=Constant", f"model.seed={seed}"])
    metrics = read_metrics(log_dir)
    rewards = [r["train/rewards"] for r in metrics if "train/rewards" in r]
    kept = [r["train/selected_rewards"] for r in metrics if "train/selected_rewards" in r]
    val = {r["step"]: r["val/global_rewards"] for r in metrics if "val/global_rewards" in r}
    assert len(rewards) == 200 and sorted(val) == [0, 100, 200]
    first, last = np.mean(rewards[:20]), np.mean(rewards[-20:])
    print(f"RS mean sampled reward: first 20 steps {first:.3f}, last 20 steps {last:.3f}; kept "
          f"{np.mean(kept):.3f}; greedy validation {val}")
    assert np.mean(kept) > np.mean(rewards) + 0.02  # best-of-4 is better than a sample
    assert last > first + 0.05, (first, last)
    assert val[200] > val[0], val
    assert "Rejection sampling finished: 200 steps" in proc.stdout


def test_python_api_runs_rejection_sampling_and_refuses_bad_settings(tmp_path, weak_policy):
    """``create_trainer("rs", ...)``: the same job from Python (a reward function, callbacks, the
    trained model as the trainer's new current model); settings out of range are refused at once."""
    from nemo_aligner.api import create_trainer, list_algorithms
    from nemo_aligner.data.nlp.builtin_task import BuiltinTask
    from nemo_aligner.trainers.callbacks import Callback
    from nemo_aligner.utils.errors import ConfigError

    model, data = weak_policy
    assert "rs" in list_algorithms()
    seen = []

    class Kept(Callback):
        def on_step_end(self, trainer, step, metrics):
            seen.append((step, metrics["selected_rewards"], metrics["rewards"]))

    trainer = create_trainer("rs", model=model, num_prompts_per_step=8, num_rollouts_per_prompt=4, top_n_rollouts=2,
                             learning_rate=5e-5, max_sequence_length=32, max_new_tokens=9, global_batch_size=16,
                             micro_batch_size=8, output_dir=str(tmp_path / "api"))
    result = trainer.fit(dataset=data["prompts_train"], val_dataset=data["prompts_val"],
                         reward_fn=lambda prompt, response: BuiltinTask.score(prompt, response), max_steps=3,
                         callbacks=[Kept()])
    assert result.total_steps == 3 and [s for s, _, _ in seen] == [1, 2, 3]
    assert all(kept >= sampled for _, kept, sampled in seen)  # the best 2 of 4 score at least the mean
    assert trainer.model_path.endswith(".nemo") and trainer.model_path != model
    with pytest.raises(ConfigError, match="top_n_rollouts"):
        create_trainer("rs", model=model, top_n_rollouts=0)
    with pytest.raises(ConfigError, match="reward_fn"):
        create_trainer("rs", model=model).fit(dataset=data["prompts_train"])


def test_tp2_run_resumes_exactly(tmp_path, weak_policy):
    """2 steps in one go equal 1 step, a stop, and a second step resumed at tensor parallel 2 (the
    script starts both ranks; the checkpoint is resharded): same samples, rewards and loss."""
    model, data = weak_policy

    def run(log_dir, steps, tp):
        return run_script("train_gpt_rs_actor.py", [
            f"pretrained_checkpoint.restore_from_path={model}",
            f"++model.data.data_prefix={{train: [{data['prompts_train']}], validation: [{data['prompts_val']}]}}",
            "reward_fn=nemo_aligner.data.nlp.builtin_task:reward", f"exp_manager.explicit_log_dir={log_dir}",
            f"trainer.rs.max_steps={steps}", "trainer.rs.max_epochs=100", "trainer.rs.val_check_interval=0",
            "trainer.rs.val_at_start=False", "trainer.rs.save_interval=1", f"trainer.devices={tp}",
            f"model.tensor_model_parallel_size={tp}", "model.rs.num_rollout_samples=8", "model.rs.num_rollouts_per_prompt=4",
            "model.rs.top_n_rollouts=2", "model.global_batch_size=8", "model.micro_batch_size=4",
            "model.rs.length_params.max_length=9", "model.optim.lr=5e-5", "model.optim.sched.name=Constant"],
            like_nproc=tp)

    run(tmp_path / "straight", 2, 1)
    run(tmp_path / "resumed", 1, 1)
    proc = run(tmp_path / "resumed", 2, 2)
    assert "actor resumed at RS step 1" in proc.stdout + proc.stderr

    def step2(log_dir):
        rows = [r for r in read_metrics(log_dir) if r.get("step") == 2 and "train/actor_loss" in r]
        return rows[-1]

    a, b = step2(tmp_path / "straight"), step2(tmp_path / "resumed")
    for key in ("train/rewards", "train/selected_rewards", "train/actor_loss"):
        assert b[key] == pytest.approx(a[key], rel=1e-4), key
