"""PPO maths against hand-written references (loops over plain Python numbers)."""

import math
import random

import pytest
import torch

from conftest import stub_trainer
from nemo_aligner.utils import ppo_utils as P


def gae_reference(values, rewards, gamma, lam):
    """The textbook loop, one sequence at a time, in plain floats."""
    advantages = [0.0] * len(values)
    last = 0.0
    for t in reversed(range(len(values))):
        next_value = values[t + 1] if t + 1 < len(values) else 0.0
        delta = rewards[t] + gamma * next_value - values[t]
        last = delta + gamma * lam * last
        advantages[t] = last
    return advantages, [a + v for a, v in zip(advantages, values)]


@pytest.mark.parametrize("gamma, lam", [(1.0, 0.95), (0.99, 0.9), (0.5, 1.0), (1.0, 0.0)])
def test_gae_matches_hand_loop(gamma, lam):
    rng = random.Random(0)
    values = [[rng.uniform(-1, 1) for _ in range(7)] for _ in range(3)]
    rewards = [[rng.uniform(-1, 1) for _ in range(7)] for _ in range(3)]
    adv, ret = P.calculate_advantages_and_returns(torch.tensor(values, dtype=torch.float64),
                                                   torch.tensor(rewards, dtype=torch.float64), gamma, lam)
    for b in range(3):
        ref_adv, ref_ret = gae_reference(values[b], rewards[b], gamma, lam)
        assert adv[b].tolist() == pytest.approx(ref_adv, abs=1e-12)
        assert ret[b].tolist() == pytest.approx(ref_ret, abs=1e-12)


def test_gae_ignores_positions_outside_the_mask():
    values = torch.tensor([[0.5, 0.2, 0.9, 7.0]])
    rewards = torch.tensor([[0.0, 0.0, 1.0, 5.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    adv, _ = P.calculate_advantages_and_returns(values, rewards, 1.0, 1.0, mask)
    ref, _ = gae_reference([0.5, 0.2, 0.9], [0.0, 0.0, 1.0], 1.0, 1.0)
    assert adv[0, :3].tolist() == pytest.approx(ref)


def test_mask_covers_response_log_probs_only():
    # prompt 3 tokens, 6 tokens in all -> response tokens 3,4,5 -> log-prob positions 2,3,4
    mask = P.create_mask(torch.tensor([3, 2]), torch.tensor([6, 3]), width=7)
    assert mask[0].tolist() == [0, 0, 1, 1, 1, 0, 0]
    assert mask[1].tolist() == [0, 1, 0, 0, 0, 0, 0]


def test_rewards_on_last_action_minus_kl():
    kl = torch.tensor([[0.1, 0.2, 0.3, 0.4, 0.0]])
    out = P.calculate_ppo_rewards(torch.tensor([2.0]), torch.tensor([5]), kl, kl_penalty=0.5)
    # 5 tokens -> log-prob positions 0..3; the last action is position 3
    assert out[0].tolist() == pytest.approx([-0.05, -0.1, -0.15, -0.2 + 2.0, 0.0])


def test_kl_penalty_absolute_or_not():
    a, b = torch.tensor([-1.0, -2.0]), torch.tensor([-1.5, -1.0])
    assert P.calculate_kl_penalty(a, b, True).tolist() == [0.5, 1.0]
    assert P.calculate_kl_penalty(a, b, False).tolist() == [0.5, -1.0]


def test_global_normalisation_over_ranks_equals_pooled(tmp_path):
    """Two gloo ranks holding halves of a batch normalise exactly like one rank holding all of it."""
    import torch.multiprocessing as mp

    from conftest import free_port

    torch.manual_seed(0)
    adv = torch.randn(4, 6, dtype=torch.float64)
    mask = (torch.rand(4, 6) > 0.3).double()
    pooled = P.normalize_advantages(adv, mask)
    port = free_port()
    mp.spawn(_normalise_worker, args=(port, adv, mask, str(tmp_path)), nprocs=2, join=True)
    halves = [torch.load(tmp_path / f"r{r}.pt") for r in range(2)]
    assert torch.allclose(torch.cat(halves), pooled, atol=1e-12)
    valid = pooled[mask.bool()]
    assert valid.mean().item() == pytest.approx(0.0, abs=1e-12)
    assert valid.var(unbiased=False).item() == pytest.approx(1.0, abs=1e-6)


def _normalise_worker(rank, port, adv, mask, out):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    part = slice(2 * rank, 2 * rank + 2)
    torch.save(P.normalize_advantages(adv[part], mask[part], group=dist.group.WORLD), f"{out}/r{rank}.pt")
    dist.destroy_process_group()


def test_actor_loss_by_hand():
    logp = torch.tensor([[-1.0, -0.5, -2.0]])
    old = torch.tensor([[-1.2, -0.5, -1.0]])
    adv = torch.tensor([[1.0, -1.0, 2.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    loss, m = P.ppo_actor_loss(logp, old, adv, mask, ratio_eps=0.1)
    r0 = math.exp(0.2)  # clipped to 1.1 with a positive advantage -> max(-r, -1.1) = -1.1
    expected = (max(-1.0 * r0, -1.0 * min(r0, 1.1)) + max(1.0 * 1.0, 1.0 * 1.0)) / 2
    assert loss.item() == pytest.approx(expected)
    assert m["clip_fraction"].item() == pytest.approx(0.5)
    ent = torch.tensor([[2.0, 4.0, 100.0]])
    loss_e, m_e = P.ppo_actor_loss(logp, old, adv, mask, 0.1, entropy=ent, entropy_bonus=0.01)
    assert m_e["entropy"].item() == pytest.approx(3.0)
    assert loss_e.item() == pytest.approx(expected - 0.03)
    empty, _ = P.ppo_actor_loss(logp, old, adv, torch.zeros_like(mask), 0.1)
    assert empty.item() == 0.0


def test_critic_loss_by_hand():
    v = torch.tensor([[1.0, 2.0, 0.0]])
    prev = torch.tensor([[0.5, 2.5, 0.0]])
    ret = torch.tensor([[2.0, 2.0, 9.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    # position 0: v_clip = 0.5 + clamp(0.5, 0.2) = 0.7 -> max((0.7-2)^2, (1-2)^2) = 1.69
    # position 1: v_clip = 2.5 + clamp(-0.5) = 2.3 -> max(0.09, 0) = 0.09
    assert P.critic_loss(v, prev, ret, mask, 0.2).item() == pytest.approx(0.5 * (1.69 + 0.09) / 2)


def test_rloo_baseline_excludes_the_sample_itself():
    rewards = torch.tensor([1.0, 2.0, 6.0, 10.0, 3.0])
    groups = torch.tensor([0, 0, 0, 1, 2])
    base = P.rloo_baseline(rewards, groups)
    assert base.tolist() == pytest.approx([4.0, 3.5, 1.5, 10.0, 3.0])
    invalid = P.rloo_baseline(rewards, groups, valid=torch.tensor([1.0, 0.0, 1.0, 1.0, 1.0]))
    assert invalid[0].item() == pytest.approx(6.0) and invalid[2].item() == pytest.approx(1.0)


def test_gae_with_discount_and_padding_uses_only_the_response():
    """gamma and lambda < 1, rows whose prompt and padding positions hold large values and rewards:
    the advantages and returns on each row's response equal the textbook loop on the response alone
    (the value after the last response position is 0, not the padding's)."""
    gamma, lam = 0.9, 0.8
    rng = random.Random(3)
    spans = [(1, 5), (3, 6), (0, 7)]  # [start, end) of each row's response positions
    values = [[rng.uniform(5, 9) for _ in range(7)] for _ in spans]
    rewards = [[rng.uniform(3, 6) for _ in range(7)] for _ in spans]
    mask = [[1.0 if s <= t < e else 0.0 for t in range(7)] for s, e in spans]
    for row, (s, e) in enumerate(spans):  # response rewards of either sign, a sequence reward at the end
        for t in range(s, e):
            rewards[row][t] = rng.uniform(-0.2, 0.2) + (1.5 if t == e - 1 else 0.0)
    adv, ret = P.calculate_advantages_and_returns(torch.tensor(values, dtype=torch.float64),
                                                   torch.tensor(rewards, dtype=torch.float64), gamma, lam,
                                                   torch.tensor(mask, dtype=torch.float64))
    for row, (s, e) in enumerate(spans):
        ref_adv, ref_ret = gae_reference(values[row][s:e], rewards[row][s:e], gamma, lam)
        assert adv[row, s:e].tolist() == pytest.approx(ref_adv, abs=1e-12), row
        assert ret[row, s:e].tolist() == pytest.approx(ref_ret, abs=1e-12), row


@pytest.mark.parametrize("kl_penalty", [0.2, -0.3])
def test_kl_penalised_sequence_rewards_by_hand(kl_penalty):
    rewards = torch.tensor([1.0, -0.5])
    kl = torch.tensor([[0.1, 0.2, 0.0], [0.3, -0.1, 0.4]])
    got = P.kl_penalised_rewards(rewards, kl, kl_penalty)
    assert got.tolist() == pytest.approx([1.0 - kl_penalty * 0.3, -0.5 - kl_penalty * 0.6])


@pytest.mark.parametrize("coef", [0.1, -0.4])
def test_actor_loss_kl_term_by_hand(coef):
    """GRPO's loss: the clipped surrogate plus ``coef`` times the masked mean of k3 to the initial
    policy; with a positive coefficient its gradient moves log-probs towards the initial ones."""
    logp = torch.tensor([[-1.0, -0.5, -2.0], [-0.3, -1.5, -0.7]], requires_grad=True)
    old = logp.detach() + torch.tensor([[0.1, -0.05, 0.0], [0.0, 0.02, -0.1]])
    init = torch.tensor([[-1.4, -0.2, -3.0], [-0.6, -1.0, -0.1]])
    adv = torch.tensor([[0.5, -1.0, 2.0], [1.0, 0.3, -0.2]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    base, _ = P.ppo_actor_loss(logp, old, adv, mask, ratio_eps=0.2)
    loss, stats = P.ppo_actor_loss(logp, old, adv, mask, ratio_eps=0.2, init_logprobs=init, kl_loss_coef=coef)
    k3 = [math.exp(i - lp) - (i - lp) - 1 for lp, i, m in zip(logp.flatten().tolist(), init.flatten().tolist(),
                                                                mask.flatten().tolist()) if m]
    assert stats["kl_loss"].item() == pytest.approx(sum(k3) / len(k3), rel=1e-6)
    assert loss.item() == pytest.approx(base.item() + coef * sum(k3) / len(k3), rel=1e-6)
    # the KL term alone: d/dlogp of coef * mean(k3) = coef * (1 - exp(init - logp)) / n on masked positions
    zero_adv, _ = P.ppo_actor_loss(logp, logp.detach(), torch.zeros_like(adv), mask, 0.2, init_logprobs=init,
                                   kl_loss_coef=coef)
    (grad,) = torch.autograd.grad(zero_adv, logp)
    expected = coef * (1 - torch.exp(init - logp.detach())) * mask / mask.sum()
    assert torch.allclose(grad, expected, atol=1e-7)
    towards = (grad * (logp.detach() - init) * mask)  # descent moves logp towards init where this is > 0
    assert bool((towards[mask.bool()] > 0).all()) == (coef > 0)
    with pytest.raises(ValueError, match="init_logprobs"):
        P.ppo_actor_loss(logp, old, adv, mask, 0.2, kl_loss_coef=0.1)


def rollout_batch():
    """Two rollouts of 8 tokens: prompts of 2 and 3 tokens, 6 and 5 tokens in all (padding after)."""
    torch.manual_seed(4)
    return {"tokens": torch.zeros(2, 8, dtype=torch.long), "prompt_lengths": torch.tensor([2, 3]),
            "response_lengths": torch.tensor([6, 5]), "rewards": torch.tensor([1.2, -0.4]),
            "values": torch.randn(2, 8) + 3.0, "logprobs": -torch.rand(2, 7) * 2,
            "init_logprobs": -torch.rand(2, 7) * 2, "is_end": torch.tensor([True, True])}


@pytest.mark.parametrize("use_absolute_kl", [True, False])
def test_ppo_trainer_advantages_by_hand(mcore_single, use_absolute_kl):
    """PPOTrainer.compute_advantages: per-token rewards ``-beta * KL`` plus the sequence reward on the last
    action, GAE with gamma = 0.9 and lambda = 0.8 over each row's actions, the value after the last
    action 0, and the logged KL over response tokens only."""
    from nemo_aligner.algorithms.ppo import PPOTrainer

    beta, gamma, lam = 0.1, 0.9, 0.8
    trainer = stub_trainer(PPOTrainer, kl_penalty=beta, use_absolute_kl=use_absolute_kl, discount=gamma,
                           gae_lambda=lam, normalize_advantages=False, dp_group=None)
    batch = rollout_batch()
    raw = {k: v.clone() for k, v in batch.items()}
    metrics = trainer.compute_advantages(batch)
    kls = []
    for row in range(2):
        first, last = int(raw["prompt_lengths"][row]) - 1, int(raw["response_lengths"][row]) - 2  # action positions
        lp, init = raw["logprobs"][row].tolist(), raw["init_logprobs"][row].tolist()
        kl = [abs(lp[t] - init[t]) if use_absolute_kl else lp[t] - init[t] for t in range(first, last + 1)]
        kls += kl
        rewards = [-beta * k for k in kl]
        rewards[-1] += float(raw["rewards"][row])
        values = raw["values"][row, first:last + 1].tolist()
        ref_adv, ref_ret = gae_reference(values, rewards, gamma, lam)
        assert batch["advantages"][row, first:last + 1].tolist() == pytest.approx(ref_adv, abs=1e-5)
        assert batch["returns"][row, first:last + 1].tolist() == pytest.approx(ref_ret, abs=1e-5)
        assert batch["mask"][row].tolist() == [1.0 if first <= t <= last else 0.0 for t in range(7)]
    assert metrics["init_policy_kl"] == pytest.approx(sum(kls) / len(kls), abs=1e-6)
    assert metrics["rewards"] == pytest.approx(0.4)


@pytest.mark.parametrize("leave_one_out, beta", [(True, 0.05), (False, 0.3)])
def test_reinforce_trainer_advantages_by_hand(mcore_single, leave_one_out, beta):
    """ReinforceTrainer.compute_advantages (RLOO, GRPO's scripts): ``r_i - beta * sum_t |KL_t|`` over
    the response, minus the mean of the other responses to the same prompt (or of the whole group),
    on every response token; a row cut at the length limit counts in no baseline."""
    from nemo_aligner.algorithms.reinforce import ReinforceTrainer

    trainer = stub_trainer(ReinforceTrainer, kl_penalty=beta, use_absolute_kl=True, leave_one_out=leave_one_out,
                           normalize_rewards=False, dp_group=None)
    torch.manual_seed(5)
    n = 6
    batch = {"tokens": torch.zeros(n, 8, dtype=torch.long), "prompt_lengths": torch.tensor([2, 2, 2, 3, 3, 3]),
             "response_lengths": torch.tensor([6, 8, 5, 7, 4, 8]), "rewards": torch.tensor([1.0, 0.2, 0.6, 0.0, 0.9, 0.4]),
             "logprobs": -torch.rand(n, 7) * 2, "init_logprobs": -torch.rand(n, 7) * 2,
             "is_end": torch.tensor([True, True, True, True, True, False]),
             "group_ids": torch.tensor([0, 0, 0, 1, 1, 1])}
    raw = {k: v.clone() for k, v in batch.items()}
    metrics = trainer.compute_advantages(batch)
    penalised = []
    for row in range(n):
        first, last = int(raw["prompt_lengths"][row]) - 1, int(raw["response_lengths"][row]) - 2
        kl = sum(abs(raw["logprobs"][row, t] - raw["init_logprobs"][row, t]).item() for t in range(first, last + 1))
        penalised.append(float(raw["rewards"][row]) - beta * kl)
    for row in range(n):
        group = [j for j in range(n) if raw["group_ids"][j] == raw["group_ids"][row] and raw["is_end"][j]]
        others = [j for j in group if j != row] if leave_one_out else group
        expected = penalised[row] - sum(penalised[j] for j in others) / len(others) if raw["is_end"][row] else 0.0
        first, last = int(raw["prompt_lengths"][row]) - 1, int(raw["response_lengths"][row]) - 2
        on = [expected if first <= t <= last else 0.0 for t in range(7)]
        assert batch["advantages"][row].tolist() == pytest.approx(on, abs=1e-5), row
    assert metrics["rewards_with_kl"] == pytest.approx(sum(penalised) / n, abs=1e-5)


def test_mutation_script_names_source_that_exists():
    """tests/mutation/mutate.py (run by hand) changes exact pieces of source: each must still occur once,
    and each mutation's tests must exist, or the script would test nothing."""
    import importlib.util
    import os

    path = os.path.join(os.path.dirname(__file__), "mutation", "mutate.py")
    spec = importlib.util.spec_from_file_location("mutate", path)
    mutate = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mutate)
    assert mutate.check_sources(mutate.MUTATIONS) == []
    assert len(mutate.MUTATIONS) >= 25 and len({m.name for m in mutate.MUTATIONS}) == len(mutate.MUTATIONS)
    for m in mutate.MUTATIONS:
        for test in m.tests:
            file, _, name = test.partition("::")
            with open(os.path.join(mutate.ROOT, file), encoding="utf-8") as f:
                assert not name or f"def {name}(" in f.read(), (m.name, test)
