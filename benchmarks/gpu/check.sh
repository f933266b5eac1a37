#!/usr/bin/env bash
# The GPU suite: one budgeted command that proves every CUDA path of rlvr_fast on one GPU and times
# it at Qwen3-0.6B scale, whatever fails.
#
#   bash benchmarks/gpu/check.sh [--first] [--dry-run] [RESULTS_DIR]
#   bash benchmarks/gpu/check.sh [--first] --list    # the stages and their caps, then exit
#
# --first: what a first lease runs first, within FIRST_BUDGET_SECONDS (240 s) including the
# install, so that the machine's start, this and a rerun fit a 15-minute lease with the full
# suite's stages still to choose from: 0 environment, install, build and checkpoint; 1 every
# CUDA test; 2 one CUDA-graph capture and replay against eager decode (first_contact.py graphs);
# 3 end to end: 3-step bf16-mixed runs of baseline and stopped_tree; 4 one decode step's time
# (first_contact.py decode).
#
# Stages, in order of value, each under its own time limit, all within 400 s: 0 environment,
# install and a Qwen3-0.6B-shaped checkpoint; 1 every CUDA test (pytest -m cuda); 2 end to end:
# 12-step runs of baseline and stopped_tree in bf16, reported in seconds per step (a 50-step
# figure only as a labelled projection); 3 decode at Qwen3-0.6B shape: the engine vs
# transformers' generate; 4 the fused ops vs eager; 5 a 3-step Nsight Systems profile. A stage
# that fails or runs out of time never stops the next one. The budget is sized to a 15-minute
# device lease: the machine's start (a minute or more), a full run and a rerun (2 x 400 s).
# The caps are estimates made without a GPU (2-3 s per end-to-end step at Qwen3-0.6B shape);
# tests/gpu/test_check_budget.py holds the caps to the budget and the budget to the lease.
#
# RESULTS_DIR (default $OUT, else benchmarks/results/gpu-check-STAMP; a dry run's default is a
# temporary folder) receives at most 8 files, what the device machine hands back: results.md (a
# section per stage, then a summary table), one raw log per stage and benchmarks.json. The model,
# run directories and profiles go to a scratch folder. COMMIT=<sha> names the commit where the
# copy of the repository has no .git. The pure-Python wheels in benchmarks/gpu/wheels/ (the
# grader's math-verify and its parser, which the GPU machine's image lacks and cannot download)
# are installed first.
#
# --dry-run: every stage on the CPU at tiny sizes (a random checkpoint of the embedded model's
# shape, 2 steps, the CPU benchmark cases, the CUDA tests collected but not run), so the script
# cannot reach a GPU with a typo or a stale path. `make test` runs it, with every limit
# DRY_RUN_SLACK times longer: it checks commands and paths, not time, on a shared CPU.
set -uo pipefail  # no -e: a failing stage must not stop the next
cd "$(dirname "$0")/../.." || exit 2
SCRIPT=benchmarks/gpu/check.sh
BUDGET_SECONDS=400
RESERVE_SECONDS=15  # a stage's kill grace and the summary
MIN_STAGE_SECONDS=20
DRY_RUN_SLACK=4
E2E_STEPS=12
STAGES=(env tests e2e decode ops profile)
declare -A TITLE=([env]="environment, install, checkpoint" [tests]="CUDA tests (pytest -m cuda)"
                  [e2e]="end to end: baseline and stopped_tree"
                  [decode]="decode at Qwen3-0.6B shape: engine vs generate"
                  [ops]="fused ops vs eager" [profile]="Nsight Systems profile, 3 steps"
                  [graphs]="one CUDA-graph capture and replay vs eager decode"
                  [decode_step]="one decode step's time at 64 rows")
# Their sum plus RESERVE_SECONDS stays within BUDGET_SECONDS, so every stage gets its whole cap.
declare -A CAP_SECONDS=([env]=70 [tests]=60 [e2e]=120 [decode]=65 [ops]=40 [profile]=30)
# --first: its stages and caps (their sum plus RESERVE_SECONDS within FIRST_BUDGET_SECONDS).
FIRST_BUDGET_SECONDS=240
FIRST_STAGES=(env tests graphs e2e decode_step)
declare -A FIRST_CAP_SECONDS=([env]=70 [tests]=45 [graphs]=25 [e2e]=60 [decode_step]=25)
FIRST_E2E_STEPS=3
FIRST_E2E_ARM_SECONDS=(32 28)
# baseline, stopped_tree: start-up (imports, loading, KV cache, graph captures, ~25 s) and
# E2E_STEPS steps each; their sum stays within CAP_SECONDS[e2e].
E2E_ARM_SECONDS=(65 50)
# A stage's own exit statuses, apart from pytest's (0-5) and a timeout's (124, 137).
SKIPPED=90  # nothing to run here (the stage's headline says why)
PARTIAL=91  # ran, but part of it stopped at its time limit

configure() {
  if (( DRY_RUN )); then
    DEVICE=cpu DTYPE=fp32 STEPS=2 CHECKPOINT_CONFIG=tiny PIP_DRY_RUN=--dry-run SLACK=$DRY_RUN_SLACK
    DECODE_SELECT=decode_cpu OPS_SELECT="10M or paged or tree"
    TINY_ROLLOUTS=(--set max_new_tokens=128 --set t_min=32 --set t_max=64)
    # No figure of a dry run means anything; one thread per process keeps a shared CI machine
    # from stalling in OpenMP waits.
    export CUDA_VISIBLE_DEVICES= OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
  else
    DEVICE=cuda DTYPE=bf16 STEPS=$E2E_STEPS CHECKPOINT_CONFIG=qwen3-0.6b PIP_DRY_RUN= SLACK=1
    DECODE_SELECT=decode_cuda OPS_SELECT="not cpu"
    TINY_ROLLOUTS=()
  fi
  if (( FIRST )); then
    STEPS=$FIRST_E2E_STEPS E2E_ARM_SECONDS=("${FIRST_E2E_ARM_SECONDS[@]}")
    BUDGET_SECONDS=$FIRST_BUDGET_SECONDS STAGES=("${FIRST_STAGES[@]}")
    for name in "${!FIRST_CAP_SECONDS[@]}"; do CAP_SECONDS[$name]=${FIRST_CAP_SECONDS[$name]}; done
  elif ! command -v nsys > /dev/null; then
    # No Nsight Systems: the profile stage has nothing to run, so its time goes to end to end.
    CAP_SECONDS[e2e]=$(( CAP_SECONDS[e2e] + CAP_SECONDS[profile] ))
    E2E_ARM_SECONDS[0]=$(( E2E_ARM_SECONDS[0] + CAP_SECONDS[profile] / 2 ))
    E2E_ARM_SECONDS[1]=$(( E2E_ARM_SECONDS[1] + CAP_SECONDS[profile] - CAP_SECONDS[profile] / 2 ))
    CAP_SECONDS[profile]=0
    STAGES=("${STAGES[@]/profile}")
  fi
  MODEL=$WORK/model
  export PYTHONUNBUFFERED=1 MAX_JOBS=${MAX_JOBS:-$(nproc)}
}

run() {  # print a command, then run it
  echo "+ $*"
  "$@"
}

time_limit() {  # CAP: seconds a command may run (times the slack), within the script's deadline
  local cap=$(( $1 * SLACK )) left=$(( DEADLINE - $(date +%s) - RESERVE_SECONDS ))
  echo $(( cap < left ? cap : (left > 1 ? left : 1) ))
}

headline() {  # one line for the summary table
  echo "$*" >> "$WORK/$STAGE.headline"
}

train_command() {  # ARM OUT_DIR STEPS: sets TRAIN, one rlvr-fast run as the study's, no evaluation
  TRAIN=(python3 -m rlvr_fast.cli train --arm "$1" --model "$MODEL" --device "$DEVICE"
         --dtype "$DTYPE" --steps "$3" --out "$2" --quiet --set checkpoint_every="$3"
         "${TINY_ROLLOUTS[@]}")
  rm -rf "$2"
}

# ---------------------------------------------------------------------------- stages
stage_env() {
  local rc=0 missing checkpoint
  if command -v nvidia-smi > /dev/null; then run nvidia-smi || rc=1
  else echo "nvidia-smi: not on this machine"; fi
  run python3 -m pip install $PIP_DRY_RUN --no-index --no-deps benchmarks/gpu/wheels/*.whl || rc=1
  run python3 -m pip install $PIP_DRY_RUN --no-deps --no-build-isolation -e . || rc=1
  run python3 benchmarks/gpu/environment.py --device "$DEVICE" | tee "$WORK/env.out" || rc=1
  run python3 scripts/make_checkpoint.py --config "$CHECKPOINT_CONFIG" --out "$MODEL" \
    --device "$DEVICE" | tee "$WORK/checkpoint.out" || rc=1
  missing=$(grep -c '^MISSING' "$WORK/env.out")
  checkpoint=$(grep -q '^wrote' "$WORK/checkpoint.out" && echo "checkpoint made" ||
               echo "no checkpoint")
  headline "$(grep -m1 '^CUDA' "$WORK/env.out"); $missing missing dependencies; $checkpoint"
  { echo '```'; cat "$WORK/env.out" "$WORK/checkpoint.out"; echo '```'; } > "$WORK/env.md"
  return $rc
}

stage_tests() {
  # Only the files that can hold a CUDA test (the marker, or tests/devices.py's on_device): the
  # other test modules would be imported for nothing (half the stage's time in a dry run).
  local files
  mapfile -t files < <(grep -rlE --include='test_*.py' 'mark\.cuda|on_device' tests | sort)
  local args=("${files[@]}" -m cuda -q -rfEs -p no:cacheprovider --continue-on-collection-errors)
  if (( DRY_RUN )); then args+=(--collect-only)
  elif python3 -c "import xdist" 2> /dev/null; then args+=(-n 4); fi
  run python3 -m pytest "${args[@]}" 2>&1 | tee "$WORK/tests.out"
  local rc=${PIPESTATUS[0]}
  headline "$(grep -v '^$' "$WORK/tests.out" | tail -n 1 | tr -d '=')"
  # pytest's short summary (failures, errors, skips) ends with its final line.
  { echo '```'
    if grep -q 'short test summary info' "$WORK/tests.out"; then
      sed -n '/short test summary info/,$p' "$WORK/tests.out" | grep -v '^$'
    else grep -v '^$' "$WORK/tests.out" | tail -n 1; fi
    echo '```'; } > "$WORK/tests.md"
  return "$rc"
}

e2e_arm() {  # ARM CAP [TRAIN ARGS...]
  local arm=$1 limit start code
  limit=$(time_limit "$2")
  shift 2
  train_command "$arm" "$WORK/runs/$arm" "$STEPS"
  start=$(date +%s)
  run timeout -k 5 "$limit" "${TRAIN[@]}" "$@" 2>&1 | tee "$WORK/$arm.out"
  code=${PIPESTATUS[0]}
  python3 benchmarks/gpu/run_report.py "$WORK/runs/$arm" --exit-code "$code" \
    --wall-seconds "$(( $(date +%s) - start ))" --limit-seconds "$limit" \
    --headline "$WORK/e2e.headline" | tee -a "$WORK/e2e.md"
  if (( code != 0 && code != 124 && code != 137 )); then
    { echo '```'; tail -n 8 "$WORK/$arm.out"; echo '```'; echo; } >> "$WORK/e2e.md"
  fi
  return "$code"
}

stage_e2e() {
  local codes=()
  train_command ARM "$WORK/runs/ARM" "$STEPS"
  {
    echo "\`${TRAIN[*]/#$WORK/SCRATCH}\` with the checkpoint made in stage 0" \
      "($CHECKPOINT_CONFIG shape)."
    echo "A random-weight model earns reward 0 on every rollout, so every group is homogeneous:" \
      "baseline still runs a backward each step; stopped_tree runs with" \
      "bifurcate_after_active=0, as its 3 warmup steps would never become active and no step" \
      "would branch, and takes a zero-gradient AdamW step instead of a backward."
    echo
  } > "$WORK/e2e.md"
  e2e_arm baseline "${E2E_ARM_SECONDS[0]}"
  codes+=($?)
  e2e_arm stopped_tree "${E2E_ARM_SECONDS[1]}" --set bifurcate_after_active=0
  codes+=($?)
  for code in "${codes[@]}"; do
    if (( code == 124 || code == 137 )); then return "$PARTIAL"; fi
    if (( code != 0 )); then return 1; fi
  done
}

bench_stage() {  # PYTEST ARGS...: benchmarks beside their eager references, timed
  run python3 -m pytest -q -p no:cacheprovider "$@" --benchmark \
    --benchmark-json "$WORK/$STAGE.bench.json" --benchmark-columns=min,mean,rounds 2>&1 |
    tee "$WORK/$STAGE.out"
  local rc=${PIPESTATUS[0]}
  local speedups
  speedups=$(grep -o 'speed-up [0-9.]*x' "$WORK/$STAGE.out" | cut -d' ' -f2 | paste -sd' ')
  headline "speed-ups ${speedups:-none}; $(grep -v '^$' "$WORK/$STAGE.out" | tail -n 1 | tr -d '=')"
  # The ratio table and the counts conftest prints, up to pytest-benchmark's own tables.
  { echo '```'; sed -n '/fast path vs eager/,/^---/p' "$WORK/$STAGE.out" | grep -v '^---'
    grep -v '^$' "$WORK/$STAGE.out" | tail -n 1; echo '```'; } > "$WORK/$STAGE.md"
  return "$rc"
}

stage_graphs() {
  run python3 benchmarks/gpu/first_contact.py graphs --model "$MODEL" --device "$DEVICE" \
    --dtype "$DTYPE" 2>&1 | tee "$WORK/graphs.out"
  local rc=${PIPESTATUS[0]}
  headline "$(tail -n 1 "$WORK/graphs.out")"
  return "$rc"
}

stage_decode_step() {
  run python3 benchmarks/gpu/first_contact.py decode --model "$MODEL" --device "$DEVICE" \
    --dtype "$DTYPE" 2>&1 | tee "$WORK/decode_step.out"
  local rc=${PIPESTATUS[0]}
  headline "$(tail -n 1 "$WORK/decode_step.out")"
  return "$rc"
}

stage_decode() {
  bench_stage benchmarks/bench_engine.py -k "$DECODE_SELECT"
}

stage_ops() {
  bench_stage benchmarks/bench_weighted_nll.py benchmarks/bench_policy_loss.py \
    benchmarks/bench_zero_grad_adamw.py benchmarks/bench_paged_attention.py -k "$OPS_SELECT"
}

stage_profile() {
  if ! command -v nsys > /dev/null; then
    echo "nsys is not on this machine's PATH: no Nsight Systems profile" | tee "$WORK/profile.md"
    headline "nsys not found: no profile"
    return "$SKIPPED"
  fi
  local limit report=$WORK/profile
  limit=$(time_limit "${CAP_SECONDS[profile]}")
  train_command baseline "$WORK/runs/profile" 3
  run timeout -k 5 "$(( limit * 2 / 3 ))" nsys profile -t cuda,nvtx --force-overwrite true \
    -o "$report" "${TRAIN[@]}" || return 1
  run nsys stats --report nvtx_sum --report cuda_gpu_kern_sum "$report.nsys-rep" |
    tee "$WORK/profile.out"
  local rc=${PIPESTATUS[0]}
  { echo '```'; head -n 60 "$WORK/profile.out"; echo '```'; } > "$WORK/profile.md"
  headline "$(( rc == 0 )) report(s): NVTX ranges and GPU kernels, 3 baseline steps"
  return "$rc"
}

# ---------------------------------------------------------------------------- driver
describe() {  # EXIT_CODE LIMIT -> status words
  case $1 in
    0) echo ok ;;
    "$SKIPPED") echo "not run" ;;
    "$PARTIAL") echo "partial: part of it stopped at its time limit" ;;
    124 | 137) echo "timed out at its ${2} s limit" ;;
    *) echo "failed (exit $1)" ;;
  esac
}

run_stage() {  # INDEX NAME: run one stage under its limit; append its section to results.md
  local index=$1 name=$2 log limit start pid rc status seconds
  log=$RESULTS/$index-$name.log
  limit=$(time_limit "${CAP_SECONDS[$name]}")
  echo "## $index. ${TITLE[$name]}" >> "$RESULTS/results.md"
  if (( limit < MIN_STAGE_SECONDS )); then
    status="skipped: the ${BUDGET_SECONDS} s budget is spent"
    echo "$status" >> "$RESULTS/results.md"
    echo "| $index | ${TITLE[$name]} | $status | 0 | |" >> "$WORK/summary"
    FAILURES=$(( FAILURES + 1 ))
    return
  fi
  echo "==== stage $index: ${TITLE[$name]} (limit ${limit} s)"
  : > "$log"
  start=$(date +%s)
  timeout -k 10 "$limit" bash "$SCRIPT" --stage "$name" > "$log" 2>&1 &
  pid=$!
  tail -n +1 -f --pid="$pid" "$log"
  wait "$pid"
  rc=$?
  seconds=$(( $(date +%s) - start ))
  status=$(describe "$rc" "$limit")
  (( rc == 0 || rc == SKIPPED )) || FAILURES=$(( FAILURES + 1 ))
  {
    echo "$status, ${seconds} s (limit ${limit} s); raw output: \`$(basename "$log")\`"
    echo
    if [[ -s $WORK/$name.md ]]; then cat "$WORK/$name.md"
    else echo '```'; tail -n 20 "$log"; echo '```'; fi
    echo
  } >> "$RESULTS/results.md"
  local figures=""
  [[ -f $WORK/$name.headline ]] && figures=$(sed ':a;N;$!ba;s/\n/; /g' "$WORK/$name.headline")
  echo "| $index | ${TITLE[$name]} | $status | $seconds | ${figures//|/\\|} |" >> "$WORK/summary"
}

merge_benchmark_json() {  # every stage's pytest-benchmark JSON, in one file
  python3 - "$RESULTS/benchmarks.json" "$WORK"/*.bench.json <<'PYTHON'
import json, pathlib, sys
merged = {pathlib.Path(p).name.split(".")[0]: json.loads(pathlib.Path(p).read_text())
          for p in sys.argv[2:] if pathlib.Path(p).is_file()}
pathlib.Path(sys.argv[1]).write_text(json.dumps(merged, indent=1))
PYTHON
}

list_stages() {  # the stages this mode runs, each with its cap, then the budget
  local index=0 name
  for name in "${STAGES[@]}"; do
    [[ -n $name ]] || continue
    echo "$index $name ${CAP_SECONDS[$name]} s: ${TITLE[$name]}"
    index=$(( index + 1 ))
  done
  echo "budget ${BUDGET_SECONDS} s (reserve ${RESERVE_SECONDS} s)"
}

main() {
  DRY_RUN=0 FIRST=0 LIST=0
  while [[ ${1:-} == --* ]]; do
    case $1 in
      --dry-run) DRY_RUN=1 ;;
      --first) FIRST=1 ;;
      --list) LIST=1 ;;
      *) echo "check.sh: unknown option $1 (--first, --dry-run, --list)" >&2; exit 2 ;;
    esac
    shift
  done
  if (( LIST )); then WORK=${TMPDIR:-/tmp}; configure; list_stages; exit 0; fi
  if (( DRY_RUN )); then RESULTS=${1:-$(mktemp -d "${TMPDIR:-/tmp}/gpu-check-dry-run.XXXXXX")}
  else RESULTS=${1:-${OUT:-benchmarks/results/gpu-check-$(date -u +%Y%m%d-%H%M%S)}}; fi
  mkdir -p "$RESULTS" || exit 2
  RESULTS=$(cd "$RESULTS" && pwd)
  WORK=$(mktemp -d "${TMPDIR:-/tmp}/gpu-check-work.XXXXXX")
  trap 'rm -rf "$WORK"' EXIT
  FAILURES=0
  configure
  DEADLINE=$(( $(date +%s) + BUDGET_SECONDS * SLACK ))
  export DRY_RUN FIRST WORK DEADLINE
  local gpu commit
  gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader 2> /dev/null | head -n 1)
  commit=${COMMIT:-$(git rev-parse --short HEAD 2> /dev/null || echo "unknown (no .git here)")}
  {
    if (( DRY_RUN )); then echo "# GPU suite, dry run on the CPU (tiny sizes; no figure here is a GPU's)"
    else echo "# GPU suite on ${gpu:-no GPU found}"; fi
    echo
    echo "Commit $commit, $(date -u '+%Y-%m-%d %H:%M UTC'). Stages in order of value, each under"
    echo "its own limit, ${BUDGET_SECONDS} s in all; a summary table ends this file."
    echo
  } > "$RESULTS/results.md"
  echo "| # | stage | status | seconds | figures |" > "$WORK/summary"
  echo "|---|---|---|---|---|" >> "$WORK/summary"
  local index=0
  for name in "${STAGES[@]}"; do
    [[ -n $name ]] || continue
    run_stage "$index" "$name"
    [[ $name == decode || $name == ops ]] && merge_benchmark_json
    index=$(( index + 1 ))
  done
  { echo "## Summary"; echo; cat "$WORK/summary"; } >> "$RESULTS/results.md"
  echo
  cat "$WORK/summary"
  echo "wrote $RESULTS/results.md ($FAILURES stage(s) not ok)"
  (( FAILURES == 0 ))
}

if [[ ${1:-} == --stage ]]; then  # one stage, in its own process (run_stage times it)
  STAGE=$2
  configure
  "stage_$STAGE"
  exit
fi
main "$@"
