"""GRPO: the k3 KL estimator in the loss, group-normalised advantages, and the Hydra script."""

import math

import pytest
import torch

from conftest import read_metrics, run_script
from nemo_aligner.algorithms.reinforce import group_advantages
from nemo_aligner.utils.ppo_utils import k3_kl


def test_k3_kl_by_hand_and_its_properties():
    logp, ref = torch.tensor([-1.0, -2.0, -0.5]), torch.tensor([-1.5, -1.0, -0.5])
    expected = [math.exp(r - l) - (r - l) - 1 for l, r in zip(logp.tolist(), ref.tolist())]
    assert k3_kl(logp, ref).tolist() == pytest.approx(expected)
    assert (k3_kl(torch.randn(100), torch.randn(100)) >= 0).all() and k3_kl(logp, logp).abs().max() == 0
    # unbiased: E_{x~p}[k3] = KL(p || q) for categorical p, q
    p = torch.tensor([0.7, 0.2, 0.1])
    q = torch.tensor([0.4, 0.4, 0.2])
    exact = float((p * (p / q).log()).sum())
    assert float((p * k3_kl(p.log(), q.log())).sum()) == pytest.approx(exact, rel=1e-6)


def test_group_normalised_advantages():
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0, 0.3, 0.3])
    groups = torch.tensor([0, 0, 0, 0, 1, 1])
    adv = group_advantages(rewards, groups, leave_one_out=False, normalize_std=True)
    mean, std = 0.25, math.sqrt(0.1875)
    assert adv[:4].tolist() == pytest.approx([(r - mean) / (std + 1e-6) for r in [1.0, 0.0, 0.0, 0.0]])
    assert adv[4:].tolist() == [0.0, 0.0]  # equal rewards: no signal, not a division by zero


def test_grpo_script_runs_with_kl_in_the_loss(tmp_path, sft_nemo, builtin_data):
    log_dir = tmp_path / "grpo"
    proc = run_script("train_gpt_grpo.py", [
        f"pretrained_checkpoint.restore_from_path={sft_nemo}",
        f"++model.data.data_prefix={{train: [{builtin_data['prompts_train']}], validation: [{builtin_data['prompts_val']}]}}",
        "reward_fn=nemo_aligner.data.nlp.builtin_task:reward", f"exp_manager.explicit_log_dir={log_dir}",
        "trainer.grpo.max_steps=3", "trainer.grpo.max_epochs=100", "model.grpo.num_rollout_samples=8",
        "model.grpo.num_responses_per_prompt=4", "model.global_batch_size=32", "model.micro_batch_size=8",
        "model.grpo.num_val_samples=16", "model.grpo.length_params.max_length=9", "model.optim.lr=5e-5"])
    train = [r for r in read_metrics(log_dir) if "train/rewards" in r]
    assert [r["step"] for r in train] == [1, 2, 3]
    assert train[0]["train/kl_loss"] == pytest.approx(0.0, abs=1e-6)  # the policy starts at the reference
    assert train[-1]["train/kl_loss"] > 0
    for key in ("train/rewards", "train/advantage_abs_mean", "train/clip_fraction", "train/actor_loss"):
        assert all(math.isfinite(r[key]) for r in train), key
    assert "GRPO finished: 3 steps" in proc.stdout
