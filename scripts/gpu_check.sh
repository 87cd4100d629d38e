#!/usr/bin/env bash
# The GPU check (scripts/gpu_check.py): every trainer and experiment family for a few steps with
# bf16 and torch.compile, stop-and-resume, preemption, a crash, analysis of CUDA checkpoints, the
# `cuda`-marked tests and the benchmark; one line per check, exit status 1 if any failed.
#   bash scripts/gpu_check.sh                                   # on a GPU node, in the repo's .venv
#   bash scripts/gpu_check.sh --device cpu --no-compile --tiny  # a dry run of the script on CPU
# Without .venv (a bare GPU machine): PYTHONPATH=. python scripts/gpu_check.py
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -x .venv/bin/python ]; then source .venv/bin/activate; fi
exec python scripts/gpu_check.py "$@"
