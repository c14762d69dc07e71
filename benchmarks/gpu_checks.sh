#!/usr/bin/env bash
# The checks that need a GPU, in one run: the GPU-only tests, the learning tests of SFT, PPO (actor +
# critic server, PyTriton on the GPU) and SteerLM 2.0 on the GPU, and the GPU benchmarks (CUDA-graph
# decode against HF's fastest path, SFT of the ~1B shape, the PPO step by phase).
#
#   benchmarks/gpu_checks.sh [STAGE ...]     stages: env tests learning generation sft ppo (default: all)
#
# CHECKS_BUDGET_S [540]: the whole run's seconds; a stage that would not fit in what is left is skipped
# (its line says so). Exit status: 0 all passed, 1 a stage failed or timed out, 2 a bad stage name,
# 3 a stage skipped. CHECKS_OUT [$OUT, else results/gpu-checks]: where checks.log, the
# one-line-per-stage summary.txt and the benchmarks' JSON go. Where ./.whl exists (made by
# benchmarks/gpu_wheels.sh), its wheels are installed into /tmp/site first, with no package index.
set -u
cd "$(dirname "$0")/.."
REPO=$PWD
OUT_DIR=${CHECKS_OUT:-${OUT:-$REPO/results/gpu-checks}}
BUDGET=${CHECKS_BUDGET_S:-540}
PY=${PYTHON:-python3}
mkdir -p "$OUT_DIR"
LOG=$OUT_DIR/checks.log
SUMMARY=$OUT_DIR/summary.txt
: >"$LOG"
: >"$SUMMARY"
START=$(date +%s)
export PYTHONUNBUFFERED=1 WANDB_MODE=offline

if [ -d .whl ]; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    >>"$LOG" 2>&1 || { echo "gpu_checks.sh: installing .whl failed (see $LOG)" >&2; exit 1; }
  export PYTHONPATH=/tmp/site:$REPO${PYTHONPATH:+:$PYTHONPATH}
else
  export PYTHONPATH=$REPO${PYTHONPATH:+:$PYTHONPATH}
fi

# stage NAME NEEDED_S TIMEOUT_S COMMAND...: run it under a timeout if NEEDED_S fit in the budget left.
stage() {
  local name=$1 need=$2 limit=$3
  shift 3
  local left=$((BUDGET - ($(date +%s) - START)))
  if [ "$left" -lt "$need" ]; then
    echo "$name: skipped ($left s left of the budget, needs $need s)" | tee -a "$SUMMARY"
    return
  fi
  [ "$limit" -gt "$left" ] && limit=$left
  echo "=== $name: $* (limit ${limit} s)" >>"$LOG"
  local t0=$(date +%s) part=$OUT_DIR/.stage.log
  timeout --kill-after=10 "$limit" "$@" >"$part" 2>&1
  local rc=$?
  cat "$part" >>"$LOG"
  local verdict="ok"
  [ $rc -ne 0 ] && verdict="FAILED (exit $rc)"
  [ $rc -eq 124 ] && verdict="TIMED OUT"
  echo "$name: $verdict in $(($(date +%s) - t0)) s" | tee -a "$SUMMARY"
  # pytest's closing line, or a benchmark's last lines
  grep -E "^(=+ )?[0-9]+ (passed|failed)|^FAILED|^ERROR" "$part" | tail -12 | sed "s/^/  /" >>"$SUMMARY"
  [ "$name" != tests ] && [ "$name" != learning ] && tail -4 "$part" | sed "s/^/  /" >>"$SUMMARY"
  rm -f "$part"
}

bench_json() {  # the JSON files this run's benchmarks wrote, next to the log
  "$PY" - "$OUT_DIR" "$START" <<'EOF'
import glob, os, shutil, sys
sys.path.insert(0, "benchmarks")
from common import device_slug
for path in glob.glob(os.path.join("benchmarks", "results", device_slug(), "*.json")):
    if os.path.getmtime(path) >= float(sys.argv[2]):
        shutil.copy(path, sys.argv[1])
EOF
}

ALL_STAGES="env tests learning generation sft ppo"
STAGES=${*:-$ALL_STAGES}
for s in $STAGES; do
  case " $ALL_STAGES " in
    *" $s "*) ;;
    *) echo "gpu_checks.sh: unknown stage $s ($ALL_STAGES)" >&2; exit 2 ;;
  esac
done
PYTEST="$PY -m pytest -q -p no:cacheprovider"
for s in $STAGES; do
  case $s in
    env) stage env 5 60 bash -ec "nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; \
      $PY -c 'import sys, torch, numpy, megatron.core, transformers; print(sys.version.split()[0], torch.__version__, \
      torch.version.cuda, \"numpy\", numpy.__version__, \"mcore\", megatron.core.__version__, \"transformers\", \
      transformers.__version__); print(torch.cuda.get_device_name())'; $PY -c 'import pytriton; print(\"pytriton ok\")'" ;;
    tests) stage tests 60 150 $PYTEST -n 4 tests/test_generation.py tests/test_weight_swap.py tests/test_te_spec.py \
      tests/test_precision.py tests/test_checkpoints.py tests/test_critic_server.py ;;
    learning) stage learning 120 330 $PYTEST -n 9 -m learning -rA tests/test_sft.py tests/test_ppo.py tests/test_steerlm2.py ;;
    generation) stage generation 60 180 $PY benchmarks/bench_generation.py --shapes small medium --rounds 3 \
      --cuda-graphs --hf-static-compile ;;
    sft) stage sft 60 150 $PY benchmarks/bench_sft.py --shapes large --batch 16 --seq 1024 --rounds 3 ;;
    ppo) stage ppo 60 150 $PY benchmarks/bench_ppo.py --rollouts 64 --new-tokens 64 --steps 4 ;;
  esac
done
bench_json >>"$LOG" 2>&1
echo "total $(($(date +%s) - START)) s; log: $LOG" | tee -a "$SUMMARY"
grep -q -E "^[a-z]+: (FAILED|TIMED OUT)" "$SUMMARY" && exit 1
grep -q -E "^[a-z]+: skipped" "$SUMMARY" && exit 3
exit 0
