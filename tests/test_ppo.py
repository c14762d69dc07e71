"""PPO end to end: the critic server (reward model co-located) and the actor, started together by the
local launcher; checkpoints of both, resume, learning on the built-in task, and a dead critic."""

import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

from conftest import SCRIPTS, free_port, read_metrics, run_ppo_local, run_script, subprocess_env, tiny_batch, tiny_optim


@pytest.fixture(scope="module")
def weak_sft_nemo(tmp_path_factory, task_data):
    """A briefly fine-tuned policy (about a third of answers right): room for PPO to improve."""
    out = tmp_path_factory.mktemp("weak_sft")
    run_script("train_gpt_sft.py", [
        f"model.data.train_ds.file_path={task_data['sft_train']}",
        f"model.data.validation_ds.file_path={task_data['sft_val']}",
        f"exp_manager.explicit_log_dir={out}", "trainer.sft.max_steps=120", "trainer.sft.max_epochs=100",
        "trainer.sft.val_check_interval=120", *tiny_optim(1e-3, 1e-4, 10)])
    return str(out / "checkpoints" / "megatron_gpt_sft.nemo")


def actor_overrides(data, actor_nemo, log_dir, steps, extra=()):
    return [f"pretrained_checkpoint.restore_from_path={actor_nemo}",
            f"++model.data.data_prefix={{train: [{data['prompts_train']}], validation: [{data['prompts_val']}]}}",
            f"exp_manager.explicit_log_dir={log_dir}", f"trainer.ppo.max_steps={steps}", "trainer.ppo.max_epochs=100",
            "model.ppo.num_rollout_samples=32", "model.global_batch_size=16", "model.micro_batch_size=8",
            "model.ppo.rollout_micro_batch_size=16", "model.ppo.length_params.max_length=12",
            "model.ppo.num_val_samples=32", *tiny_optim(1e-5, 1e-6, 0), *extra]


@pytest.mark.stack
def test_two_steps_checkpoints_and_resume(tmp_path, task_data, quick_rm, quick_sft):
    critic_dir, actor_dir = tmp_path / "critic", tmp_path / "actor"
    critic = [f"pretrained_checkpoint.restore_from_path={quick_rm}", f"exp_manager.explicit_log_dir={critic_dir}"]
    actor = actor_overrides(task_data, quick_sft, actor_dir, 2, ["trainer.ppo.save_interval=2",
                                                               "trainer.ppo.val_check_interval=2"])
    proc = run_ppo_local(critic, actor, critic_log=tmp_path / "critic1.log")
    assert "PPO finished: 2 steps" in proc.stdout
    metrics = [r for r in read_metrics(actor_dir) if "train/rewards" in r]
    assert [r["step"] for r in metrics] == [1, 2]
    for key in ("train/rewards", "train/init_policy_kl", "train/response_length", "train/critic_loss",
                "train/actor_loss", "train/clip_fraction", "train/entropy", "train/time/generate",
                "train/time/logprobs", "train/time/init_logprobs", "train/time/critic_infer_wait", "train/time/train"):
        assert key in metrics[0], key
    assert any("train/samples" in r for r in read_metrics(actor_dir))  # the prompt/response/reward table
    # The server logs its busy seconds with each critic_train: the call itself, and critic_infer since the last one.
    critic_times = [r for r in read_metrics(critic_dir) if "critic/time/train" in r]
    assert len(critic_times) == 2, critic_times
    assert all(r["critic/time/train"] > 0 and r["critic/time/infer"] > 0 for r in critic_times), critic_times
    actor_ckpts = [c for c in os.listdir(actor_dir / "checkpoints") if c.startswith("megatron_gpt-step=2")]
    critic_ckpts = [c for c in os.listdir(critic_dir / "checkpoints") if "step=" in c and not c.endswith(".tmp")]
    assert actor_ckpts and critic_ckpts
    assert (actor_dir / "checkpoints" / "megatron_gpt_ppo_actor.nemo").is_file()

    # The final actor .nemo loads as an ordinary GPT.
    run_script("train_gpt_sft.py", [f"model.restore_from_path={actor_dir / 'checkpoints' / 'megatron_gpt_ppo_actor.nemo'}",
                                    f"model.data.train_ds.file_path={task_data['sft_train']}",
                                    f"model.data.validation_ds.file_path={task_data['sft_val']}",
                                    f"exp_manager.explicit_log_dir={tmp_path / 'reload'}", "trainer.sft.max_steps=1",
                                    "exp_manager.create_checkpoint_callback=False"])

    # The same checkpoints as NeMo-Aligner leaves them (no trainer_state.json or RNG files; the state in
    # the names), in log directories of their own, for the last run below.
    nemo_dirs = {}
    for role, log_dir, name in (("actor", actor_dir, actor_ckpts[0]), ("critic", critic_dir, critic_ckpts[0])):
        target = tmp_path / f"{role}_nemo" / "checkpoints" / f"{name}-last"
        shutil.copytree(log_dir / "checkpoints" / name, target,
                        ignore=shutil.ignore_patterns("trainer_state.json", "rng_state_*"))
        nemo_dirs[role] = target.parent.parent

    # Resume both: the actor continues at step 3, the critic from its checkpoint.
    actor = actor_overrides(task_data, quick_sft, actor_dir, 4, ["trainer.ppo.save_interval=2",
                                                               "trainer.ppo.val_check_interval=2"])
    first_run_log = (tmp_path / "critic1.log").read_text()
    proc = run_ppo_local(critic, actor, critic_log=tmp_path / "critic1.log")  # the same log: appended to
    assert "actor resumed at PPO step 2" in proc.stdout + proc.stderr
    log = (tmp_path / "critic1.log").read_text()
    assert log.startswith(first_run_log) and "===== ppo_local: a new run" in log
    assert "critic resumed" in log[len(first_run_log):]
    steps = [r["step"] for r in read_metrics(actor_dir) if "train/rewards" in r]
    assert steps == [1, 2, 3, 4]

    # Both jobs resume from the checkpoints NeMo-Aligner wrote: counters from the names, optimizer afresh.
    critic = [f"pretrained_checkpoint.restore_from_path={quick_rm}", f"exp_manager.explicit_log_dir={nemo_dirs['critic']}"]
    actor = actor_overrides(task_data, quick_sft, nemo_dirs["actor"], 3, ["trainer.ppo.save_interval=0",
                                                                          "trainer.ppo.val_check_interval=0"])
    proc = run_ppo_local(critic, actor, critic_log=tmp_path / "critic_nemo.log")
    out = proc.stdout + proc.stderr
    assert "actor resumed at PPO step 2" in out and "a checkpoint NeMo wrote" in out, out[-3000:]
    log = (tmp_path / "critic_nemo.log").read_text()
    assert "critic resumed" in log and "a checkpoint NeMo wrote" in log, log[-3000:]
    assert [r["step"] for r in read_metrics(nemo_dirs["actor"]) if "train/rewards" in r] == [3]


@pytest.mark.learning
@pytest.mark.parametrize("seed", [1234, 7, 11])
def test_reward_rises_on_the_builtin_task(tmp_path, task_data, reward_model, weak_sft_nemo, seed):
    """From a weak SFT policy, 30 PPO steps of 128 rollouts raise the reward model's mean reward on
    greedy responses to 64 held-out prompts by at least 0.3, for each of three seeds. The tiny reward
    model is exploitable, so the task's own score does not rise with it (see docs/ppo.md); this test
    checks that PPO optimises the reward it is given (the 300-step reward model of ``reward_model``)."""
    critic = [f"pretrained_checkpoint.restore_from_path={reward_model[0]}", f"exp_manager.explicit_log_dir={tmp_path / 'c'}",
              *tiny_optim(3e-4, 1e-5, 5), "model.global_batch_size=64"]
    actor = actor_overrides(task_data, weak_sft_nemo, tmp_path / "a", 30, [
        "trainer.ppo.val_check_interval=15", "trainer.ppo.save_interval=0", "model.optim.lr=5e-5",
        "trainer.ppo.critic_warmup_steps=3", "model.ppo.num_rollout_samples=128", "model.global_batch_size=64",
        "model.micro_batch_size=16", "model.ppo.rollout_micro_batch_size=32", "model.ppo.num_val_samples=64",
        f"model.seed={seed}"])
    run_ppo_local(critic, actor, critic_log=tmp_path / "critic.log")
    val = {r["step"]: r["val/global_rewards"] for r in read_metrics(tmp_path / "a") if "val/global_rewards" in r}
    assert sorted(val) == [0, 15, 30]
    assert val[30] >= val[0] + 0.3, val


def test_dead_critic_stops_the_actor(tmp_path, task_data, quick_rm, quick_sft):
    """SIGKILL the critic after the actor's first checkpoint: with the shipped settings
    (remote_critic_rm.timeout_s=600) the actor sees that the server is gone and exits non-zero within
    seconds, naming host:port and the config key, and its checkpoint stays usable."""
    port = free_port()
    log = open(tmp_path / "critic.log", "w+")
    critic = subprocess.Popen(
        [sys.executable, os.path.join(SCRIPTS, "serve_ppo_critic.py"), *tiny_batch("serve_ppo_critic.py"),
         f"pretrained_checkpoint.restore_from_path={quick_rm}",
         f"exp_manager.explicit_log_dir={tmp_path / 'critic'}", f"trainer.ppo.port={port}",
         f"trainer.ppo.grpc_port={free_port()}", f"trainer.ppo.metrics_port={free_port()}"],
        env=subprocess_env(), stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    actor = None
    try:
        deadline = time.time() + 300
        while "critic server ready" not in (tmp_path / "critic.log").read_text():
            assert critic.poll() is None and time.time() < deadline, (tmp_path / "critic.log").read_text()[-3000:]
            time.sleep(0.5)
        actor_dir = tmp_path / "actor"
        actor = subprocess.Popen(
            [sys.executable, os.path.join(SCRIPTS, "train_gpt_ppo_actor.py"),
             *actor_overrides(task_data, quick_sft, actor_dir, 1000, ["trainer.ppo.save_interval=1",
                                                                   "trainer.ppo.val_check_interval=0",
                                                                   "trainer.ppo.val_at_start=False"]),
             "remote_critic_rm.critic.ip=127.0.0.1", f"remote_critic_rm.critic.port={port}"],
            env=subprocess_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
        ckpt_dir = actor_dir / "checkpoints"
        while not (ckpt_dir.is_dir() and any("step=1-" in c and not c.endswith(".tmp") for c in os.listdir(ckpt_dir))):
            assert actor.poll() is None and time.time() < deadline, actor.communicate()[1][-3000:]
            time.sleep(0.2)
        os.killpg(critic.pid, signal.SIGKILL)
        killed = time.time()
        out, err = actor.communicate(timeout=120)
        assert time.time() - killed < 30
        assert actor.returncode != 0
        assert f"127.0.0.1:{port}" in err and "remote_critic_rm.critic" in err, err[-3000:]
        assert "Traceback" not in err
        step1 = [c for c in os.listdir(ckpt_dir) if "step=1-" in c and not c.endswith(".tmp")][0]
        assert (ckpt_dir / step1 / "metadata.json").is_file() and (ckpt_dir / step1 / "trainer_state.json").is_file()
    finally:
        for proc in (actor, critic):
            if proc is not None and proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        log.close()

