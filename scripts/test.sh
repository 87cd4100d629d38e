#!/usr/bin/env bash
# README command 2: set up .venv, then run the whole test suite (slow tests included).
# Extra arguments go to pytest, e.g. -m "not slow" or -k attention.
source "$(dirname "$0")/env.sh"
# Two pytest workers (pytest-xdist): the suite is bound to one core (its user time equals its wall
# time serially), and most of it is small subprocesses; `-n 0` runs it serially.
python -m pytest -q -n 2 "$@"
