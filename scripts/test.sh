#!/usr/bin/env bash
# README command 2: set up .venv, then run the whole test suite (slow tests included).
# Extra arguments go to pytest, e.g. -m "not slow" or -k attention.
source "$(dirname "$0")/env.sh"
python -m pytest -q "$@"
