#!/usr/bin/env bash
# README's first command (docs/performance.md "The two commands": its times): set up .venv, then train
# baseline vs Laplacian tiny models of the paper's three paradigms on built-in data (CPU, minutes) and
# print their scores and token geometry side by side.
# Extra arguments are Hydra overrides for every training run, e.g. trainer.max_steps=2 (prefixes vit., lm.,
# dino., analysis. address one part: scripts/quickstart.py).
source "$(dirname "$0")/env.sh"
python scripts/quickstart.py "$@"
