"""The Slurm scripts as sbatch runs them: a copy in a spool directory, with fake srun/scontrol on
the PATH recording what would run."""

import os
import shutil
import stat
import subprocess

import pytest

from conftest import REPO

SLURM = os.path.join(REPO, "examples", "nlp", "gpt", "slurm")

# Each fake step records its PID (the fake scancel signals it), and its call once its TERM handler is
# set. The actor ends only after the critic's line is there (a real actor runs far longer than a
# critic takes to start), or, with ACTOR_WAITS, when signalled: the test is not a race.
FAKE_SRUN = """#!/bin/bash
case "$*" in
  *--het-group=0*) echo $$ > "$FAKE_DIR/group0.pid"
                   trap 'echo critic-stopped >> "$FAKE_LOG"; exit 0' TERM
                   echo "MASTER=$MASTER_ADDR:$MASTER_PORT $*" >> "$FAKE_LOG"
                   for _ in $(seq 200); do sleep 0.1; done; exit 9 ;;  # never outlives a test by much
  *--het-group=1*) echo $$ > "$FAKE_DIR/group1.pid"
                   trap 'echo actor-stopped >> "$FAKE_LOG"; exit 0' TERM
                   echo "MASTER=$MASTER_ADDR:$MASTER_PORT $*" >> "$FAKE_LOG"
                   for _ in $(seq 200); do grep -q -- "--het-group=0" "$FAKE_LOG" && break; sleep 0.05; done
                   if [ -n "${ACTOR_WAITS:-}" ]; then echo actor-waiting >> "$FAKE_LOG"; for _ in $(seq 200); do sleep 0.1; done; fi
                   exit "${ACTOR_EXIT:-0}" ;;
  *) echo "$@" >> "$FAKE_LOG" ;;
esac
"""
# scancel --signal=SIG <component job id>: the signal to that component's fake step (ids 42, 43).
FAKE_SCANCEL = """#!/bin/bash
echo "scancel $*" >> "$FAKE_LOG"
sig=TERM
for a in "$@"; do case "$a" in --signal=*) sig=${a#--signal=} ;; esac; done
target=${*: -1}
kill -"$sig" "$(cat "$FAKE_DIR/group$((target - 42)).pid")" 2>/dev/null || true
"""
FAKE_SCONTROL = """#!/bin/bash
case "$2" in
  hostnames) echo "$3" | sed 's/,/\\n/g' ;;
  node) echo "NodeName=$4 Arch=x86_64 NodeAddr=addr-$4 NodeHostName=$4" ;;
esac
"""
# sbatch: its arguments, then the script it read from stdin.
FAKE_SBATCH = """#!/bin/bash
echo "sbatch $*" >> "$FAKE_LOG"
cat > "$FAKE_DIR/submitted_script"
echo "Submitted batch job 77"
"""


def run_as_sbatch(tmp_path, name, env, inside_job=True, background=False):
    spool = tmp_path / "spool" / "job42"
    spool.mkdir(parents=True)
    script = spool / "slurm_script"
    shutil.copy(os.path.join(SLURM, name), script)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    for tool, body in (("srun", FAKE_SRUN), ("scontrol", FAKE_SCONTROL), ("scancel", FAKE_SCANCEL),
                       ("sbatch", FAKE_SBATCH)):
        (bin_dir / tool).write_text(body)
        (bin_dir / tool).chmod(stat.S_IRWXU)
    log = tmp_path / "srun.log"
    full = dict(os.environ, PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}", FAKE_LOG=str(log),
                FAKE_DIR=str(tmp_path), RESULTS=str(tmp_path / "results"), LOG_DIR=str(tmp_path / "results"), **env)
    for key in [k for k in full if k.startswith("SLURM_")]:
        del full[key]
    if inside_job:
        full.update(SLURM_SUBMIT_DIR=REPO, SLURM_JOB_ID="42", SLURM_JOB_NAME="ppo", SLURM_JOB_NUM_NODES="1",
                     SLURM_NTASKS_PER_NODE="8", SLURM_JOB_NODELIST_HET_GROUP_0="node-a",
                     SLURM_JOB_NODELIST_HET_GROUP_1="node-b", SLURM_JOB_NUM_NODES_HET_GROUP_0="1",
                     SLURM_JOB_NUM_NODES_HET_GROUP_1="1", SLURM_NTASKS_PER_NODE_HET_GROUP_0="2",
                     SLURM_NTASKS_PER_NODE_HET_GROUP_1="4", SLURM_JOB_ID_HET_GROUP_0="42",
                     SLURM_JOB_ID_HET_GROUP_1="43")
        cmd, cwd = ["bash", str(script)], spool
    else:  # `bash examples/nlp/gpt/slurm/<name>` from the repository
        cmd, cwd = ["bash", os.path.join(SLURM, name)], REPO
    if background:
        return subprocess.Popen(cmd, cwd=cwd, env=full, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True), log
    proc = subprocess.run(cmd, cwd=cwd, env=full, capture_output=True, text=True, timeout=60)
    return proc, (log.read_text() if log.exists() else "")


PPO_ENV = {"RM_NEMO": "rm.nemo", "SFT_NEMO": "sft.nemo", "TRAIN_PROMPTS": "t.jsonl", "VAL_PROMPTS": "v.jsonl"}


def test_scripts_find_the_repository_from_slurms_spool_copy(tmp_path):
    proc, calls = run_as_sbatch(tmp_path, "train_reward_model.sub",
                                {"SFT_NEMO": "sft.nemo", "TRAIN": "t.jsonl", "VAL": "v.jsonl"})
    assert proc.returncode == 0, proc.stderr
    assert f"python {REPO}/examples/nlp/gpt/train_reward_model.py" in calls
    wrong, _ = run_as_sbatch(tmp_path / "again", "train_reward_model.sub",
                             {"SFT_NEMO": "sft.nemo", "TRAIN": "t.jsonl", "VAL": "v.jsonl", "REPO": str(tmp_path)})
    assert wrong.returncode == 1 and "is not the nemo-aligner repository" in wrong.stderr


@pytest.mark.parametrize("actor_exit", [0, 3])
def test_ppo_hetjob_stops_the_critic_after_the_actor_and_returns_the_actors_status(tmp_path, actor_exit):
    proc, calls = run_as_sbatch(tmp_path, "ppo_hetjob.sbatch",
                                dict(PPO_ENV, ACTOR_EXIT=str(actor_exit),
                                     CRITIC_ARGS="model.optim.lr=1e-6 'trainer.ppo.extra=a b'",
                                     ACTOR_ARGS="trainer.ppo.max_steps=7"))
    assert proc.returncode == actor_exit, proc.stderr
    lines = calls.strip().splitlines()
    critic = next(line for line in lines if "--het-group=0" in line)
    actor = next(line for line in lines if "--het-group=1" in line)
    assert f"{REPO}/examples/nlp/gpt/serve_ppo_critic.py" in critic
    assert "remote_critic_rm.critic.ip=addr-node-a" in actor  # Slurm's NodeAddr of the critic's node
    # Each component: its own rendezvous (host and port), its own device count, kill-on-bad-exit.
    assert critic.startswith("MASTER=addr-node-a:20042 ") and actor.startswith("MASTER=addr-node-b:30042 ")
    assert "--kill-on-bad-exit=1" in critic and "--kill-on-bad-exit=1" in actor
    assert "trainer.devices=2" in critic and "trainer.devices=4" in actor
    # Extra overrides, shell-quoted, reach their own job only.
    assert critic.endswith("model.optim.lr=1e-6 trainer.ppo.extra=a b") and "trainer.ppo.max_steps=7" in actor
    assert f"exp_manager.explicit_log_dir={tmp_path / 'results'}/critic" in critic
    # The critic is signalled through Slurm, on its own component, after the actor has ended.
    assert lines[-2:] == ["scancel --signal=TERM 42", "critic-stopped"], lines


def test_ppo_hetjob_stop_signal_stops_the_actor_first(tmp_path):
    """Slurm's --signal=B:USR1 (before the time limit) or `scancel --batch --signal=USR1`: the actor's
    component is signalled first, the critic's only once the actor has exited."""
    import signal
    import time

    proc, log = run_as_sbatch(tmp_path, "ppo_hetjob.sbatch", dict(PPO_ENV, ACTOR_WAITS="1"), background=True)
    try:
        for _ in range(200):
            if log.exists() and "actor-waiting" in log.read_text():
                break
            time.sleep(0.05)
        proc.send_signal(signal.SIGUSR1)
        out, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 0, err
    lines = log.read_text().strip().splitlines()
    assert lines[-4:] == ["scancel --signal=TERM 43", "actor-stopped", "scancel --signal=TERM 42",
                          "critic-stopped"], lines
    assert "the actor finishes its step and saves" in out


@pytest.mark.parametrize("gpus", ["0", "8"])
def test_ppo_hetjob_submits_itself_with_resources_from_variables(tmp_path, gpus):
    proc, calls = run_as_sbatch(tmp_path, "ppo_hetjob.sbatch",
                                dict(PPO_ENV, GPUS_PER_NODE=gpus, TASKS_PER_NODE="2", ACTOR_NODES="3",
                                     TIME_LIMIT="01:00:00", STOP_BEFORE_S="120"),
                                inside_job=False)
    assert proc.returncode == 0, proc.stderr
    args = calls.strip().splitlines()[0].split()
    assert args[0] == "sbatch" and "--time=01:00:00" in args and "--signal=B:USR1@120" in args
    first, second = " ".join(args).split(" : ")
    assert "--nodes=1 --ntasks-per-node=2" in first and "--nodes=3 --ntasks-per-node=2" in second
    assert ("--gpus-per-node=8" in first and "--gpus-per-node=8" in second) == (gpus == "8")
    assert "--gpus-per-node" not in calls or gpus == "8"
    submitted = (tmp_path / "submitted_script").read_text()
    assert not any(line.startswith("#SBATCH") for line in submitted.splitlines())
    assert "srun --het-group=1" in submitted
