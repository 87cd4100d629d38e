#!/usr/bin/env bash
# README command 2: set up .venv, then run the whole test suite (slow tests included).
# Extra arguments go to pytest, e.g. -m "not slow" or -k attention.
source "$(dirname "$0")/env.sh"
# Three pytest workers (pytest-xdist) for two cores: serially the suite keeps one core busy (its user
# time equals its wall time), and on two workers 1.5 cores, the rest waiting on subprocesses and
# signals; work stealing keeps the last minutes busy too. `-n 0` runs it serially. One thread per
# worker and per subprocess (they inherit it): workers of two threads each spin on two cores (five
# of its files took 21% longer so; docs/LOG.md).
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
python -m pytest -q -n 3 --dist worksteal "$@"
