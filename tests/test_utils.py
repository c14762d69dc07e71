"""Launcher environment parsing, LR schedules, max_time, checkpoint naming, tokenizers, CPU clipping ops."""

import json
import os
import subprocess
import sys

import pytest
import torch

from nemo_aligner.utils.checkpoint_callback import format_checkpoint_name
from nemo_aligner.utils.distributed import check_gpus_per_node, check_world_size
from nemo_aligner.utils.errors import ConfigError
from nemo_aligner.utils.launch_info import first_host_of_nodelist, read_launch_info
from nemo_aligner.utils.run_control import compute_max_steps, parse_max_time
from nemo_aligner.utils.tokenizers import ByteTokenizer


def test_slurm_launch_info():
    env = {"SLURM_PROCID": "5", "SLURM_NTASKS": "8", "SLURM_LOCALID": "1",
           "SLURM_JOB_NODELIST": "gpu[003-004,010],cpu1", "SLURM_JOB_ID": "1234"}
    info = read_launch_info(env)
    assert (info.rank, info.world_size, info.local_rank, info.master_addr, info.launcher) == (5, 8, 1, "gpu003", "slurm")
    assert first_host_of_nodelist("node7") == "node7"
    assert first_host_of_nodelist("a-b[12-13]") == "a-b12"
    torchrun = read_launch_info({"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "MASTER_ADDR": "h", "MASTER_PORT": "9"})
    assert (torchrun.rank, torchrun.world_size, torchrun.master_port, torchrun.launcher) == (1, 2, 9, "torchrun")
    assert read_launch_info({}).launcher == "single"


def test_gpus_per_node_check():
    """Two processes on a one-GPU node would share the GPU (NCCL refuses): a clear error instead."""
    torchrun = read_launch_info({"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "2"})
    assert torchrun.local_world_size == 2
    check_gpus_per_node(torchrun, 2)
    check_gpus_per_node(torchrun, 8)
    with pytest.raises(ConfigError, match=r"2 processes on this node but 1 GPU\(s\) visible.*--nproc_per_node 1"
                                          r".*CUDA_VISIBLE_DEVICES"):
        check_gpus_per_node(torchrun, 1)  # rank 0 fails too, instead of waiting for a peer that died
    slurm = read_launch_info({"SLURM_PROCID": "3", "SLURM_NTASKS": "4", "SLURM_LOCALID": "1",
                              "SLURM_TASKS_PER_NODE": "2(x2)"})
    assert slurm.local_world_size == 2
    check_gpus_per_node(slurm, 2)
    with pytest.raises(ConfigError, match="2 processes on this node but 1 GPU"):
        check_gpus_per_node(slurm, 1)
    # Without a per-node count, the local rank is the bound.
    bare = read_launch_info({"SLURM_PROCID": "1", "SLURM_NTASKS": "2", "SLURM_LOCALID": "1"})
    assert bare.local_world_size == 2


def test_world_size_check():
    check_world_size(4, 2, 2)
    with pytest.raises(ConfigError, match=r"trainer.devices=2 x trainer.num_nodes=2 = 4 processes, but the launcher started 2"):
        check_world_size(2, 2, 2)


def test_parse_max_time():
    assert parse_max_time("00:01:30:05") == 5405.0
    assert parse_max_time(12) == 12.0
    assert parse_max_time({"minutes": 2, "seconds": 3}) == 123.0
    assert parse_max_time(None) is None
    with pytest.raises(ConfigError, match="trainer.sft.max_time='1h' must look like DD:HH:MM:SS"):
        parse_max_time("1h", "trainer.sft.max_time")


def test_compute_max_steps():
    assert compute_max_steps(-1, 3, 10) == 30
    assert compute_max_steps(7, 3, 10) == 7
    assert compute_max_steps(100, None, 10) == 100
    with pytest.raises(ConfigError, match="set trainer.sft.max_steps or trainer.sft.max_epochs"):
        compute_max_steps(-1, -1, 10)


def test_checkpoint_name_like_lightning():
    name = format_checkpoint_name("megatron_gpt_sft--{validation_loss:.3f}-{step}-{consumed_samples}-{epoch}",
                                  {"val_loss": 1.23456, "step": 10, "consumed_samples": 320, "epoch": 0})
    assert name == "megatron_gpt_sft--validation_loss=1.235-step=10-consumed_samples=320-epoch=0"
    # NeMo-Aligner's PPO/REINFORCE names for the validation reward and the optimizer step
    name = format_checkpoint_name("megatron_gpt-{step}-{reinforce_optimization_step}-{val_rewards:.3f}",
                                  {"val_global_rewards": 0.5, "step": 4, "ppo_optimization_step": 8})
    assert name == "megatron_gpt-step=4-reinforce_optimization_step=8-val_rewards=0.500"
    from nemo_aligner.utils.checkpoint_callback import CheckpointCallback

    callback = CheckpointCallback("/tmp", "x", monitor="val_rewards", mode="max")
    assert callback.monitor_value({"val_global_rewards": 0.25}) == 0.25


def _nemo_cosine_annealing(step, lr, min_lr, warmup, constant, max_steps):
    """NeMo's CosineAnnealing (nemo/core/optim/lr_scheduler.py, WarmupAnnealHoldPolicy.get_lr) at ``step``
    (scheduler steps taken before the optimizer step), written out from its source."""
    import math

    decay = max_steps - (constant + warmup)

    def megatron_style(step):  # _linear_warmup_with_cosine_annealing
        if warmup > 0 and step <= warmup:
            return lr * step / warmup
        if step > warmup + decay:
            return min_lr
        return min_lr + 0.5 * (math.cos(math.pi * (step - warmup) / decay) + 1.0) * (lr - min_lr)

    if 0 < warmup >= step:
        return megatron_style(step) if constant else lr * (step + 1) / (warmup + 1)
    if constant > 0 and warmup + decay < step <= max_steps:
        return megatron_style(step)
    if step > max_steps:
        return min_lr
    if constant:
        return megatron_style(step)
    return (lr - min_lr) * 0.5 * (1 + math.cos(math.pi * (step - warmup) / (max_steps - warmup))) + min_lr


def scheduled_lrs(sched: dict, max_steps: int) -> list:
    """The LR of each of ``max_steps`` optimizer steps under ``build_scheduler`` with lr 1 and ``sched``."""
    from omegaconf import OmegaConf

    from nemo_aligner.utils.optim import build_scheduler

    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    scheduler = build_scheduler(opt, OmegaConf.create({"lr": 1.0, "sched": sched}), max_steps=max_steps)
    lrs = []
    for _ in range(max_steps):
        lrs.append(opt.param_groups[0]["lr"])
        scheduler.step(1)
    return lrs


@pytest.mark.parametrize("warmup,constant,max_steps", [
    (4, 0, 14),     # warm-up from lr / (warmup + 1), cosine to max_steps
    (4, 2, 14),     # NeMo-Aligner's shape: warm-up from 0, cosine to max_steps - constant_steps, then min_lr
    (0, 3, 10),
    (3, 20, 12),    # a run shorter than warmup + constant_steps: min_lr right after the warm-up
    (10, 1000, 6),  # ends within the warm-up
])
def test_cosine_schedule_matches_nemo(warmup, constant, max_steps, caplog):
    """Each step's LR is NeMo's CosineAnnealing's for the same keys (NeMo-Aligner's defaults:
    warmup_steps 10, constant_steps 1000)."""
    with caplog.at_level("WARNING"):
        lrs = scheduled_lrs({"name": "CosineAnnealing", "warmup_steps": warmup, "constant_steps": constant,
                             "min_lr": 0.1}, max_steps)
    expected = [_nemo_cosine_annealing(s, 1.0, 0.1, warmup, constant, max_steps) for s in range(max_steps)]
    assert lrs == pytest.approx(expected)
    held = "after warm-up the LR stays at min_lr=0.1, as NeMo's CosineAnnealing does" in caplog.text
    assert held == (max_steps > warmup and max_steps - constant <= warmup and constant > 0)
    within = f"the run's {max_steps} steps end within the warm-up (warmup_steps={warmup}): the LR stays below"
    assert (within in caplog.text) == (max_steps <= warmup)
    if (warmup, constant) == (4, 2):  # by hand: 0, lr/4, ..., then cosine over 8 steps, then min_lr
        assert lrs[:5] == pytest.approx([0.0, 0.25, 0.5, 0.75, 1.0])
        assert lrs[8] == pytest.approx(0.1 + 0.9 * 0.5)
        assert lrs[12:] == pytest.approx([0.1, 0.1])
    if (warmup, constant) == (4, 0):
        assert lrs[:5] == pytest.approx([0.2, 0.4, 0.6, 0.8, 1.0])


def test_schedule_ratios_and_start_up_refusals(caplog):
    """NeMo's warmup_ratio/constant_ratio (a share of the run's steps) give the same LRs as the steps
    they stand for; a phase given both ways, min_lr above lr and keys the schedule does not read are
    named at start-up (check_keys), before any model loads."""
    import logging

    from omegaconf import OmegaConf

    from nemo_aligner.utils.config_keys import check_keys, load_shipped

    cosine = {"name": "CosineAnnealing", "min_lr": 0.1}
    by_ratio = scheduled_lrs(dict(cosine, warmup_ratio=0.2, constant_ratio=0.25), 20)
    assert by_ratio == pytest.approx(scheduled_lrs(dict(cosine, warmup_steps=4, constant_steps=5), 20))
    assert by_ratio[:5] == pytest.approx([0, 0.25, 0.5, 0.75, 1.0])
    cases = [({"model.optim.sched.warmup_ratio": 0.1},  # the shipped warmup_steps: 10 is still set
              r"^model\.optim\.sched\.warmup_steps=10 and model\.optim\.sched\.warmup_ratio=0\.1 are both set: "
              r"NeMo takes one of them \(set warmup_steps=null to use the ratio\)$"),
             ({"model.optim.sched.constant_ratio": 0.1}, r"constant_steps=1000 and model\.optim\.sched\.constant_ratio"),
             ({"model.optim.lr": 5e-7}, r"^model\.optim\.sched\.min_lr=9e-07 is above model\.optim\.lr=5e-07: "
                                        r"CosineAnnealing decays from lr down to min_lr$")]
    for values, message in cases:
        cfg = load_shipped("gpt_sft")
        for key, value in values.items():
            OmegaConf.update(cfg, key, value, force_add=True)
        with pytest.raises(ConfigError, match=message):
            check_keys(cfg, "gpt_sft")
    cfg = load_shipped("gpt_sft")
    OmegaConf.update(cfg, "model.optim.sched.warmup_steps", None)
    OmegaConf.update(cfg, "model.optim.sched.warmup_ratio", 0.1, force_add=True)
    OmegaConf.update(cfg, "model.optim.sched.hold_steps", 5, force_add=True)
    with caplog.at_level(logging.WARNING):
        check_keys(cfg, "gpt_sft")
    assert "model.optim.sched.hold_steps is not read: the schedule reads name, warmup_steps, warmup_ratio" in caplog.text
    assert "warmup_ratio is not read" not in caplog.text


def test_schedule_constant_and_refusals():
    from omegaconf import OmegaConf

    from nemo_aligner.utils.optim import build_scheduler

    param = torch.nn.Parameter(torch.zeros(1))
    constant = build_scheduler(torch.optim.SGD([param], lr=1.0), OmegaConf.create({"lr": 0.5}), max_steps=3)
    assert constant.get_lr({"lr_mult": 1.0}) == 0.5
    from nemo_aligner.utils.errors import ConfigError

    upwards = OmegaConf.create({"lr": 1e-4, "sched": {"name": "CosineAnnealing", "min_lr": 1e-3}})
    with pytest.raises(ConfigError, match=r"model\.optim\.sched\.min_lr=0\.001 is above model\.optim\.lr=0\.0001: "
                                          r"CosineAnnealing decays from lr down to min_lr"):
        build_scheduler(torch.optim.SGD([param], lr=1.0), upwards, max_steps=10)


def test_optimizer_config_reads_nemos_keys_and_null_means_the_default():
    from omegaconf import OmegaConf

    from nemo_aligner.utils.optim import optimizer_config

    given = optimizer_config(OmegaConf.create({"name": "distributed_fused_adam", "lr": 3e-4, "betas": [0.8, 0.9],
                                               "eps": 1e-5, "weight_decay": 0.1, "initial_loss_scale": 1024}),
                             torch.float32, clip_grad=1.0)
    assert (given.lr, given.adam_beta1, given.adam_beta2, given.adam_eps, given.weight_decay, given.initial_loss_scale,
            given.use_distributed_optimizer, given.clip_grad) == (3e-4, 0.8, 0.9, 1e-5, 0.1, 1024.0, True, 1.0)
    nulls = optimizer_config(OmegaConf.create({"lr": 1e-4, "eps": None, "initial_loss_scale": None, "weight_decay": None}),
                             torch.float32, clip_grad=0.0)
    assert (nulls.adam_eps, nulls.initial_loss_scale, nulls.weight_decay) == (1e-8, 2.0**16, 0.0)


def test_byte_tokenizer_round_trip():
    tok = ByteTokenizer()
    ids = tok.text_to_ids("héllo<eos>")
    assert ids[-1] == tok.eos_id and tok.ids_to_text(ids) == "héllo"
    assert tok.ids_to_text(ids, skip_special=False) == "héllo<eos>"
    assert tok.vocab_size == 262


def test_checkpoint_pruning_keeps_top_k_and_newest(tmp_path):
    import json
    import os

    from nemo_aligner.utils.checkpoint_callback import CheckpointCallback, latest_checkpoint

    losses = {1: 0.9, 2: 0.5, 3: 0.7, 4: 0.3, 5: 0.8}
    for step, loss in losses.items():
        d = tmp_path / f"ck-step={step}"
        d.mkdir()
        (d / "metadata.json").write_text("{}")
        (d / "trainer_state.json").write_text(json.dumps({"step": step, "monitor_value": loss}))
    (tmp_path / "ck-step=6.tmp").mkdir()  # an interrupted save
    cb = CheckpointCallback(str(tmp_path), "ck-{step}", monitor="val_loss", mode="min", save_top_k=2)
    cb.prune()
    kept = sorted(p for p in os.listdir(tmp_path) if not p.endswith(".tmp"))
    assert kept == ["ck-step=2", "ck-step=4", "ck-step=5"]  # best two + the newest
    assert latest_checkpoint(str(tmp_path)).endswith("ck-step=5")
    assert cb.best().endswith("ck-step=4")
    maximize = CheckpointCallback(str(tmp_path), "ck-{step}", monitor="acc", mode="max", save_top_k=1)
    maximize.prune()
    assert sorted(p for p in os.listdir(tmp_path) if not p.endswith(".tmp")) == ["ck-step=5"]
    # a checkpoint missing its metadata is not resumed from, and is named as incomplete
    from nemo_aligner.utils.checkpoint_callback import incomplete_checkpoints

    (tmp_path / "ck-step=7").mkdir()
    (tmp_path / "ck-step=7" / "trainer_state.json").write_text(json.dumps({"step": 7}))
    assert latest_checkpoint(str(tmp_path)).endswith("ck-step=5")
    assert incomplete_checkpoints(str(tmp_path)) == [str(tmp_path / "ck-step=7")]


def test_checkpoints_nemo_wrote_are_recognised_by_their_files_and_read_by_their_names(tmp_path):
    """NeMo-Aligner's trainers read their state back from the checkpoint's name; so does a resume here.
    A directory with this project's trainer_state.json or RNG files is not NeMo's; NeMo's -unfinished
    marker keeps a save from being resumed (and an explicit resume from it is one error)."""
    from nemo_aligner.utils.checkpoint_callback import incomplete_checkpoints, latest_checkpoint, nemo_written_checkpoints
    from nemo_aligner.utils.errors import CheckpointError
    from nemo_aligner.utils.train_checkpoint import load_train_checkpoint, nemo_written_state

    def make(name, *files):
        path = tmp_path / name
        path.mkdir()
        for f in ("metadata.json", *files):
            (path / f).write_text("{}")
        return str(path)

    cases = {  # NeMo-Aligner's shipped checkpoint file names
        "megatron_gpt_sft--validation_loss=0.512-step=400-consumed_samples=12800.0-epoch=3-last":
            {"step": 400, "consumed_samples": 12800, "epoch": 3},
        "megatron_gpt-step=30-consumed_samples=1920.0-ppo_optimization_step=120.0-epoch=0-val_rewards=0.812":
            {"step": 30, "consumed_samples": 1920, "epoch": 0, "ppo_optimization_step": 120},
        "megatron_gpt-step=7-consumed_samples=56-reinforce_optimization_step=14-epoch=0-val_rewards=nan":
            {"step": 7, "consumed_samples": 56, "epoch": 0, "ppo_optimization_step": 14},
        "megatron_gpt-step=9-consumed_samples=72-rs_optimization_step=18-epoch=1-val_global_rewards=0.5":
            {"step": 9, "consumed_samples": 72, "epoch": 1, "ppo_optimization_step": 18},
        "megatron_gpt-step=12": {"step": 12, "consumed_samples": 0},  # the PPO critic's
    }
    for name, want in cases.items():
        assert nemo_written_state(make(name)) == dict(want, written_by="nemo"), name
    assert nemo_written_state(make("megatron_gpt--val_loss=1.2-last")) is None  # no step=
    ours = make("ours-step=5", "rng_state_0.pt")
    (tmp_path / "ours-step=5" / "trainer_state.json").write_text('{"step": 5}')
    assert nemo_written_state(ours) is None
    assert nemo_written_state(make("ours-damaged-step=600", "rng_state_0.pt")) is None
    assert str(tmp_path / "ours-damaged-step=600") in incomplete_checkpoints(str(tmp_path))
    # the newest by step among ours and NeMo's
    assert latest_checkpoint(str(tmp_path)).endswith("validation_loss=0.512-step=400-consumed_samples=12800.0-epoch=3-last")
    (tmp_path / "ours-step=5" / "trainer_state.json").write_text('{"step": 401}')
    assert latest_checkpoint(str(tmp_path)) == ours
    (tmp_path / "ours-step=5" / "trainer_state.json").write_text('{"step": 5}')
    unfinished = make("megatron_gpt-step=1000-consumed_samples=8000")
    (tmp_path / "megatron_gpt-step=1000-consumed_samples=8000-unfinished").write_text("")
    assert unfinished not in [p for p, _ in nemo_written_checkpoints(str(tmp_path))]
    assert unfinished in incomplete_checkpoints(str(tmp_path))
    assert latest_checkpoint(str(tmp_path)).endswith("validation_loss=0.512-step=400-consumed_samples=12800.0-epoch=3-last")
    with pytest.raises(CheckpointError, match=r"step=1000-consumed_samples=8000: NeMo marked it unfinished"):
        load_train_checkpoint(unfinished, None, None, None)
    with pytest.raises(CheckpointError, match=r"not a training checkpoint \(no trainer_state\.json, and not a NeMo"):
        load_train_checkpoint(str(tmp_path / "megatron_gpt--val_loss=1.2-last"), None, None, None)
    # a run that does not resume moves NeMo's checkpoints aside as it does its own
    from nemo_aligner.utils.exp_manager import set_aside_earlier_checkpoints

    nemo_only = tmp_path / "run" / "checkpoints"
    nemo_only.mkdir(parents=True)
    (nemo_only / "megatron_gpt-step=3").mkdir()
    (nemo_only / "megatron_gpt-step=3" / "metadata.json").write_text("{}")
    moved = set_aside_earlier_checkpoints(str(nemo_only))
    assert moved and os.path.isdir(os.path.join(moved, "megatron_gpt-step=3")) and os.listdir(nemo_only) == []


@pytest.mark.stack
@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU patches apply only where no GPU is visible")
def test_cpu_gradient_clipping_ops_match_megatron_fallbacks():
    """The foreach norm/scale used for clipping on a CPU equal megatron-core's per-tensor fallbacks,
    and clipping goes through them once the CPU patches are applied."""
    from megatron.core import utils as mutils
    from megatron.core.optimizer import clip_grads

    from nemo_aligner.utils.patches import cpu_compat

    cpu_compat.apply_cpu_patches()
    assert clip_grads.l2_norm_impl is cpu_compat._foreach_l2_norm
    assert clip_grads.multi_tensor_scale_impl is cpu_compat._foreach_scale
    torch.manual_seed(0)
    grads = [torch.randn(5, 3), torch.randn(7), torch.randn(2, 2, 2)]
    ours, _ = cpu_compat._foreach_l2_norm(0, None, [grads], False)
    ref, _ = mutils.local_multi_tensor_l2_norm(0, None, [grads], False)
    torch.testing.assert_close(ours, ref.reshape(1))
    expected = [g * 0.3 for g in grads]
    copies = [g.clone() for g in grads]
    cpu_compat._foreach_scale(0, None, [copies, copies], 0.3)  # in place, as clipping calls it
    out = [torch.empty_like(g) for g in grads]
    cpu_compat._foreach_scale(0, None, [grads, out], 0.3)
    for a, b, c in zip(copies, out, expected):
        torch.testing.assert_close(a, c)
        torch.testing.assert_close(b, c)


def test_accelerator_must_match_the_machine(monkeypatch):
    """``trainer.accelerator`` names what the run will use: a GPU request without one, or a CPU
    request where a GPU is visible (everything would follow the GPU), is refused naming the key."""
    from omegaconf import OmegaConf

    from nemo_aligner.utils.run_setup import check_accelerator

    def check(value):
        check_accelerator(OmegaConf.create({"accelerator": value}))

    with pytest.raises(ConfigError, match="trainer.accelerator='tpu' must be auto, cpu or gpu"):
        check("tpu")
    for gpu_visible in (False, True):
        monkeypatch.setattr(torch.cuda, "is_available", lambda: gpu_visible)
        check("auto")
        if gpu_visible:
            check("gpu")
            with pytest.raises(ConfigError, match="trainer.accelerator=cpu but a GPU is visible"):
                check("cpu")
        else:
            check("cpu")
            with pytest.raises(ConfigError, match="trainer.accelerator=gpu but no GPU is visible"):
                check("gpu")


def test_ppo_local_splits_the_cores_between_its_jobs(monkeypatch):
    """Critic server and actor run at once: without OMP_NUM_THREADS each process gets an even share
    of the cores (at least one); a user's setting is kept."""
    from nemo_aligner.launchers.ppo_local import job_env

    monkeypatch.setattr("os.sched_getaffinity", lambda pid: set(range(16)), raising=False)
    assert job_env(2, {"PATH": "/bin"}) == {"PATH": "/bin", "OMP_NUM_THREADS": "8"}
    assert job_env(1 + 4, {})["OMP_NUM_THREADS"] == "3"
    assert job_env(32, {})["OMP_NUM_THREADS"] == "1"
    assert job_env(2, {"OMP_NUM_THREADS": "6"})["OMP_NUM_THREADS"] == "6"
    assert job_env(2, {"OMP_NUM_THREADS": ""})["OMP_NUM_THREADS"] == "8"  # empty counts as unset


def test_ppo_local_hands_hydra_flags_to_their_job(monkeypatch):
    """A job's words run to the next job flag or launcher option: Hydra's --config-path/--config-name
    (a user's own config files) reach the script instead of stopping argparse."""
    from nemo_aligner.launchers import ppo_local

    got = {}
    monkeypatch.setattr(ppo_local, "run", lambda critic, actor, *rest: got.update(critic=critic, actor=actor, rest=rest) or 0)
    argv = ["--port", "5557", "--critic", "--config-path=/my/conf", "--config-name", "gpt_ppo_critic", "a=1",
            "--actor", "-cp", "/my/conf", "-cn=gpt_ppo_actor", "++b={x: [1]}", "--actor-nproc=2", "--critic-log", "c.log"]
    assert ppo_local.main(argv) == 0
    assert got["critic"] == ["--config-path=/my/conf", "--config-name", "gpt_ppo_critic", "a=1"]
    assert got["actor"] == ["-cp", "/my/conf", "-cn=gpt_ppo_actor", "++b={x: [1]}"]
    assert got["rest"] == (1, 2, 5557, "c.log", 600.0)
    # the order of the groups is free, and a job flag may come twice (its words add up)
    ppo_local.main(["--actor", "x=1", "--critic", "y=2", "--actor", "z=3"])
    assert got["critic"] == ["y=2"] and got["actor"] == ["x=1", "z=3"]


def test_ppo_local_ports_compose_with_a_config_that_lacks_them(tmp_path):
    """NeMo-Aligner's gpt_ppo_critic.yaml names only trainer.ppo.port: the launcher's gRPC and metrics
    ports are added to such a user config instead of stopping Hydra ('Key grpc_port is not in struct')."""
    from hydra import compose, initialize_config_dir

    from nemo_aligner.launchers.ppo_local import server_ports

    (tmp_path / "my_critic.yaml").write_text("trainer:\n  ppo:\n    port: 5556\n    combine_rm_and_critic_server: True\n")
    with initialize_config_dir(config_dir=str(tmp_path), version_base=None):
        cfg = compose(config_name="my_critic", overrides=server_ports(6000))
    ppo = cfg.trainer.ppo
    assert ppo.port == 6000 and len({ppo.port, ppo.grpc_port, ppo.metrics_port}) == 3, ppo


def test_ppo_local_passes_stop_signals_on():
    """SIGTERM/SIGINT to both jobs; SIGUSR1 (the actor's save-and-stop) to the actor only (the server's
    default action for it would kill it), or as SIGTERM to the server before the actor starts; jobs that
    have exited get nothing."""
    import signal

    from nemo_aligner.launchers.ppo_local import pass_on

    class Job:
        def __init__(self, running=True):
            self.running, self.got = running, []

        def poll(self):
            return None if self.running else 0

        def send_signal(self, sig):
            self.got.append(sig)

    for sig in (signal.SIGTERM, signal.SIGINT):
        actor, critic = Job(), Job()
        pass_on(sig, actor, critic)
        assert actor.got == [sig] and critic.got == [sig]
    actor, critic = Job(), Job()
    pass_on(signal.SIGUSR1, actor, critic)
    assert actor.got == [signal.SIGUSR1] and critic.got == []
    critic = Job()
    pass_on(signal.SIGUSR1, None, critic)
    assert critic.got == [signal.SIGTERM]
    actor, critic = Job(running=False), Job()
    pass_on(signal.SIGUSR1, actor, critic)
    assert actor.got == [] and critic.got == [signal.SIGTERM]


def test_demo_report_table_and_curves(tmp_path, capsys):
    """The demo's summary: first and last of the training metrics, each policy's task and reward-model
    scores with their change from the SFT model's, the half-gap target, and report.png written."""
    from nemo_aligner.demo import report

    def write(d, records):
        (tmp_path / d).mkdir(parents=True)
        (tmp_path / d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))

    write("sft", [{"step": 1, "train/loss": 3.0, "val/loss": 2.5}, {"step": 2, "train/loss": 1.0, "val/loss": 0.5}])
    write("rm", [{"step": 1, "train/loss": 1.0, "val/mse": 0.6}, {"step": 2, "val/mse": 0.25}])
    write("dpo", [{"step": 1, "train/preference_loss": 0.7, "val/accuracy": 0.8}, {"step": 2, "val/accuracy": 0.95}])
    for d in ("ppo_actor", "rloo", "grpo/fit_1", "rs/fit_1"):
        write(d, [{"step": 0, "val/global_rewards": 0.1}, {"step": 5, "train/rewards": 1.0, "val/global_rewards": 0.7}])
    scores = {"SFT": (0.5, 1.0), "PPO": (0.25, 3.0), "DPO": (0.75, 1.5), "RLOO": (0.8, 1.25), "GRPO": (0.875, 2.0),
              "RS": (0.5, 0.5)}
    report(str(tmp_path), scores)
    out = capsys.readouterr().out
    table = {line[:48].strip(): line[48:].split() for line in out.splitlines() if len(line) > 48}
    assert table["SFT validation loss"] == ["2.500", "0.500"]
    assert table["reward model squared error (held-out answers)"] == ["0.600", "0.250"]
    assert table["DPO preference accuracy (held-out pairs)"] == ["0.800", "0.950"]
    assert "Half the gap from SFT to perfect: 0.750." in out
    rows = {line.split()[0]: line.split()[1:] for line in out.splitlines()
            if line.split() and line.split()[0] in scores}
    assert rows["SFT"] == ["0.500", "1.000"]
    assert rows["PPO"] == ["0.250", "-0.250", "3.000", "+2.000"]
    assert rows["GRPO"] == ["0.875", "+0.375", "2.000", "+1.000"]
    assert rows["RS"] == ["0.500", "+0.000", "0.500", "-0.500"]
    assert (tmp_path / "report.png").stat().st_size > 0 and not (tmp_path / "report.png.tmp.png").exists()


def test_free_ports_do_not_follow_the_training_seed():
    """Training seeds the global ``random`` (seed_everything), identically in every process of a
    run and in every test worker: ports drawn from it would repeat across processes and collide
    when two servers start at once."""
    import random

    from nemo_aligner.utils.ports import free_port

    draws = []
    for _ in range(2):
        random.seed(1234)
        draws.append([free_port() for _ in range(5)])
    assert draws[0] != draws[1]
    assert all(20000 <= p <= 32000 for p in draws[0] + draws[1])


def test_free_ports_drawn_in_one_go_all_differ():
    """Ports drawn for several servers before any of them binds: 1000 draws from the 8000 ports of
    their range would repeat ~60 times by chance."""
    from nemo_aligner.utils.ports import free_port

    ports = [free_port() for _ in range(1000)]
    assert len(set(ports)) == len(ports)


def test_ports_bound_at_once_are_drawn_apart_from_ports_told_to_servers():
    """A server told a port binds it only after loading its model; meanwhile another process's draw
    for a port it binds at once (its rendezvous store, its tritonserver) must not take it."""
    from nemo_aligner.utils.ports import free_port

    told = {free_port() for _ in range(300)}
    at_once = {free_port(bound_at_once=True) for _ in range(300)}
    assert all(20000 <= p <= 27999 for p in told) and all(28000 <= p <= 32000 for p in at_once)


def test_processes_drawing_ports_at_once_never_hand_out_the_same_port(tmp_path):
    """Two processes (two launchers, two test workers) each draw 150 ports from the same 400 at once:
    by chance ~56 would coincide; with the claim files none does."""
    low = 24000
    script = ("import sys; from nemo_aligner.utils import ports\n"
              f"ports.REGISTRY_ROOT = {str(tmp_path)!r}; ports._TOLD = ({low}, {low + 399})\n"
              "sys.stdin.readline()\n"  # both start drawing together
              "print(' '.join(str(ports.free_port()) for _ in range(150)))\n")
    procs = [subprocess.Popen([sys.executable, "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
             for _ in range(2)]
    for proc in procs:
        proc.stdin.write("go\n")
        proc.stdin.flush()
    drawn = [set(map(int, proc.communicate(timeout=120)[0].split())) for proc in procs]
    assert all(len(d) == 150 and all(low <= p < low + 400 for p in d) for d in drawn)
    assert not drawn[0] & drawn[1]


def test_port_claims_expire_and_a_fully_claimed_range_still_draws(tmp_path, monkeypatch):
    """A claim older than ten minutes is void; where every port of the range is claimed, the claims are
    passed over rather than drawing forever."""
    import time

    from nemo_aligner.utils import ports

    low = next(p for p in range(25000, 27000, 3) if all(_bindable(q) for q in range(p, p + 3)))
    monkeypatch.setattr(ports, "REGISTRY_ROOT", str(tmp_path))
    monkeypatch.setattr(ports, "_TOLD", (low, low + 2))
    monkeypatch.setattr(ports, "_handed_out", set())
    monkeypatch.setattr(ports, "_CLAIM_TRIES", 50)
    registry = tmp_path / f"nemo_aligner_ports_{os.getuid()}"
    registry.mkdir(mode=0o700)
    for port in (low, low + 1, low + 2):
        (registry / str(port)).touch()
    old = time.time() - 601
    os.utime(registry / str(low + 2), (old, old))
    assert ports.free_port() == low + 2  # the void claim taken over, the live ones left
    assert time.time() - (registry / str(low + 2)).stat().st_mtime < 60
    assert ports.free_port() in (low, low + 1)  # all claimed: passed over after _CLAIM_TRIES draws


def _bindable(port):
    import socket

    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def test_nemo_keys_without_an_implementation_are_accepted_only_when_off():
    from nemo_aligner.utils.config_checks import _is_off

    assert _is_off("none", ("none", None)) and _is_off("None", ("none", None)) and _is_off(None, ("none", None))
    assert not _is_off("lora", ("none", None))
    assert _is_off(1, (1, 1.0, None)) and _is_off(1.0, (1, 1.0, None)) and not _is_off(1.2, (1, 1.0, None))
    assert not _is_off(True, (1, 1.0, None))  # True == 1 in Python, but is not a penalty of 1
    assert _is_off(False, (False, None)) and not _is_off(True, (False, None)) and not _is_off(0, (False, None))


def test_limit_batches_zero_fraction_turns_the_loop_off():
    from nemo_aligner.data.nlp.builders import limit_batches

    assert limit_batches(0.0, 10) == 0 == limit_batches(0, 10)
    assert limit_batches(0.01, 10) == 1 and limit_batches(0.5, 10) == 5 and limit_batches(None, 10) == 10
    assert limit_batches(-1, 10) == 10 and limit_batches(3, 10) == 3


def test_run_interpolations_see_the_checkpoints_sequence_length():
    """The shipped RL configs default ``length_params.max_length`` to ``${int_div:${model.encoder_seq_length}, 2}``
    with ``encoder_seq_length: null`` (the checkpoint's): it resolves against the checkpoint's value."""
    from omegaconf import OmegaConf

    import nemo_aligner.utils.hydra_runner  # noqa: F401  (registers int_div)
    from nemo_aligner.utils.model_config import merge_checkpoint_config

    root = OmegaConf.create({"model": {"encoder_seq_length": None,
                                       "rs": {"length_params": {"max_length": "${int_div:${model.encoder_seq_length}, 2}"}}}})
    merged = merge_checkpoint_config(OmegaConf.create({"encoder_seq_length": 48, "num_layers": 2}), root.model)
    assert merged.encoder_seq_length == 48 and merged.rs.length_params.max_length == 24
    root.model.encoder_seq_length = 64  # a value the run sets wins
    assert merge_checkpoint_config(OmegaConf.create({"encoder_seq_length": 48}), root.model).rs.length_params.max_length == 32


def test_a_run_head_setting_that_differs_from_a_reward_models_is_warned(caplog):
    """``use_avg_pool`` is a run setting (the run's value wins, as in NeMo); a critic that turns off
    the pooling a reward model was trained with is told, an SFT checkpoint (no head) is not."""
    import logging

    from omegaconf import OmegaConf

    from nemo_aligner.utils.model_config import merge_checkpoint_config

    rm = OmegaConf.create({"num_layers": 2, "reward_model_type": "regression", "use_avg_pool": True})
    with caplog.at_level(logging.WARNING, logger="nemo_aligner.utils.model_config"):
        merged = merge_checkpoint_config(rm, OmegaConf.create({"use_avg_pool": False}))
    assert merged.use_avg_pool is False
    assert [r.getMessage() for r in caplog.records] == [
        "model.use_avg_pool=False differs from the reward-model checkpoint's True, which its head was trained "
        "with: pass model.use_avg_pool=True to keep it"]
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="nemo_aligner.utils.model_config"):
        merge_checkpoint_config(rm, OmegaConf.create({"use_avg_pool": True}))
        merge_checkpoint_config(OmegaConf.create({"num_layers": 2, "use_avg_pool": True}),
                                OmegaConf.create({"use_avg_pool": False}))
    assert caplog.records == []


def test_a_model_precision_other_than_the_trainers_is_warned(caplog):
    """``model.precision`` is ``${trainer.precision}`` in NeMo-Aligner's configs and read by nothing: set to
    another precision it is named in a warning; other spellings of the same precision are not."""
    import logging

    from omegaconf import OmegaConf

    from nemo_aligner.utils.config_keys import warn_model_precision

    with caplog.at_level(logging.WARNING, logger="nemo_aligner.utils.config_keys"):
        warn_model_precision(OmegaConf.create({"trainer": {"precision": 32}, "model": {"precision": "bf16"}}))
        warn_model_precision(OmegaConf.create({"trainer": {"precision": "bf16-mixed"}, "model": {"precision": -5}}))
    assert [r.getMessage() for r in caplog.records] == [
        "model.precision=bf16 is not read: the run's precision is trainer.precision=32",
        "model.precision=-5 is not read: the run's precision is trainer.precision=bf16-mixed"]
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="nemo_aligner.utils.config_keys"):
        for model, trainer in (("bf16", "bf16-mixed"), ("${trainer.precision}", 16), (32, "32"), (None, "bf16")):
            warn_model_precision(OmegaConf.create({"trainer": {"precision": trainer}, "model": {"precision": model}}))
    assert caplog.records == []


def test_an_alias_left_at_its_shipped_interpolation_does_not_disagree(caplog):
    """inference_rm.yaml: NeMo-Aligner's inference.inference_micro_batch_size defaults to
    ${model.forward_micro_batch_size}; setting only our inference.micro_batch_size uses it without a
    warning, while both set to different values warns and uses ours."""
    import logging

    from nemo_aligner.utils.config_keys import load_shipped, resolve_aliases

    for ours, theirs, warned in ((2, None, False), (None, 8, False), (2, 8, True)):
        cfg = load_shipped("inference_rm")
        if ours is not None:
            cfg.inference.micro_batch_size = ours
        if theirs is not None:
            cfg.inference.inference_micro_batch_size = theirs
        caplog.clear()
        with caplog.at_level(logging.WARNING):
            resolve_aliases(cfg)
        expected = ours if ours is not None else theirs
        assert cfg.inference.micro_batch_size == expected == cfg.inference.inference_micro_batch_size
        assert ("name one setting" in caplog.text) == warned, (ours, theirs, caplog.text)


def test_nemo_aligner_tutorial_values_are_accepted(caplog):
    """Values NeMo-Aligner's tutorials pass: trt_llm.enable=True runs (a warning: rollouts come from
    this project's engine), and a per-split dict for n_examples_per_chunk (shipped: null) is its value."""
    import logging

    from omegaconf import OmegaConf

    from nemo_aligner.utils.config_keys import check_keys, load_shipped

    cfg = load_shipped("gpt_reinforce_actor")
    OmegaConf.update(cfg, "trainer.reinforce.trt_llm.enable", True, force_add=True)
    with caplog.at_level(logging.WARNING):
        check_keys(cfg, "gpt_reinforce_actor", ["trainer.reinforce.trt_llm.enable=True"])
    assert "trainer.reinforce.trt_llm.enable=True: TensorRT-LLM is not used" in caplog.text
    caplog.clear()
    cfg = load_shipped("gpt_knowledge_distillation")
    OmegaConf.update(cfg, "model.data.n_examples_per_chunk", {"train": 4, "validation": 2}, force_add=True)
    OmegaConf.update(cfg, "model.data.chunk_count", 3, force_add=True)  # a key nothing reads: still named
    with caplog.at_level(logging.WARNING):
        check_keys(cfg, "gpt_knowledge_distillation", [])
    assert "model.data.chunk_count is not read by nemo-aligner" in caplog.text
    assert "n_examples_per_chunk" not in caplog.text


# NeMo-Aligner's shipped values (examples/nlp/gpt/conf/<name>.yaml): lr, weight_decay, warmup_steps,
# constant_steps, min_lr (gpt_grpo, this project's own, takes the actors').
ALIGNER_OPTIM = {
    "gpt_sft": (3e-5, 0.01, 10, 1000, 9e-7), "training_rm": (9e-6, 0.1, 10, 1000, 9e-7),
    "gpt_dpo": (9e-6, 0.1, 10, 1000, 9e-7), "gpt_kto": (9e-6, 0.1, 10, 1000, 9e-7),
    "gpt_spin": (9e-6, 0.1, 10, 1000, 9e-7), "gpt_knowledge_distillation": (3e-5, 0.01, 10, 1000, 9e-7),
    "gpt_ppo_critic": (9e-6, 0.1, 10, 1000, 9e-7), "gpt_ppo_actor": (9e-7, 0.1, 10, 1000, 9e-8),
    "gpt_reinforce_actor": (9e-7, 0.1, 10, 1000, 9e-8), "gpt_rs_actor": (9e-7, 0.1, 10, 1000, 9e-8),
    "gpt_grpo": (9e-7, 0.1, 10, 1000, 9e-8),
}


@pytest.mark.parametrize("name", sorted(ALIGNER_OPTIM))
def test_optimizer_defaults_are_nemo_aligners(name):
    """The scripts' optimizer defaults are NeMo-Aligner's, and the learning rates its tutorials set alone
    (SFT 5e-6, CAI's SFT 1e-6, distillation 1e-5, SteerLM's reward model 2e-6) build a schedule."""
    from nemo_aligner.utils.config_keys import load_shipped
    from nemo_aligner.utils.optim import build_scheduler

    optim = load_shipped(name).model.optim
    assert (float(optim.lr), float(optim.weight_decay), optim.sched.warmup_steps, optim.sched.constant_steps,
            float(optim.sched.min_lr)) == ALIGNER_OPTIM[name]
    if name == "gpt_kto":
        assert load_shipped(name).model.kto.ref_policy_kl_penalty == 0.2
    param = torch.nn.Parameter(torch.zeros(1))
    for lr in {"gpt_sft": (5e-6, 1e-6), "gpt_knowledge_distillation": (1e-5,), "training_rm": (2e-6,)}.get(name, ()):
        optim.lr = lr
        sched = build_scheduler(torch.optim.SGD([param], lr=1.0), optim, max_steps=2000)
        assert sched.max_lr == lr and sched.min_lr == 9e-7


# NeMo-Aligner's shipped batch sizes (examples/nlp/gpt/conf/<name>.yaml)
ALIGNER_BATCH = {
    "gpt_sft": {"model.data.train_ds.global_batch_size": 128, "model.data.train_ds.micro_batch_size": 1,
                "model.global_batch_size": 128, "model.micro_batch_size": 1,
                "model.data.validation_ds.global_batch_size": 128, "model.steerlm2.micro_batch_size": 1},
    "training_rm": {"model.global_batch_size": 64, "model.micro_batch_size": 2},
    "gpt_ppo_critic": {"model.global_batch_size": 64, "model.micro_batch_size": 1},
    **{name: {"model.global_batch_size": 64, "model.micro_batch_size": 1}
       for name in ("gpt_dpo", "gpt_kto", "gpt_spin", "gpt_knowledge_distillation")},
    **{name: {"model.global_batch_size": 64, "model.micro_batch_size": 1,
              f"model.{alg}.num_rollout_samples": 512, f"model.{alg}.num_val_samples": 512,
              f"model.{alg}.rollout_micro_batch_size": 8}
       for name, alg in (("gpt_ppo_actor", "ppo"), ("gpt_reinforce_actor", "reinforce"), ("gpt_rs_actor", "rs"))},
}


@pytest.mark.parametrize("name", sorted(ALIGNER_BATCH))
def test_batch_size_defaults_are_nemo_aligners(name):
    """The scripts' batch sizes are NeMo-Aligner's (made for a cluster); the demo's tiny-model values
    are overrides that each of those scripts accepts."""
    from omegaconf import OmegaConf

    from nemo_aligner.demo import TINY_BATCH
    from nemo_aligner.utils.config_keys import load_shipped

    cfg = load_shipped(name)
    assert {key: OmegaConf.select(cfg, key) for key in ALIGNER_BATCH[name]} == ALIGNER_BATCH[name]
    script = {"gpt_sft": "train_gpt_sft.py", "gpt_dpo": "train_gpt_dpo.py", "gpt_kto": "train_gpt_kto.py",
              "training_rm": "train_reward_model.py", "gpt_ppo_critic": "serve_ppo_critic.py",
              "gpt_reinforce_actor": "train_gpt_reinforce_actor.py"}.get(name)
    for override in TINY_BATCH.get(script, ()):
        key, value = override.split("=")
        assert OmegaConf.select(cfg, key) not in (None, int(value)), override  # an existing key, a new value


@pytest.mark.parametrize("name, metrics, expected", [
    ("gpt_sft", {"val_loss": 1.25, "validation_loss": 1.25},
     "megatron_gpt_sft--val_loss=1.250-step=4-consumed_samples=64-epoch=0"),
    ("training_rm", {"val_loss": 0.5}, "megatron_gpt--val_loss=0.500-step=4-consumed_samples=64-epoch=0"),
    ("gpt_ppo_actor", {"val_global_rewards": 0.5, "ppo_optimization_step": 8},
     "megatron_gpt-step=4-consumed_samples=64-ppo_optimization_step=8-epoch=0-val_rewards=0.500"),
    ("gpt_reinforce_actor", {"val_global_rewards": 0.5, "ppo_optimization_step": 8},
     "megatron_gpt-step=4-consumed_samples=64-reinforce_optimization_step=8-epoch=0-val_rewards=0.500"),
])
def test_checkpoint_names_are_nemo_aligners(name, metrics, expected):
    """The shipped monitor and filename are NeMo-Aligner's (checkpoint directories get its names) and
    fill from the metrics the trainers log; the monitor reads the same value."""
    from nemo_aligner.utils.checkpoint_callback import CheckpointCallback
    from nemo_aligner.utils.config_keys import load_shipped

    params = load_shipped(name).exp_manager.checkpoint_callback_params
    values = {"step": 4, "consumed_samples": 64, "epoch": 0, **metrics}
    assert format_checkpoint_name(params.filename, values) == expected
    value = CheckpointCallback("/tmp", params.filename, monitor=params.monitor, mode=params.mode).monitor_value(values)
    assert value == next(v for k, v in metrics.items() if k.startswith("val"))


def test_the_checkpoints_architecture_wins_with_a_warning_only_for_what_the_command_line_set(caplog):
    """The shipped configs' tiny-model shape gives way to a checkpoint's silently; a value the
    command line set (``model.num_layers=40``) is named in a warning with the checkpoint's."""
    import logging

    from omegaconf import OmegaConf

    from nemo_aligner.utils.model_config import merge_checkpoint_config, record_command_line

    ckpt = OmegaConf.create({"mcore_gpt": True, "num_layers": 32, "hidden_size": 4096})
    run = {"num_layers": 2, "hidden_size": 128, "micro_batch_size": 1}
    try:
        for keys, expected in (([], []), (["model.num_layers", "trainer.devices"], ["model.num_layers=2 (the checkpoint has 32)"])):
            record_command_line(keys)
            caplog.clear()
            with caplog.at_level(logging.INFO, logger="nemo_aligner.utils.model_config"):
                merged = merge_checkpoint_config(ckpt, OmegaConf.create(run))
            assert (merged.num_layers, merged.hidden_size) == (32, 4096)
            assert [r.getMessage() for r in caplog.records if r.levelno >= logging.INFO] == [
                f"the checkpoint's architecture wins over {e}: architecture keys shape a model built from scratch only"
                for e in expected]
    finally:
        record_command_line([])


def test_the_python_apis_architecture_values_are_named_like_the_command_lines(caplog):
    """``compose_config`` (every Python-API trainer's config) records the keys its caller set, so a
    checkpoint that overrides the caller's ``model.num_layers`` is named in a warning, as on the command
    line; the shipped tiny shape still gives way silently."""
    import logging

    from omegaconf import OmegaConf

    from nemo_aligner.trainers.base import compose_config
    from nemo_aligner.utils.model_config import merge_checkpoint_config, record_command_line

    ckpt = OmegaConf.create({"mcore_gpt": True, "num_layers": 32, "hidden_size": 4096})
    try:
        for values, expected in (({}, []), ({"model.num_layers": 3}, ["model.num_layers=3 (the checkpoint has 32)"])):
            cfg = compose_config("gpt_sft", values)
            caplog.clear()
            with caplog.at_level(logging.WARNING, logger="nemo_aligner.utils.model_config"):
                merged = merge_checkpoint_config(ckpt, cfg.model)
            assert (merged.num_layers, merged.hidden_size) == (32, 4096)
            assert [r.getMessage() for r in caplog.records] == [
                f"the checkpoint's architecture wins over {e}: architecture keys shape a model built from scratch only"
                for e in expected]
    finally:
        record_command_line([])


def test_a_layer_spec_name_counts_only_in_megatron_core_checkpoints():
    """NeMo reads ``model.name`` as the layer spec of its megatron-core GPT (``mcore_gpt: True``) and
    ignores it in its older GPT's checkpoints, whose configs may carry any name."""
    from omegaconf import OmegaConf

    from nemo_aligner.utils.model_config import merge_checkpoint_config

    run = OmegaConf.create({"micro_batch_size": 1})
    assert merge_checkpoint_config(OmegaConf.create({"mcore_gpt": True, "name": "te_gpt"}), run).name == "te_gpt"
    for legacy in ({"mcore_gpt": False, "name": "gpt"}, {"name": "gpt"}):
        merged = merge_checkpoint_config(OmegaConf.create(legacy), run)
        assert "name" not in merged and "mcore_gpt" not in merged
