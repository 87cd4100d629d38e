#!/usr/bin/env bash
# README's second command: set up .venv, then run the test suite.
#   bash scripts/test.sh          every test not marked slow (about 5 minutes on 2 cores)
#   bash scripts/test.sh --all    every test: also the slow end-to-end ones (Slurm, preemption, the
#                                 quick start, the miniature; 15-18 minutes), as CI (.ci/run) runs it
# Further arguments go to pytest, e.g. -k attention, or -m cuda (a later -m replaces ours).
source "$(dirname "$0")/env.sh"
marker=(-m "not slow")
if [[ "${1:-}" == "--all" ]]; then
  shift
  marker=()
fi
# Two pytest workers (pytest-xdist) for two cores, stealing work at the end; `-n 0` runs serially.
# One thread per worker and per subprocess (they inherit it): two workers of two threads each spin
# on two cores (five of its files took 21% longer so; three workers gained nothing: docs/LOG.md).
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
python -m pytest -q -n 2 --dist worksteal "${marker[@]}" "$@"
