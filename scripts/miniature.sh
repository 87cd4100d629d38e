#!/usr/bin/env bash
# The miniature reproduction (scripts/miniature.py): DeiT-III, GPT and DINO at CPU size, 0 / middle /
# all Laplacian heads and learned gates, then analyses, tables, figures, learning curves and a
# verdict per claim of the paper. Re-running skips finished runs and resumes interrupted ones.
#   bash scripts/miniature.sh                  # short: DeiT-III + GPT, 3 seeds, ~25 min on 2 cores
#   bash scripts/miniature.sh --profile long   # long: + DINO, trained longer, 5 seeds, ~2.5 h
#   bash scripts/miniature.sh --profile study  # study: the paper's arms, 64-token QK-norm ViTs, 4 seeds, ~1.5 h
# Other arguments go to the script (--seeds, --jobs, --out, --docs, --pca-maps, --steps,
# --only, --train-only).
source "$(dirname "$0")/env.sh"
python scripts/miniature.py "$@"
