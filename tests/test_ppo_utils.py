"""PPO maths against hand-written references (loops over plain Python numbers)."""

import math
import random

import pytest
import torch

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
