#!/usr/bin/env bash
# CUDA check shared by every fast-path issue: installs the project on a GPU machine, runs the
# CUDA tests and the CUDA benchmarks (under 8 minutes on one H200), and writes every figure with
# the GPU name and commit to a results file. Usage: bash benchmarks/gpu/check.sh [RESULTS_DIR]
# Each fast-path issue appends its tests and benchmarks to the two lists below.
set -euo pipefail
cd "$(dirname "$0")/../.."
results_dir=${1:-${OUT:-benchmarks/results}}
mkdir -p "$results_dir"
pip install --quiet --no-deps --no-build-isolation -e . >/dev/null

CUDA_TESTS=(tests/test_weighted_nll.py tests/test_paged_attention.py tests/test_zero_grad_adamw.py
            tests/test_engine.py)
CUDA_BENCHMARKS=(benchmarks/bench_engine.py benchmarks/bench_weighted_nll.py
                 benchmarks/bench_zero_grad_adamw.py benchmarks/bench_paged_attention.py
                 benchmarks/bench_tree_rollout.py)

gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -n 1)
commit=$(git rev-parse --short HEAD 2>/dev/null || echo "uncommitted")
result="$results_dir/gpu-check-$(date -u +%Y%m%d-%H%M%S).md"
{
  echo "# CUDA check on $gpu, commit $commit, $(date -u '+%Y-%m-%d %H:%M UTC')"
  python -c "import torch, triton; print('torch', torch.__version__, '| triton', triton.__version__)"
  echo; echo "## tests"
  timeout 180 python -m pytest -q "${CUDA_TESTS[@]}" 2>&1 | tail -n 5
  echo; echo "## benchmarks (eager vs fast, same run)"
  timeout 270 python -m pytest -q "${CUDA_BENCHMARKS[@]}" --benchmark-only \
    --benchmark-columns=min,mean,rounds 2>&1 | sed -n '/same run/,$p'
} | tee "$result"
echo "wrote $result"
