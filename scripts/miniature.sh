#!/usr/bin/env bash
# The miniature reproduction (scripts/miniature.py): DeiT-III on digits and a GPT on the built-in
# text, 0 / middle / all Laplacian heads and learned gates, 3 seeds, then analyses, tables,
# figures and a verdict per claim of the paper, in runs/miniature and docs/miniature.
# About 25 minutes on 2 CPU cores; re-running skips finished runs. Arguments go to the script.
source "$(dirname "$0")/env.sh"
python scripts/miniature.py "$@"
