"""The Slurm scripts as sbatch runs them: a copy in a spool directory, with fake srun/scontrol on
the PATH recording what would run."""

import os
import shutil
import stat
import subprocess

import pytest

from conftest import REPO

SLURM = os.path.join(REPO, "examples", "nlp", "gpt", "slurm")

# The critic logs its call only once its SIGTERM handler is set, and the actor ends only after that
# line is there (a real actor runs far longer than a critic takes to start), so the test is not
# a race between the two background jobs.
FAKE_SRUN = """#!/bin/bash
case "$*" in
  *--het-group=0*) trap 'echo critic-stopped >> "$FAKE_LOG"; exit 0' TERM
                   echo "$@" >> "$FAKE_LOG"
                   for _ in $(seq 200); do sleep 0.1; done; exit 9 ;;  # never outlives a test by much
  *--het-group=1*) echo "$@" >> "$FAKE_LOG"
                   for _ in $(seq 200); do grep -q -- "--het-group=0" "$FAKE_LOG" && break; sleep 0.05; done
                   exit "${ACTOR_EXIT:-0}" ;;
  *) echo "$@" >> "$FAKE_LOG" ;;
esac
"""


def run_as_sbatch(tmp_path, name, env):
    spool = tmp_path / "spool" / "job42"
    spool.mkdir(parents=True)
    script = spool / "slurm_script"
    shutil.copy(os.path.join(SLURM, name), script)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    for tool, body in (("srun", FAKE_SRUN), ("scontrol", "#!/bin/bash\necho node-a\n")):
        (bin_dir / tool).write_text(body)
        (bin_dir / tool).chmod(stat.S_IRWXU)
    log = tmp_path / "srun.log"
    full = dict(os.environ, PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}", FAKE_LOG=str(log),
                SLURM_SUBMIT_DIR=REPO, SLURM_JOB_ID="42", SLURM_JOB_NUM_NODES="1", SLURM_NTASKS_PER_NODE="8",
                SLURM_JOB_NODELIST_HET_GROUP_0="node-a", SLURM_JOB_NUM_NODES_HET_GROUP_0="1",
                SLURM_JOB_NUM_NODES_HET_GROUP_1="1", RESULTS=str(tmp_path / "results"),
                LOG_DIR=str(tmp_path / "results"), **env)
    proc = subprocess.run(["bash", str(script)], cwd=spool, env=full, capture_output=True, text=True, timeout=60)
    return proc, (log.read_text() if log.exists() else "")


def test_scripts_find_the_repository_from_slurms_spool_copy(tmp_path):
    proc, calls = run_as_sbatch(tmp_path, "train_reward_model.sub",
                                {"SFT_NEMO": "sft.nemo", "TRAIN": "t.jsonl", "VAL": "v.jsonl"})
    assert proc.returncode == 0, proc.stderr
    assert f"python {REPO}/examples/nlp/gpt/train_reward_model.py" in calls
    wrong, _ = run_as_sbatch(tmp_path / "again", "train_reward_model.sub",
                             {"SFT_NEMO": "sft.nemo", "TRAIN": "t.jsonl", "VAL": "v.jsonl", "REPO": str(tmp_path)})
    assert wrong.returncode == 1 and "is not the nemo-aligner repository" in wrong.stderr


@pytest.mark.parametrize("actor_exit", [0, 3])
def test_ppo_hetjob_stops_the_critic_and_returns_the_actors_status(tmp_path, actor_exit):
    proc, calls = run_as_sbatch(tmp_path, "ppo_hetjob.sbatch",
                                {"RM_NEMO": "rm.nemo", "SFT_NEMO": "sft.nemo", "TRAIN_PROMPTS": "t.jsonl",
                                 "VAL_PROMPTS": "v.jsonl", "ACTOR_EXIT": str(actor_exit)})
    assert proc.returncode == actor_exit, proc.stderr
    assert f"{REPO}/examples/nlp/gpt/serve_ppo_critic.py" in calls
    assert "remote_critic_rm.critic.ip=node-a" in calls
    assert calls.strip().endswith("critic-stopped")  # SIGTERM reached the critic, which saves on it
