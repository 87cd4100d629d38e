"""The quick start: baseline vs all-Laplacian tiny ViT on the built-in digits, side by side,
with the paper's token-geometry measurements of both.

    python scripts/quickstart.py                       # the full quick start (CPU, minutes)
    python scripts/quickstart.py trainer.max_steps=2   # any Hydra overrides, passed to both runs
    python scripts/quickstart.py analysis.max_tokens=2000 analysis.pca_maps=8   # options of the analysis

Each run is the plain `python train.py model=<name> ...` command; running this again resumes
(or, when finished, just re-reads) the same run directories. Then one
`python -m analysis checkpoint=[<both last.pt>]` measures both checkpoints on the validation
split: overrides starting with `analysis.` go to it (without the prefix), `paths.*` go to all
three commands. Its figures (both models on shared axes) land in <runs_dir>/quickstart/analysis.
The table adds, at the final-norm layer: the within-image share of the patch-token variance,
NC1 of the class token and the number of principal components for 99% of the patch-token
variance (the paper: Laplacian heads lower the first two, and spectra decay faster).
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MODELS = ("vitt_0L", "vitt_3L")  # ViT-Tiny has 3 heads: 3L = every head Laplacian


def _run(cmd: list[str]) -> str:
    print("$ python", " ".join(cmd[1:]), flush=True)
    out = subprocess.run(cmd, check=True, cwd=ROOT, stdout=subprocess.PIPE, text=True).stdout
    print(out, end="")
    return out


def train(model: str, overrides: list[str]) -> Path:
    """Run `python train.py model=<model> ...` into <runs_dir>/quickstart/<model>."""
    run_dir = f"${{paths.runs_dir}}/quickstart/{model}"
    out = _run([sys.executable, "train.py", f"model={model}", f"run_dir={run_dir}",
                "trainer.progress=false", *overrides])
    # train.py's first line names the resolved run directory.
    line = next(ln for ln in out.splitlines() if ln.startswith("[laplace] run_dir="))
    return ROOT / line.split("run_dir=", 1)[1].split()[0]


def analyse(run_dirs: list[Path], overrides: list[str]) -> list[dict]:
    """`python -m analysis` on both checkpoints; returns their analysis.json contents."""
    ckpts = [d / "ckpt" / "last.pt" for d in run_dirs]
    out = _run([sys.executable, "-m", "analysis", f"checkpoint=[{','.join(map(str, ckpts))}]",
                f"analysis_out={run_dirs[0].parent / 'analysis'}", "progress=false", *overrides])
    # one "[analysis] wrote <dir>/analysis.json" line per checkpoint, in order
    wrote = [ln.split("wrote ", 1)[1] for ln in out.splitlines()
             if ln.startswith("[analysis] wrote ") and ln.endswith("analysis.json")]
    return [json.loads(Path(p).read_text()) for p in wrote]


def _norm_metric(res: dict, kind: str, group: str, key: str) -> float:
    """A value at the final-norm layer; NaN when it was not measured (e.g. analysis.metrics=[...])."""
    value = res["results"][kind].get("norm", {}).get(group, {}).get(key)
    return float("nan") if value is None else value


def main(args: list[str]):
    train_args = [a for a in args if not a.startswith("analysis.")]
    analysis_args = [a.split(".", 1)[1] for a in args if a.startswith("analysis.")]
    analysis_args += [a for a in args if a.startswith("paths.")]  # same runs_dir everywhere
    run_dirs = [train(model, train_args) for model in MODELS]
    geometry = analyse(run_dirs, analysis_args)
    print()
    print(f"{'model':<10} {'Laplacian heads':>16} {'val top-1 (%)':>14} {'best top-1 (%)':>15} "
          f"{'within-seq share':>17} {'NC1 (cls)':>10} {'n_pcs_0.99':>11}  run dir")
    for model, run_dir, geo in zip(MODELS, run_dirs, geometry):
        res = json.loads((run_dir / "results.json").read_text())
        print(f"{model:<10} {res['num_laplacian_heads']:>16} {res['final']['val_acc1']:>14.2f} "
              f"{res['best']['val_acc1']:>15.2f} {_norm_metric(geo, 'patch', 'anova', 'within_seq_share'):>17.4f} "
              f"{_norm_metric(geo, 'cls', 'nc', 'nc1'):>10.3f} "
              f"{_norm_metric(geo, 'patch', 'spectral', 'n_pcs_0.99'):>11.0f}  {run_dir}")
    print("(geometry at the final norm, on the validation split: within-image share of the patch-token "
          "variance, NC1 of the class token, PCs for 99% of the patch-token variance)")


if __name__ == "__main__":
    main(sys.argv[1:])
