#!/usr/bin/env bash
# Wheels for bench/gpu_check.py on a GPU machine that cannot reach a package registry, whose
# Python already holds torch, transformers, peft, accelerate and pytest: TRL and what it adds
# (datasets, dill, multiprocess, fsspec, pyarrow), saved to .whl/ (ignored by git) for the
# machine's Python (default 3.12). There, from the repository root:
#
#   python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
#       --target /tmp/site-packages .whl/*.whl &&
#   PYTHONPATH=/tmp/site-packages:$PWD/src python3 bench/gpu_check.py [--out DIR/GPU.md]
#
# The folder's name must hold "site-packages": dill, which datasets fingerprints TRL's data
# with, copies by value the modules found elsewhere, and fails on pyarrow's types.
# (On a CPU, a fresh environment without TRL holding the machine's transformers 5.17 and
# accelerate 1.15, wheels saved with --python=3.11: the dry run's three steps and
# compare.py's DPO and GRPO on the tiny model ran.)
# pyarrow is the large one (~55 MB): pass --no-pyarrow where the machine's is 24 or later.
set -euo pipefail
cd "$(dirname "$0")/.."
python_version=3.12
packages=("trl==1.16.0" "datasets==5.2.0" "dill<0.4.2" "multiprocess<0.70.20" "fsspec<=2026.9.0" "pyarrow>=24")
for arg in "$@"; do
  case "$arg" in
    --no-pyarrow) unset 'packages[-1]' ;;
    --python=*) python_version="${arg#--python=}" ;;
    *) echo "bench/gpu_wheels.sh: unknown option $arg (--no-pyarrow, --python=3.12)" >&2; exit 2 ;;
  esac
done
rm -rf .whl.tmp && mkdir .whl.tmp
python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$python_version" --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d .whl.tmp "${packages[@]}"
rm -rf .whl && mv .whl.tmp .whl
du -sh .whl && ls .whl
