#!/usr/bin/env bash
# Fill .whl/ (ignored by git) with the wheels that benchmarks/gpu/run.sh installs on the device
# machine, whose image lacks them (nothing can be downloaded there; /work/.library/device/README.md):
# torchdata (an fnaccel dependency), torchao (the fp8 row), DeepSpeed and the dependencies of
# DeepSpeed the image lacks. Versions are this checkout's .venv's, the ones the suite is tested with.
# Run here, from anywhere, before the device call that carries ".whl".
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PYTHON:-.venv/bin/python}
version() { "$PY" -c "import importlib.metadata as m, sys; print(m.version(sys.argv[1]))" "$1"; }
mkdir -p .whl
rm -f .whl/*.whl
PLATFORMS=(--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64
           --platform manylinux2014_x86_64 --platform manylinux1_x86_64)
# the device's python3 is 3.12 (KINDS.md)
pins=()
for name in torchdata torchao hjson pydantic pydantic_core annotated_types typing_inspection typing_extensions; do
  pins+=("$name==$(version "$name")")
done
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  "${PLATFORMS[@]}" -d .whl "${pins[@]}"
# DeepSpeed is an sdist: build its (pure Python, no op compiled) wheel against the torch already here
DS_BUILD_OPS=0 "$PY" -m pip wheel -q --no-deps --no-build-isolation -w .whl "deepspeed==$(version deepspeed)"
ls -l .whl
du -sh .whl
