#!/usr/bin/env bash
# The GPU check (scripts/gpu_check.py): every trainer a few steps with bf16, data workers and
# torch.compile as shipped, stop and resume, preemption, eager = compiled, 2 NCCL ranks, the d20
# GPT's memory, throughput beside the data loader, evaluations and analysis of CUDA checkpoints,
# the `cuda`-marked tests; one line per check, exit status 1 if any failed.
#   bash scripts/gpu_check.sh                                   # on a GPU node, in the repo's .venv
#   bash scripts/gpu_check.sh --device cpu --no-compile --tiny  # a dry run of the script on CPU
# Without .venv (a bare GPU machine): python scripts/gpu_check.py (needs the [test,lm,seg] extras).
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -x .venv/bin/python ]; then source .venv/bin/activate; fi
exec python scripts/gpu_check.py "$@"
