"""The quick start: baseline vs all-Laplacian tiny ViT on the built-in digits, side by side.

    python scripts/quickstart.py                       # the full quick start (CPU, minutes)
    python scripts/quickstart.py trainer.max_steps=2   # any Hydra overrides, passed to both runs

Each run is the plain `python train.py model=<name> ...` command; running this again resumes
(or, when finished, just re-reads) the same run directories.
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MODELS = ("vitt_0L", "vitt_3L")  # ViT-Tiny has 3 heads: 3L = every head Laplacian


def train(model: str, overrides: list[str]) -> Path:
    """Run `python train.py model=<model> ...` into <runs_dir>/quickstart/<model>."""
    run_dir = f"${{paths.runs_dir}}/quickstart/{model}"
    cmd = [sys.executable, "train.py", f"model={model}", f"run_dir={run_dir}",
           "trainer.progress=false", *overrides]
    print("$ python", " ".join(cmd[1:]), flush=True)
    out = subprocess.run(cmd, check=True, cwd=ROOT, stdout=subprocess.PIPE, text=True).stdout
    print(out, end="")
    # train.py's first line names the resolved run directory.
    line = next(ln for ln in out.splitlines() if ln.startswith("[laplace] run_dir="))
    return ROOT / line.split("run_dir=", 1)[1].split()[0]


def main(overrides: list[str]):
    rows = [(model, train(model, overrides)) for model in MODELS]
    print()
    print(f"{'model':<10} {'Laplacian heads':>16} {'val top-1 (%)':>14} {'best top-1 (%)':>15}  run dir")
    for model, run_dir in rows:
        res = json.loads((run_dir / "results.json").read_text())
        print(f"{model:<10} {res['num_laplacian_heads']:>16} {res['final']['val_acc1']:>14.2f} "
              f"{res['best']['val_acc1']:>15.2f}  {run_dir}")


if __name__ == "__main__":
    main(sys.argv[1:])
