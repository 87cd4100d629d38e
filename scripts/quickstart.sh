#!/usr/bin/env bash
# README command 1: set up .venv, then train a baseline and an all-Laplacian tiny ViT on the
# built-in digits (CPU, a few minutes) and print their accuracies side by side.
# Extra arguments are Hydra overrides passed to both runs, e.g. trainer.max_steps=2.
source "$(dirname "$0")/env.sh"
python scripts/quickstart.py "$@"
