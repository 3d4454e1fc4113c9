#!/usr/bin/env bash
# One-shot check on a machine with CUDA GPUs: the GPU tests (tests/gpu: NCCL, one rank per
# visible GPU, against CPU references) and then a small GPU benchmark (world size 1, NCCL).
# Logs, the benchmark's JSON records, its markdown table and plot go to
# "${OUT:-benchmarks/results/gpu}". Each step has its own time limit (tests 240 s, benchmark
# 240 s), so the whole run stays under 8 minutes.
#
# Usage, from anywhere:  bash benchmarks/gpu_check.sh
# Settings (environment): OUT (output folder), PYTHON (default python3), BENCH_SIZES (default
# 50M,200M), BENCH_REPEATS (default 1).
#
# The GPU machine may have torch with CUDA but not every dependency of the library, and no
# package index. Wheels for what is missing travel in the git-ignored folder .whl/ at the
# repository root; fill it beforehand on a machine with an index:
#   pip download structlog attrs typing_extensions pytest pytest-timeout -d .whl --only-binary=:all:
# (all pure-Python wheels, so they install on any Python 3 and platform). Only the packages
# that do not import there are installed, from .whl/ alone.
#
# The summary states the torch version the run used (first and last lines).
#
# Exit status: 0 when the tests passed (or found no GPU and skipped) and the benchmark ran;
# 1 otherwise. Without CUDA the benchmark is skipped.

set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
ROOT=$PWD
OUT_DIR=${OUT:-benchmarks/results/gpu}
PY=${PYTHON:-python3}
SIZES=${BENCH_SIZES:-50M,200M}
REPEATS=${BENCH_REPEATS:-1}
export PYTHONUNBUFFERED=1 PIP_ROOT_USER_ACTION=ignore PIP_DISABLE_PIP_VERSION_CHECK=1
mkdir -p "$OUT_DIR" || exit 1
SUMMARY=$OUT_DIR/summary.log
: >"$SUMMARY"
status=0

say() { echo "== $*" | tee -a "$SUMMARY"; }

say "gpu_check $(date -u +%FT%TZ) in $ROOT ($(git -C "$ROOT" rev-parse --short HEAD 2>/dev/null || echo 'no git'))"
# The torch this run used, next to the floor setup.cfg declares (docs/torch_versions.md lists
# what each feature needs); the results below hold for this torch only.
TORCH_VERSION=$("$PY" -c "import torch; print(torch.__version__, 'cuda', torch.version.cuda)" 2>/dev/null ||
    echo "not importable")
say "torch $TORCH_VERSION (setup.cfg declares $(grep -Eo 'torch>=[0-9.]+' "$ROOT/setup.cfg" || echo '?'))"
trap 'say "ran with torch $TORCH_VERSION"' EXIT
{ nvidia-smi 2>&1 || echo "nvidia-smi: not available"; } >>"$SUMMARY"
"$PY" - >>"$SUMMARY" 2>&1 <<'EOF'
import platform
import torch
import torch.distributed as dist
print("python", platform.python_version(), "torch", torch.__version__, "cuda", torch.version.cuda)
print("cuda available", torch.cuda.is_available(), "devices", torch.cuda.device_count(),
      "nccl", dist.is_available() and dist.is_nccl_available())
EOF

# -- dependencies: install from .whl/ only what does not import --------------------------------
missing=()
for spec in structlog:structlog attrs:attrs typing_extensions:typing_extensions \
    pytest:pytest pytest_timeout:pytest-timeout; do
    "$PY" -c "import ${spec%%:*}" 2>/dev/null || missing+=("${spec##*:}")
done
if ((${#missing[@]})); then
    say "installing from .whl/: ${missing[*]}"
    if ! "$PY" -m pip install -q --no-index --find-links "$ROOT/.whl/" "${missing[@]}" \
        >>"$SUMMARY" 2>&1; then
        say "FAILED: could not install ${missing[*]} from .whl/ (see the comment at the top)"
        exit 1
    fi
fi

# -- the library: this checkout, importable from anywhere (spawned ranks too) ------------------
where=$(cd / && "$PY" -c "import fsdp_builder, os; print(os.path.dirname(fsdp_builder.__file__))" 2>/dev/null)
if [ "$where" != "$ROOT/fsdp_builder" ]; then
    # No index there: no build isolation (setuptools and wheel come from the environment).
    if ! "$PY" -m pip install -q --no-deps --no-build-isolation -e "$ROOT" >>"$SUMMARY" 2>&1; then
        say "pip install -e . failed; using PYTHONPATH=$ROOT instead"
        export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
    fi
fi

# -- the GPU tests -----------------------------------------------------------------------------
say "pytest tests/gpu"
timeout 240 "$PY" -m pytest -q -rs -p no:cacheprovider tests/gpu 2>&1 | tee "$OUT_DIR/pytest_gpu.log"
rc=${PIPESTATUS[0]}
case $rc in
0) say "tests: passed (or skipped: see above)" ;;
5) say "tests: none collected" ;;
124) say "FAILED: tests ran past 240 s" && status=1 ;;
*) say "FAILED: tests exited with $rc" && status=1 ;;
esac

# -- a small benchmark -------------------------------------------------------------------------
if ! "$PY" -c "import sys, torch; sys.exit(not torch.cuda.is_available())"; then
    say "no CUDA: benchmark skipped"
    exit $status
fi
say "benchmark: sizes $SIZES, world size 1, $REPEATS repeat(s)"
timeout 240 "$PY" -m benchmarks.harness --world-size 1 --sizes "$SIZES" --repeats "$REPEATS" \
    --timeout 120 --quiet --json "$OUT_DIR/bench.json" --out "$OUT_DIR" 2>&1 |
    tee "$OUT_DIR/bench.log"
rc=${PIPESTATUS[0]}
if [ "$rc" -eq 0 ]; then
    say "benchmark: done ($OUT_DIR/bench.md)"
else
    say "FAILED: benchmark exited with $rc" && status=1
fi
exit $status
