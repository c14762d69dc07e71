"""The actor in one process: log-probs agree with the generation, the initial-policy swap restores the
weights, and a PPO update moves log-probs in the direction of the advantages."""

import pytest
import torch
from omegaconf import OmegaConf

from conftest import TINY_ARCH, forward_logits
from nemo_aligner.utils.tokenizers import ByteTokenizer


def build_actor(seed=0, lr=1e-2, precision="32", kl_loss_coef=0.0):
    from nemo_aligner.models.nlp.gpt.megatron_gpt_ppo_actor import MegatronGPTActorModel

    torch.manual_seed(seed)
    cfg = OmegaConf.create(dict(
        TINY_ARCH, micro_batch_size=2, global_batch_size=4, encoder_seq_length=32,
        ppo={"reference_policy_kl_penalty": kl_loss_coef, "rollout_micro_batch_size": 4, "forward_micro_batch_size": 2, "entropy_bonus": 0.0, "ratio_eps": 0.2,
             "sampling_params": {"use_greedy": False, "temperature": 1.0}, "length_params": {"max_length": 6}},
        optim={"name": "fused_adam", "lr": lr, "weight_decay": 0.0, "sched": {"name": "Constant"}}))
    model = MegatronGPTActorModel(cfg, ByteTokenizer(), precision=precision)
    model.setup_optimization(max_steps=10, clip_grad=1.0)
    model.snapshot_initial_policy()
    return model


def rollouts(model, seed=1):
    tok = model.tokenizer
    prompts = [tok.text_to_ids(p) for p in ["reverse abc = ", "sort ba = ", "reverse h = ", "sort fedcba = "]]
    model.prepare_for_inference()
    out = model.infer(prompts, seed=seed)
    model.finish_inference()
    return out


def test_logprobs_match_an_independent_computation(mcore_single):
    model = build_actor()
    out = rollouts(model)
    model.eval()
    lp = model.get_logprobs(out.tokens)
    assert lp.shape == (4, out.tokens.shape[1] - 1)
    logits = forward_logits(model, out.tokens)
    ref = torch.log_softmax(logits.float(), -1)[:, :-1].gather(-1, out.tokens[:, 1:].unsqueeze(-1)).squeeze(-1)
    assert torch.allclose(lp, ref, atol=1e-5)


def test_initial_policy_swap_restores_weights(mcore_single):
    model = build_actor()
    out = rollouts(model)
    before = {k: v.clone() for k, v in model.module.state_dict().items() if isinstance(v, torch.Tensor)}
    with torch.no_grad():
        for p in model.module.parameters():
            p.add_(0.05)  # the policy moves away from the initial one
    moved = model.get_logprobs(out.tokens)
    init = model.get_init_policy_logprobs(out.tokens)
    for k, v in model.module.state_dict().items():
        if isinstance(v, torch.Tensor) and v.is_floating_point():
            assert torch.allclose(v, before[k] + 0.05, atol=1e-6), k  # current weights are back
    with torch.no_grad():
        for p in model.module.parameters():
            p.sub_(0.05)
    assert torch.allclose(init, model.get_logprobs(out.tokens), atol=1e-5)
    assert not torch.allclose(moved, init, atol=1e-3)


@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_update_follows_the_advantage(mcore_single, sign):
    from nemo_aligner.utils.ppo_utils import create_mask

    model = build_actor(lr=3e-3)
    out = rollouts(model)
    old = model.get_logprobs(out.tokens)
    mask = create_mask(out.prompt_lengths, out.response_lengths, out.tokens.shape[1] - 1)
    batch = {"tokens": out.tokens, "logprobs": old, "advantages": sign * mask, "mask": mask,
             "is_end": torch.ones(4, dtype=torch.bool)}
    model.prepare_for_training_step()
    loss, metrics = model.get_loss_and_metrics(batch, forward_only=False)
    model.optimizer.step()
    assert loss == pytest.approx(-sign, abs=1e-4)  # ratio 1 at the first step: loss = -mean(A)
    new = model.get_logprobs(out.tokens)
    change = ((new - old) * mask).sum() / mask.sum()
    assert sign * change.item() > 0.01, change
    # Positions outside the mask (prompt, padding) carry no gradient signal of their own.
    assert metrics["clip_fraction"] == 0.0


def test_update_without_rollout_logprobs_equals_one_with_them(mcore_single):
    """One update per rollout batch: skipping the rollouts' log-prob pass (old = this forward,
    detached) gives the same loss and gradients, and reports the KL to the initial policy."""
    from nemo_aligner.utils.ppo_utils import calculate_kl_penalty, create_mask

    model = build_actor(lr=3e-3)
    out = rollouts(model)
    with torch.no_grad():
        for p in model.module.parameters():
            p.add_(0.01 * torch.randn_like(p))  # away from the initial policy: a non-zero KL
    mask = create_mask(out.prompt_lengths, out.response_lengths, out.tokens.shape[1] - 1)
    advantages = torch.randn(4, 1) * mask
    init = model.get_init_policy_logprobs(out.tokens)
    old = model.get_logprobs(out.tokens)
    base = {"tokens": out.tokens, "init_logprobs": init, "advantages": advantages, "mask": mask,
            "is_end": torch.ones(4, dtype=torch.bool)}
    results = []
    for logprobs in (old, None):
        model.prepare_for_training_step()
        loss, metrics = model.get_loss_and_metrics(dict(base, logprobs=logprobs), forward_only=False)
        grads = [p.main_grad.clone() if getattr(p, "main_grad", None) is not None else p.grad.clone()
                 for p in model.module.parameters()]
        results.append((loss, metrics, grads))
    (loss_a, _, grads_a), (loss_b, metrics_b, grads_b) = results
    assert loss_b == pytest.approx(loss_a, abs=1e-6)
    assert sum(float(g.abs().sum()) for g in grads_b) > 0
    for a, b in zip(grads_a, grads_b):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-7)
    expected = float((calculate_kl_penalty(old, init, True) * mask).sum() / mask.sum())
    assert expected > 1e-4
    assert metrics_b["init_policy_kl"] == pytest.approx(expected, rel=0.3)  # mean of per-micro-batch means


def test_kl_in_the_loss_pulls_the_policy_back_to_the_initial_one(mcore_single):
    """GRPO's ``reference_policy_kl_penalty`` in the actor's loss: with zero advantages the loss and the
    logged ``kl_loss`` are the k3 estimate to the initial policy on the response tokens (an independent
    computation), and one update lowers it."""
    from nemo_aligner.utils.ppo_utils import create_mask

    coef = 0.5
    model = build_actor(lr=2e-4, kl_loss_coef=coef)
    out = rollouts(model)
    with torch.no_grad():
        for p in model.module.parameters():
            p.add_(0.02 * torch.randn_like(p))
    mask = create_mask(out.prompt_lengths, out.response_lengths, out.tokens.shape[1] - 1)
    init = model.get_init_policy_logprobs(out.tokens)
    old = model.get_logprobs(out.tokens)
    batch = {"tokens": out.tokens, "logprobs": old, "init_logprobs": init, "advantages": torch.zeros_like(mask),
             "mask": mask, "is_end": torch.ones(4, dtype=torch.bool)}

    def k3(lp):
        per_mb = [((torch.exp(init[i] - lp[i]) - (init[i] - lp[i]) - 1) * mask[i]).sum() / mask[i].sum()
                  for i in (slice(0, 2), slice(2, 4))]  # micro-batches of 2 rows
        return float(sum(per_mb) / 2)

    expected = k3(old)
    assert expected > 1e-4
    model.prepare_for_training_step()
    loss, metrics = model.get_loss_and_metrics(batch, forward_only=False)
    model.optimizer.step()
    assert metrics["kl_loss"] == pytest.approx(expected, rel=0.3)  # token-weighted across micro-batches
    assert loss == pytest.approx(coef * expected, rel=1e-4)
    assert k3(model.get_logprobs(out.tokens)) < expected


@pytest.mark.parametrize("precision", ["32", "bf16"])
def test_optimizer_offload_moves_states_not_model_parameters(mcore_single, precision):
    """``model.ppo.offload_adam_states`` (on a GPU) frees Adam's moments and master weights for
    generation. megatron-core's own ``offload_to_cpu`` moves every tensor of the optimizer's
    parameter groups, which in float32 are the model's parameters; ours must leave those in place.
    Offloading to the meta device shows what moved without a GPU."""
    from nemo_aligner.utils.ppo_utils import create_mask

    model = build_actor(precision=precision)
    out = rollouts(model)
    mask = create_mask(out.prompt_lengths, out.response_lengths, out.tokens.shape[1] - 1)
    batch = {"tokens": out.tokens, "logprobs": model.get_logprobs(out.tokens), "advantages": mask, "mask": mask,
             "is_end": torch.ones(4, dtype=torch.bool)}
    model.prepare_for_training()  # on a GPU: brings back what generation offloaded (as the trainers do)
    model.prepare_for_training_step()
    model.get_loss_and_metrics(batch, forward_only=False)
    model.optimizer.step()  # Adam's states exist from here
    params = {id(p): (p.device, p.data_ptr()) for p in model.module.parameters()}
    inner = model.optimizer.optimizer
    states = [v for state in inner.state.values() for v in state.values() if isinstance(v, torch.Tensor)]
    group_tensors = [p for g in inner.param_groups for p in g["params"]]
    masters = model.optimizer_offload.master_weights()
    assert states and not any(id(p) in params for p in masters)
    if precision == "32":  # the optimizer's groups hold the model's own parameters: nothing to move
        assert group_tensors and all(id(p) in params for p in group_tensors) and not masters
    else:  # float32 master copies of the bf16 weights
        assert masters and len(masters) == len(group_tensors)
        return  # a CPU tensor's data cannot be swapped for a meta tensor's: the states' move is checked in float32
    model.optimizer_offload.offload(torch.device("meta"))
    assert {id(p): (p.device, p.data_ptr()) for p in model.module.parameters()} == params
    moved = [v for state in inner.state.values() for v in state.values() if isinstance(v, torch.Tensor)]
    assert len(moved) == len(states) and all(v.is_meta for v in moved)


def test_metrics_ignore_micro_batches_without_a_trained_token(mcore_single):
    """A micro-batch whose responses all hit the length limit (is_end False: no trained token) has
    placeholder 0s for its per-token metrics; the step's ratio, clip fraction and KL are over the
    trained tokens, not dragged towards 0 (the ratio of one update per rollout batch is exactly 1)."""
    from nemo_aligner.utils.ppo_utils import create_mask

    model = build_actor()
    out = rollouts(model)
    mask = create_mask(out.prompt_lengths, out.response_lengths, out.tokens.shape[1] - 1)
    init = model.get_init_policy_logprobs(out.tokens)
    batch = {"tokens": out.tokens, "init_logprobs": init, "advantages": torch.randn(4, 1) * mask, "mask": mask,
             "logprobs": None, "is_end": torch.tensor([True, True, False, False])}  # micro-batch 2: nothing trained
    model.prepare_for_training_step()
    _, metrics = model.get_loss_and_metrics(batch, forward_only=True)
    assert metrics["ratio_mean"] == pytest.approx(1.0, abs=1e-6)  # was 0.5: (1 + 0) / 2
    assert metrics["clip_fraction"] == 0.0 and "tokens" not in metrics
    assert torch.isfinite(torch.tensor(metrics["loss"]))


def test_validation_is_greedy_with_the_configured_end_strings(mcore_single):
    """Validation responses stop where training rollouts do (a chat model's turn ends at an end
    string, not at EOS): greedy, but with the model's own end strings and other settings."""
    from types import SimpleNamespace

    from nemo_aligner.algorithms.ppo import PPOTrainer
    from nemo_aligner.models.nlp.gpt.generation import SamplingParams

    seen = []

    def generate_rollouts(tokens, micro_batch_size, seed, sampling, timer, metadata=None):
        seen.append(sampling)
        return {"rewards": torch.ones(len(tokens))}

    model = SimpleNamespace(sampling_params=SamplingParams(temperature=0.7, top_k=5, end_strings=["<extra_id_1>"]),
                            prepare_for_inference=lambda: None, finish_inference=lambda: None)
    logged = {}
    trainer = SimpleNamespace(
        val_dataloader=[{"tokens": [[1, 2]], "text": ["p"]}], model=model, generate_rollouts=generate_rollouts,
        resolve_rewards=lambda batch, timer: None, sample_rows=lambda texts, batch, n: [], val_rollout_micro_batch_size=1,
        seed=0, dp_group=None, logger=SimpleNamespace(log_metrics=lambda m, step, prefix: logged.update(m)),
        step=3, best_val_reward=None)
    assert PPOTrainer.validate(trainer) == {"val_global_rewards": 1.0}
    assert seen[0].use_greedy and seen[0].end_strings == ["<extra_id_1>"] and seen[0].top_k == 5
    assert model.sampling_params.use_greedy is False  # the training settings are left as they were
