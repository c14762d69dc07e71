#!/bin/bash
# make test-slurm: examples/nlp/gpt/slurm/ppo_hetjob.sbatch on a real two-node Slurm cluster started
# on this machine (tests/slurm/cluster.sh), with the tiny built-in models on the CPU:
#   1. a graceful stop mid-run (scancel --batch --signal=USR1): the actor finishes its step and saves
#      with the critic, then the critic stops; both checkpoints are of the same PPO step;
#   2. a resubmission with the same RESULTS resumes both at that step and runs to the end;
#   3. a plain scancel mid-run (every process signalled at once): the checkpoints stay in step;
#   4. SIGKILL of every process mid-run: still in step, and the next run (which resumes) removes
#      what the killed critic left;
#   and after every stop no PyTriton shared memory, workspace or Triton model folder is left behind.
# Needs root (munge, slurmd) and installs Debian's slurm-wlm and munge packages when missing.
set -euo pipefail
REPO=$(cd "$(dirname "$0")/../.." && pwd)
PY=${PY:-$REPO/.venv/bin/python}
WORK=$(mktemp -d /tmp/aligner_slurm.XXXXXX)
CLUSTER=$WORK/cluster
log() { echo "[test-slurm] $*"; }
fail() { echo "[test-slurm] FAILED: $*" >&2; exit 1; }

if ! command -v slurmctld >/dev/null || ! command -v munged >/dev/null; then
    [ "$(id -u)" = 0 ] || fail "Slurm is not installed and this is not root: apt-get install slurm-wlm munge"
    log "installing slurm-wlm and munge"
    (apt-get install -y -q slurm-wlm munge || (apt-get update -q && apt-get install -y -q slurm-wlm munge)) >/dev/null
fi

cleanup() {
    set +e
    [ -n "${SLURM_CONF:-}" ] && scancel --full --signal=KILL --user="$(id -un)" >/dev/null 2>&1
    "$REPO/tests/slurm/cluster.sh" stop "$CLUSTER"
    [ -n "${KEEP:-}" ] || rm -rf "$WORK"
}
trap cleanup EXIT
eval "$("$REPO/tests/slurm/cluster.sh" start "$CLUSTER" | grep '^export ')"
export SLURM_CONF

# Tiny models and data (the built-in task): an SFT policy and a reward model.
log "building the tiny SFT and reward models"
DATA=$WORK/data
"$PY" -m nemo_aligner.data.nlp.builtin_task --out-dir "$DATA" --train 400 --val 32 >/dev/null
"$PY" "$REPO/examples/nlp/gpt/train_gpt_sft.py" model.data.train_ds.file_path="$DATA/sft_train.jsonl" \
    model.data.validation_ds.file_path="$DATA/sft_val.jsonl" exp_manager.explicit_log_dir="$WORK/sft" \
    model.data.train_ds.global_batch_size=32 model.data.train_ds.micro_batch_size=8 \
    trainer.sft.max_steps=20 trainer.sft.val_check_interval=20 >"$WORK/sft.log" 2>&1 || fail "SFT: $WORK/sft.log"
SFT_NEMO=$WORK/sft/checkpoints/megatron_gpt_sft.nemo
"$PY" "$REPO/examples/nlp/gpt/train_reward_model.py" ++model.data.data_impl=jsonl \
    "++model.data.data_prefix={train: [$DATA/rm_train.jsonl], validation: [$DATA/rm_val.jsonl], test: [$DATA/rm_val.jsonl]}" \
    pretrained_checkpoint.restore_from_path="$SFT_NEMO" exp_manager.explicit_log_dir="$WORK/rm" \
    model.global_batch_size=32 trainer.rm.max_steps=10 trainer.rm.val_check_interval=10 >"$WORK/rm.log" 2>&1 || fail "RM: $WORK/rm.log"
RM_NEMO=$WORK/rm/checkpoints/megatron_gpt.nemo

leftovers() {  # PyTriton's shared memory and workspaces, and Triton's stub directories
    ls -d /dev/shm/psm_* /tmp/pytriton_* /tmp/python_backend_stub_* /tmp/folder* 2>/dev/null | sort || true
}
BEFORE=$(leftovers)

RESULTS=$WORK/results
submit() {  # MAX_STEPS -> job id
    # The compute "nodes" run the scripts with this environment's Python.
    PATH="$(dirname "$PY"):$PATH" RM_NEMO=$RM_NEMO SFT_NEMO=$SFT_NEMO TRAIN_PROMPTS=$DATA/prompts_train.jsonl \
    VAL_PROMPTS=$DATA/prompts_val.jsonl RESULTS=$RESULTS GPUS_PER_NODE=0 TASKS_PER_NODE=1 CRITIC_TP=1 ACTOR_TP=1 \
    PRECISION=32 TIME_LIMIT=00:30:00 \
    CRITIC_ARGS="model.global_batch_size=16 model.micro_batch_size=8 trainer.ppo.port=$CRITIC_HTTP" \
    ACTOR_ARGS="trainer.ppo.max_steps=$1 trainer.ppo.max_epochs=100 trainer.ppo.save_interval=${2:-1000} \
        trainer.ppo.val_check_interval=1000 model.ppo.num_rollout_samples=16 model.global_batch_size=16 \
        model.micro_batch_size=8 model.ppo.rollout_micro_batch_size=16 model.ppo.length_params.max_length=8 \
        model.ppo.num_val_samples=16 remote_critic_rm.critic.port=$CRITIC_HTTP" \
    bash "$REPO/examples/nlp/gpt/slurm/ppo_hetjob.sbatch" --output="$WORK/job_%j.out" | awk '{print $NF}'
}
CRITIC_HTTP=$("$PY" -c 'from nemo_aligner.utils.ports import free_port; print(free_port())' 2>/dev/null || echo 15556)

wait_for() {  # SECONDS DESCRIPTION COMMAND...
    local limit=$1 what=$2; shift 2
    for _ in $(seq "$limit"); do "$@" && return 0; sleep 1; done
    fail "timed out waiting for $what"
}
job_done() { ! squeue -h -j "$1" 2>/dev/null | grep -q .; }
actor_at_least() {  # STEP: the actor has logged a training step >= STEP
    "$PY" - "$RESULTS/actor/metrics.jsonl" "$1" <<'EOF'
import json, os, sys
path, want = sys.argv[1], int(sys.argv[2])
steps = [json.loads(l).get("step") or 0 for l in open(path) if "train/rewards" in l] if os.path.exists(path) else []
sys.exit(0 if max(steps or [0]) >= want else 1)
EOF
}
ckpt_step() {  # DIR KEY: the highest KEY in the trainer_state.json of DIR's finished checkpoints
    "$PY" - "$1" "$2" <<'EOF'
import glob, json, os, sys
vals = [json.load(open(p))[sys.argv[2]] for p in glob.glob(os.path.join(sys.argv[1], "checkpoints", "*", "trainer_state.json"))
        if not os.path.dirname(p).endswith(".tmp")]
print(max(vals) if vals else 0)
EOF
}
in_step() {  # the actor's last checkpointed step equals the critic's number of critic_train calls
    local actor critic
    actor=$(ckpt_step "$RESULTS/actor" step); critic=$(ckpt_step "$RESULTS/critic" train_calls)
    log "checkpoints: actor at PPO step $actor, critic after $critic critic_train calls"
    [ "$actor" = "$critic" ] || fail "actor ($actor) and critic ($critic) checkpoints are out of step"
    [ "$actor" -gt 0 ] || fail "no checkpoint written"
}
no_leftovers() {  # nothing new since the start (servers may also have removed older stale ones)
    local new; new=$(comm -13 <(echo "$BEFORE") <(leftovers) | grep . || true)
    [ -z "$new" ] || fail "left behind: $(echo "$new" | tr '\n' ' ')"
}

# 1. Graceful stop mid-run.
JOB=$(submit 200)
log "job $JOB: PPO for up to 200 steps; stopping it gracefully after step 3"
wait_for 600 "the actor's third step" actor_at_least 3
scancel --batch --signal=USR1 "$JOB"
wait_for 300 "job $JOB to end" job_done "$JOB"
grep -q "termination signal received" "$RESULTS"/actor/slurm_*_0.log || fail "the actor did not stop on the signal"
in_step
STOPPED=$(ckpt_step "$RESULTS/actor" step)
[ "$STOPPED" -ge 3 ] || fail "the actor saved step $STOPPED, before the signal"
no_leftovers

# 2. Resubmission: both resume at that step and finish.
JOB=$(submit $((STOPPED + 2)))
log "job $JOB: resuming at step $STOPPED, running to $((STOPPED + 2))"
wait_for 600 "job $JOB to end" job_done "$JOB"
grep -q "actor resumed at PPO step $STOPPED" "$RESULTS"/actor/slurm_*_0.log || fail "the actor did not resume"
grep -q "critic resumed" "$RESULTS"/critic/slurm_*_0.log || fail "the critic did not resume"
[ "$(ckpt_step "$RESULTS/actor" step)" = $((STOPPED + 2)) ] || fail "the resumed run did not finish"
in_step
no_leftovers

# 3. A plain scancel mid-run (both components signalled at once), saving every 2 steps.
JOB=$(submit 200 2)
log "job $JOB: plain scancel after step $((STOPPED + 5))"
wait_for 600 "step $((STOPPED + 5))" actor_at_least $((STOPPED + 5))
scancel "$JOB"
wait_for 300 "job $JOB to end" job_done "$JOB"
in_step
no_leftovers

# 4. SIGKILL of every process: nothing can clean up; the next run's server does, and resumes in step.
NOW=$(ckpt_step "$RESULTS/actor" step)
JOB=$(submit 200 2)
log "job $JOB: SIGKILL after step $((NOW + 3))"
wait_for 600 "step $((NOW + 3))" actor_at_least $((NOW + 3))
scancel --full --signal=KILL "$JOB"
wait_for 300 "job $JOB to end" job_done "$JOB"
in_step
NOW=$(ckpt_step "$RESULTS/actor" step)
JOB=$(submit $((NOW + 1)))
wait_for 600 "job $JOB to end" job_done "$JOB"
[ "$(ckpt_step "$RESULTS/actor" step)" = $((NOW + 1)) ] || fail "the run after SIGKILL did not resume and finish"
in_step
no_leftovers
log "passed"
