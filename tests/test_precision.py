"""bf16 and fp16 for every model role: a training checkpoint restores the run exactly (the float32
master weights, Adam's moments and the float32 reward/value heads kept in a half-precision model),
and the .nemo written from it loads with equal outputs."""

import pytest
import torch
from omegaconf import OmegaConf

from conftest import TINY_ARCH
from nemo_aligner.utils.tokenizers import ByteTokenizer

OPTIM = {"name": "fused_adam", "lr": 1e-2, "weight_decay": 0.01, "sched": {"name": "Constant"}}


def tokens(seed, rows=4, seq=12):
    return torch.randint(3, 200, (rows, seq), generator=torch.Generator().manual_seed(seed))


def sft_batch(seed):
    t = tokens(seed)
    mask = torch.ones(4, 11)
    mask[:, :4] = 0
    return {"tokens": t[:, :-1], "labels": t[:, 1:], "loss_mask": mask,
            "position_ids": torch.arange(11).expand(4, 11).contiguous()}


def reward_batch(seed):
    t = tokens(seed, rows=8)
    return {"chosen": t[:4], "rejected": t[4:], "chosen_length": torch.tensor([12, 9, 7, 12]),
            "rejected_length": torch.tensor([10, 12, 5, 8]), "position_ids": torch.arange(12).expand(4, 12).contiguous(),
            "weight": torch.ones(4)}


def critic_batch(seed):
    t = tokens(seed)
    mask = torch.ones(4, 11)
    mask[:, :3] = 0
    mask[1, 8:] = 0  # a padded response
    g = torch.Generator().manual_seed(seed + 1)
    return {"tokens": t, "returns": torch.randn(4, 11, generator=g), "prev_values": torch.randn(4, 11, generator=g),
            "mask": mask}


def dpo_batch(seed):
    t = tokens(seed, rows=8)
    mask = torch.ones(8, 11)
    mask[:, :4] = 0
    mask[5, 9:] = 0
    return {"chosen": t[:4], "rejected": t[4:], "chosen_mask": mask[:4], "rejected_mask": mask[4:],
            "chosen_rewards": torch.zeros(4), "rejected_rewards": torch.zeros(4), "weight": torch.ones(4)}


def kto_batch(seed):
    t = tokens(seed)
    mask = torch.ones(4, 11)
    mask[:, :4] = 0
    return {"tokens": t, "mask": mask, "weight": torch.ones(4), "desirable": torch.tensor([1.0, 0.0, 1.0, 0.0]),
            "kl_tokens": tokens(seed + 50), "kl_mask": mask, "kl_weight": torch.ones(4)}


def actor_batch(seed):
    t = tokens(seed)
    mask = torch.ones(4, 11)
    mask[:, :4] = 0
    mask[2, 7:] = 0
    g = torch.Generator().manual_seed(seed + 1)
    return {"tokens": t, "logprobs": -torch.rand(4, 11, generator=g) * 3, "init_logprobs": -torch.rand(4, 11, generator=g) * 3,
            "advantages": torch.randn(4, 11, generator=g) * mask, "mask": mask, "is_end": torch.ones(4, dtype=torch.bool)}


def build(role, precision, seed):
    from nemo_aligner.models.nlp.gpt import (megatron_gpt_critic, megatron_gpt_dpo_model, megatron_gpt_kto_model,
                                             megatron_gpt_ppo_actor, megatron_gpt_reward_model)
    from nemo_aligner.models.nlp.gpt.gpt_sft_model import GPTSFTModel

    classes = {"sft": GPTSFTModel, "reward": megatron_gpt_reward_model.MegatronGPTRewardModel,
               "critic": megatron_gpt_critic.MegatronGPTCriticModel, "dpo": megatron_gpt_dpo_model.MegatronGPTDPOModel,
               "kto": megatron_gpt_kto_model.MegatronGPTKTOModel, "actor": megatron_gpt_ppo_actor.MegatronGPTActorModel}
    torch.manual_seed(seed)
    cfg = OmegaConf.create(dict(TINY_ARCH, micro_batch_size=2, global_batch_size=4, encoder_seq_length=32,
                                optim=OPTIM, offload_adam_states=False,
                                dpo={"ref_policy_kl_penalty": 0.1, "sft_loss_weight": 0.5},
                                kto={"ref_policy_kl_penalty": 0.1},
                                ppo={"rollout_micro_batch_size": 4, "forward_micro_batch_size": 2, "entropy_bonus": 0.01,
                                     "ratio_eps": 0.2, "offload_adam_states": False, "initial_policy_kl_penalty": 0.1}))
    model = classes[role](cfg, ByteTokenizer(), precision=precision)
    model.setup_optimization(max_steps=10, clip_grad=1.0)
    if role in ("dpo", "kto"):
        model.snapshot_reference_policy()
    if role == "actor":
        model.snapshot_initial_policy()
    return model


BATCHES = {"sft": sft_batch, "reward": reward_batch, "critic": critic_batch, "dpo": dpo_batch, "kto": kto_batch,
           "actor": actor_batch}


def step(model, batch):
    model.prepare_for_training_step()
    loss, _ = model.get_loss_and_metrics(batch, forward_only=False)
    success, _, _ = model.optimizer.step()
    model.scheduler.step(increment=1)
    # fp16's dynamic loss scale starts high: the first steps overflow and are skipped, by design.
    assert success or model.precision == "16"
    return float(loss)


@pytest.mark.stack
@pytest.mark.parametrize("precision,optim_name", [("bf16", "fused_adam"), ("16", "fused_adam"),
                                                  ("bf16", "distributed_fused_adam")],
                         ids=["bf16", "16", "bf16-distributed"])
@pytest.mark.parametrize("role", list(BATCHES))
def test_checkpoint_and_nemo_round_trip(mcore_single, tmp_path, monkeypatch, role, precision, optim_name):
    """With the distributed optimizer (NeMo-Aligner's default) the float32 heads of the reward model and
    the critic sit in the same optimizer groups as bf16 weights, which megatron-core maps to the wrong
    optimizer slots unless patched (utils/patches/optimizer_state.py)."""
    from nemo_aligner.models.nlp.gpt.loading import load_model
    from nemo_aligner.utils.nemo_file import save_nemo
    from nemo_aligner.utils.train_checkpoint import load_train_checkpoint, save_train_checkpoint

    monkeypatch.setitem(OPTIM, "name", optim_name)
    make = BATCHES[role]
    a = build(role, precision, seed=0)
    half = torch.bfloat16 if precision == "bf16" else torch.float16
    assert a.module.decoder.layers[0].mlp.linear_fc1.weight.dtype == half
    step(a, make(1))
    step(a, make(2))
    save_train_checkpoint(str(tmp_path / "ckpt"), a, a.optimizer, a.scheduler, {"step": 2})

    b = build(role, precision, seed=0)  # the same start (DPO's reference policy), then other weights:
    with torch.no_grad():  # everything trained must come from the checkpoint
        for p in b.module.parameters():
            p.add_(0.5)
    load_train_checkpoint(str(tmp_path / "ckpt"), b, b.optimizer, b.scheduler, load_rng=False)
    for (name, pa), pb in zip(a.module.named_parameters(), b.module.parameters()):
        assert pb.dtype == pa.dtype and torch.equal(pa, pb), name
    # Two more steps agree exactly: masters, moments, the scheduler and any loss scale came back.
    for seed in (3, 4):
        assert step(b, make(seed)) == step(a, make(seed))
    for (name, pa), pb in zip(a.module.named_parameters(), b.module.parameters()):
        assert torch.equal(pa, pb), name

    nemo = save_nemo(a, str(tmp_path / f"{role}.nemo"))
    c = load_model(type(a), OmegaConf.create({"micro_batch_size": 2, "global_batch_size": 4}), precision, nemo,
                   trainable=False)
    for (name, pa), pc in zip(a.module.named_parameters(), c.module.parameters()):
        assert pc.dtype == pa.dtype and torch.equal(pa, pc), name
    if role in ("reward", "critic"):  # the heads stay float32 in a half-precision model
        assert a.module.rm_head.weight.dtype == torch.float32


@pytest.mark.stack
@pytest.mark.parametrize("optim_name", ["distributed_fused_adam", "fused_adam"])
@pytest.mark.parametrize("saved,resumed", [("32", "bf16"), ("bf16", "32")])
def test_resuming_at_another_precision_is_one_error_naming_both(mcore_single, tmp_path, monkeypatch, saved, resumed,
                                                                   optim_name):
    """The optimizer state of a float32 run (no master copies) and of a bf16 run (float32 masters beside
    bf16 weights) have different layouts: resuming one as the other failed inside megatron-core's
    loader (a KeyError called the checkpoint damaged, or a traceback); now one error names both."""
    from nemo_aligner.utils.errors import CheckpointError
    from nemo_aligner.utils.train_checkpoint import load_train_checkpoint, save_train_checkpoint

    monkeypatch.setitem(OPTIM, "name", optim_name)
    a = build("sft", saved, seed=0)
    step(a, sft_batch(1))
    save_train_checkpoint(str(tmp_path / "ckpt"), a, a.optimizer, a.scheduler, {"step": 1})
    b = build("sft", resumed, seed=0)
    names = {"32": r"float32 weights \(trainer.precision=32\)", "bf16": r"bfloat16 weights \(trainer.precision=bf16\)"}
    with pytest.raises(CheckpointError, match=rf"saved by a run with {names[saved]}; this run's are "
                                              rf"{names[resumed].replace(' weights', '')}"):
        load_train_checkpoint(str(tmp_path / "ckpt"), b, b.optimizer, b.scheduler, load_rng=False)
    c = build("sft", saved, seed=1)  # the same precision resumes
    load_train_checkpoint(str(tmp_path / "ckpt"), c, c.optimizer, c.scheduler, load_rng=False)
    for (name, pa), pc in zip(a.module.named_parameters(), c.module.parameters()):
        assert torch.equal(pa, pc), name


@pytest.mark.parametrize("saved,resumed", [("fused_adam", "distributed_fused_adam"),
                                           ("distributed_fused_adam", "fused_adam"), ("sgd", "adamw")])
def test_resuming_with_another_kind_of_optimizer_is_one_error_naming_both(mcore_single, tmp_path, monkeypatch, saved,
                                                                          resumed):
    """A distributed optimizer's state (flat buffers per bucket) and a plain one's (per parameter), or
    SGD's and Adam's, do not load into each other: one error names both model.optim.name values."""
    from nemo_aligner.utils.errors import CheckpointError
    from nemo_aligner.utils.train_checkpoint import load_train_checkpoint, save_train_checkpoint

    monkeypatch.setitem(OPTIM, "name", saved)
    a = build("sft", "32", seed=0)
    step(a, sft_batch(1))
    save_train_checkpoint(str(tmp_path / "ckpt"), a, a.optimizer, a.scheduler, {"step": 1})
    monkeypatch.setitem(OPTIM, "name", resumed)
    b = build("sft", "32", seed=0)
    kind = {"fused_adam": "a plain \\(not distributed\\) Adam optimizer", "adamw": "a plain \\(not distributed\\) Adam optimizer",
            "sgd": "a plain \\(not distributed\\) SGD optimizer", "distributed_fused_adam": "a distributed Adam optimizer"}
    with pytest.raises(CheckpointError, match=rf"saved with {kind[saved]} \(model.optim.name={saved}\); this run has "
                                              rf"{kind[resumed]} \(model.optim.name={resumed}\)"):
        load_train_checkpoint(str(tmp_path / "ckpt"), b, b.optimizer, b.scheduler, load_rng=False)
