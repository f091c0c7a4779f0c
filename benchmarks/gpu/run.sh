#!/usr/bin/env bash
# Issue 29's device run, in one `device` call of at most 8 minutes (docs/benchmarks.md, "GPU:
# benchmarks/gpu/run.sh"). Here, first: `bash benchmarks/gpu/wheels.sh` (fills .whl/). Then one
# device call: command `bash benchmarks/gpu/run.sh`, carry [".whl"], timeout_s 540.
#
# It writes under $OUT (the device tool brings back at most 8 files): env.txt (machine, driver,
# versions), figures.json and bench.log (benchmarks/gpu/run.py: step rows with tokens/s and MFU,
# the bit-exact resume, the asynchronous save), suite.log and suite.xml (the suite's CUDA part,
# every test named, -rfEs, a per-test timeout). The figures come first, so a suite that runs long
# cannot cost them; each part has its own time limit (BENCH_TIMEOUT, SUITE_TIMEOUT seconds).
#
# `bash benchmarks/gpu/run.sh --tiny` checks it on a CPU (tests/test_gpu_run_script.py): the
# figures at the toy size on the CPU (the CUDA-only rows recorded as skipped, with the reason), and
# the suite's file selection listed, not run.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-runs/gpu}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
TINY=0
[ "${1:-}" = "--tiny" ] && TINY=1
export PYTHONUNBUFFERED=1
if [ $TINY = 0 ] && ls .whl/*.whl >/dev/null 2>&1; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}

env_report() {
  date -u
  nvidia-smi 2>&1 | head -20
  "$PY" -c "import sys, torch; print(sys.version); print('torch', torch.__version__, 'cuda', torch.version.cuda,
'device', torch.cuda.get_device_name() if torch.cuda.is_available() else None)"
  "$PY" -m pip list 2>/dev/null | grep -iE '^(torch|torchao|torchdata|deepspeed|safetensors|pytest|pytest-timeout|pytest-xdist) '
  "$PY" -c "import importlib.metadata as m
for name in ('torchao', 'torchdata', 'deepspeed'):
    try: print(name, m.version(name), 'from', m.distribution(name).locate_file(''))
    except m.PackageNotFoundError: print(name, 'missing')"
}
if [ $TINY = 1 ]; then
  env_report > "$OUT/env.txt" 2>&1 &  # beside the figures: the toy figures are checked, never compared
else
  env_report > "$OUT/env.txt" 2>&1  # before the figures, so that it cannot slow them
fi

# 1. the figures
if [ $TINY = 1 ]; then
  BENCH=(--tiny --device cpu --rounds 1 --steps 2 --save-rounds 1 --rows eager,fsdp,deepspeed_zero2,compiled,fp8)
else
  BENCH=()
fi
timeout "${BENCH_TIMEOUT:-290}" "$PY" benchmarks/gpu/run.py "${BENCH[@]}" --json "$OUT/figures.json" \
  > "$OUT/bench.log" 2>&1
echo "benchmarks/gpu/run.py exit status $?" >> "$OUT/bench.log"

# 2. the suite's CUDA part: the test files that name CUDA, or call fa.init without cpu=True (on a
# CUDA machine such a run computes on the GPU)
FILES=$("$PY" - <<'EOF'
import pathlib, re
for path in sorted(pathlib.Path("tests").rglob("test_*.py")):
    text = path.read_text()
    if re.search("cuda", text, re.I) or re.search(r"\bfa\.init\((?![^)\n]*cpu=True)", text):
        print(path)
EOF
)
if [ $TINY = 1 ]; then
  { echo "--tiny: the suite's CUDA part is not run; it would be:"; echo "$FILES"; } > "$OUT/suite.log"
else
  # shellcheck disable=SC2086
  timeout "${SUITE_TIMEOUT:-150}" "$PY" -m pytest -v -rfEs --timeout 90 -n 8 --junitxml="$OUT/suite.xml" \
    $FILES > "$OUT/suite.log" 2>&1
  echo "pytest exit status $?" >> "$OUT/suite.log"
  grep -E '^(FAILED|ERROR)|passed|failed' "$OUT/suite.log" | tail -40
fi
wait  # the --tiny run's environment report
cat "$OUT/bench.log"
