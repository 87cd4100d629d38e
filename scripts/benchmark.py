"""Moved to `python -m laplace.bench` (laplace/bench/): this wrapper passes its arguments on.

    python scripts/benchmark.py --threads 1        # = python -m laplace.bench --threads 1
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository

from laplace.bench import main  # noqa: E402

if __name__ == "__main__":
    main()
