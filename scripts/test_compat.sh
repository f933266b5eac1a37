#!/usr/bin/env bash
# make test-compat: the whole test suite under the GPU machine's versions (torch 2.11, triton 3.6,
# transformers 5.17), on the CPU, in a side virtualenv, so that a first GPU lease does not find an
# API that only the CI's torch has.
#
#   bash scripts/test_compat.sh [RESULT_FILE]
#
# The working tree's files (tracked and untracked, not ignored) are copied to build/compat/src, a
# virtualenv there gets the pinned versions, the C++ extension is built against its torch, and
# pytest runs every test, the sm_90 ahead-of-time compiles included (they need no GPU). The
# result (versions, pytest's summary of what failed and its final line) goes to RESULT_FILE
# (default benchmarks/results/compat-torch2.11.md), written atomically; the copy and its
# virtualenv (several GB: PyPI's torch 2.11 for Linux is the CUDA build, which runs on a CPU too)
# are deleted afterwards unless KEEP_COMPAT=1.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2
PINS=(torch==2.11.0 triton==3.6.0 transformers==5.17.0)
ROOT=$PWD
RESULT=${1:-benchmarks/results/compat-torch2.11.md}
WORK=$ROOT/build/compat
SRC=$WORK/src
WORKERS=${COMPAT_WORKERS:-2}

COMMIT=$(git rev-parse --short HEAD 2> /dev/null || echo unknown)
[[ -z $(git status --porcelain 2> /dev/null) ]] || COMMIT="$COMMIT with uncommitted changes"
rm -rf "$WORK" && mkdir -p "$SRC" || exit 2
cleanup() { [[ ${KEEP_COMPAT:-0} == 1 ]] || rm -rf "$WORK"; }
trap cleanup EXIT
git ls-files -co --exclude-standard -z | tar --null -cf - -T - | tar -xf - -C "$SRC" || exit 2
cd "$SRC" || exit 2
printf '%s\n' "${PINS[@]}" > "$WORK/constraints.txt"
python3 -m venv .venv || exit 2
BIN=$SRC/.venv/bin
echo "+ installing ${PINS[*]} and the package's dependencies (minutes: the CUDA wheels are large)"
"$BIN/pip" install --quiet --upgrade setuptools wheel || exit 1
"$BIN/pip" install --quiet "${PINS[@]}" ninja || exit 1
"$BIN/python" setup.py --quiet build_ext --inplace > "$WORK/build_ext.log" 2>&1 ||
  { tail -n 30 "$WORK/build_ext.log"; exit 1; }
RLVR_FAST_EXTENSION=inplace "$BIN/pip" install --quiet --no-build-isolation \
  -c "$WORK/constraints.txt" -e '.[dev]' || exit 1
VERSIONS=$("$BIN/python" -c "
import sys, torch, triton, transformers
print(f'Python {sys.version.split()[0]}, torch {torch.__version__}, triton {triton.__version__},',
      f'transformers {transformers.__version__}')")
echo "+ $VERSIONS"
for pin in "${PINS[@]}"; do  # the pins must hold: a resolver that moved one proves nothing
  "$BIN/python" -c "import importlib.metadata as m, sys; n, v = sys.argv[1].split('=='); \
sys.exit(0 if m.version(n).split('+')[0] == v else f'{n} is {m.version(n)}, not {v}')" "$pin" ||
    exit 1
done
start=$(date +%s)
OMP_NUM_THREADS=1 "$BIN/python" -m pytest -q -n "$WORKERS" --dist worksteal -p no:cacheprovider \
  tests 2>&1 | tee "$WORK/pytest.out"
rc=${PIPESTATUS[0]}
seconds=$(( $(date +%s) - start ))
cd "$ROOT" || exit 2
mkdir -p "$(dirname "$RESULT")"
{
  echo "# make test-compat: the suite under the GPU machine's versions"
  echo
  echo "Commit $COMMIT, $(date -u '+%Y-%m-%d %H:%M UTC');"
  echo "$VERSIONS; $WORKERS pytest workers, ${seconds} s, exit $rc."
  echo
  echo '```'
  if grep -q 'short test summary info' "$WORK/pytest.out"; then
    sed -n '/short test summary info/,$p' "$WORK/pytest.out" | grep -v '^$' | grep -v '^SKIPPED'
  else grep -v '^$' "$WORK/pytest.out" | tail -n 1; fi
  echo '```'
} > "$RESULT.tmp" && mv "$RESULT.tmp" "$RESULT"
echo "wrote $RESULT"
exit "$rc"
