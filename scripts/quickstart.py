"""The quick start: baseline vs Laplacian models of the paper's three paradigms on built-in data,
side by side, with the paper's token-geometry measurements of each.

    python scripts/quickstart.py                       # the full quick start (CPU, minutes)
    python scripts/quickstart.py trainer.max_steps=2   # Hydra overrides for every training run
    python scripts/quickstart.py vit.model.depth=2 lm.data.seq_len=64 dino.trainer.epochs=2   # one paradigm only
    python scripts/quickstart.py analysis.max_tokens=2000 analysis.pca_maps=8   # options of the analysis

1. Supervised ViT (DeiT-III trainer) on the built-in digits: vitt_0L vs vitt_3L (every head of
   ViT-Tiny Laplacian), `python train.py model=<name>`.
2. Language model on Python's built-in help text: `python -m laplace.data.prepare source=pydoc
   vocab_size=4096` (our BPE and token shards, seconds), then `python train.py experiment=gpt_tiny
   model=<name>` with Muon for gpt_d2_0L vs gpt_d2_1L (its one head Laplacian).
3. Self-supervised DINO (trainer=dino) on the digits without their labels: `python train.py
   experiment=dino_digits model=<name>` for vits_0L vs vits_5L (ViT-S's six heads at width 96,
   five of them Laplacian, as the paper's best DINO model), then DINO's weighted 20-NN
   classifier on the teacher's class tokens, `python -m eval.knn checkpoint=<run>/ckpt/last.pt`.

Each run is the plain command; running this again resumes (or, when finished, re-reads) the same
run directories. Then `python -m analysis checkpoint=[<both last.pt>]` per paradigm measures both
checkpoints on the validation split. Overrides: `vit.` / `lm.` prefixed ones go to that
paradigm's training runs (`dino.`: the DINO pair's; without the prefix), `analysis.` ones to the analyses, `paths.*` to
every command, the rest to every training run. Figures land in <runs_dir>/quickstart/<paradigm>/analysis.
The tables add, at the final-norm layer: the within-sequence (image / window) share of the token
variance, NC1 of the class token (ViT) or the next-token CDNV (LM), and the number of principal
components for 99% of the token variance (the paper: Laplacian heads lower the share and the
collapse measures, and spectra decay faster).
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
VIT_MODELS = ("vitt_0L", "vitt_3L")  # ViT-Tiny has 3 heads: 3L = every head Laplacian
LM_MODELS = ("gpt_d2_0L", "gpt_d2_1L")  # a depth-2 GPT has one 128-wide head: 1L = all Laplacian
DINO_MODELS = ("vits_0L", "vits_5L")  # experiment=dino_digits: 6 heads of 16, 5 Laplacian


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


def analyse(run_dirs: list[Path], overrides: list[str], out_dir: Path) -> list[dict]:
    """`python -m analysis` on both checkpoints; returns their analysis.json contents."""
    ckpts = [d / "ckpt" / "last.pt" for d in run_dirs]
    out = _run([sys.executable, "-m", "analysis", f"checkpoint=[{','.join(map(str, ckpts))}]",
                f"analysis_out={out_dir}", "progress=false", *overrides])
    # one "[analysis] wrote <dir>/analysis.json" line per checkpoint, in order
    wrote = [ln.split("wrote ", 1)[1] for ln in out.splitlines()
             if ln.startswith("[analysis] wrote ") and ln.endswith("analysis.json")]
    return [json.loads(Path(p).read_text()) for p in wrote]


def knn(run_dir: Path, overrides: list[str]) -> None:
    """`python -m eval.knn` on a run's last checkpoint: <run>/eval/knn_<data>/results.json."""
    _run([sys.executable, "-m", "eval.knn", f"checkpoint={run_dir / 'ckpt' / 'last.pt'}", "num_workers=1",
          *overrides])


def _knn_top1(run_dir: Path) -> float:
    return json.loads((run_dir / "eval" / "knn_digits" / "results.json").read_text())["knn"]["top1"]


def _geo(res: dict, key: str) -> float:
    """A headline geometry value at the final norm (analysis.runs.geometry); NaN if not measured."""
    from analysis.runs import geometry

    return geometry(res).get(key, float("nan"))


# (header, format, value of (results.json, analysis.json)) per column of a paradigm's table.
VIT_COLUMNS = [("val top-1 (%)", ".2f", lambda r, g: r["final"]["val_acc1"]),
               ("best top-1 (%)", ".2f", lambda r, g: r["best"]["val_acc1"]),
               ("within-seq share", ".4f", lambda r, g: _geo(g, "within_seq_share")),
               ("NC1 (cls)", ".3f", lambda r, g: _geo(g, "nc1")),
               ("n_pcs_0.99", ".0f", lambda r, g: _geo(g, "n_pcs_0.99"))]
LM_COLUMNS = [("val bpb", ".4f", lambda r, g: r["final"]["val_bpb"]),
              ("val loss", ".4f", lambda r, g: r["final"]["val_loss"]),
              ("within-seq share", ".4f", lambda r, g: _geo(g, "within_seq_share")),
              ("next-tok CDNV", ".3f", lambda r, g: _geo(g, "lc_cdnv_mean")),
              ("n_pcs_0.99", ".0f", lambda r, g: _geo(g, "n_pcs_0.99"))]
DINO_COLUMNS = [("20-NN top-1 (%)", ".2f", lambda r, g: _knn_top1(Path(r["run_dir"]))),
                ("final loss", ".3f", lambda r, g: r["final"]["train_loss"]),
                ("within-seq share", ".4f", lambda r, g: _geo(g, "within_seq_share")),
                ("NC1 (cls)", ".3f", lambda r, g: _geo(g, "nc1")),
                ("n_pcs_0.99", ".0f", lambda r, g: _geo(g, "n_pcs_0.99"))]


def table(title: str, columns, models, run_dirs, geometries):
    print(f"\n{title}")
    print(f"{'model':<10} {'Laplacian heads':>16} " + " ".join(f"{h:>{len(h) + 1}}" for h, _, _ in columns) + "  run dir")
    for model, run_dir, geo in zip(models, run_dirs, geometries):
        res = {**json.loads((run_dir / "results.json").read_text()), "run_dir": str(run_dir)}
        cells = " ".join(f"{fn(res, geo):>{len(h) + 1}{fmt}}" for h, fmt, fn in columns)
        print(f"{model:<10} {res['num_laplacian_heads']:>16} {cells}  {run_dir}")


def main(args: list[str]):
    common = [a for a in args if not a.startswith(("analysis.", "vit.", "lm.", "dino."))]
    paths = [a for a in args if a.startswith("paths.")]  # same runs_dir / data_dir everywhere
    only = lambda prefix: [a[len(prefix):] for a in args if a.startswith(prefix)]  # noqa: E731
    analysis_args = only("analysis.") + paths

    vit_dirs = [train(m, common + only("vit.")) for m in VIT_MODELS]
    vit_geo = analyse(vit_dirs, analysis_args, vit_dirs[0].parent / "vit" / "analysis")
    _run([sys.executable, "-m", "laplace.data.prepare", "source=pydoc", "vocab_size=4096",
          "progress=false", *paths])
    lm_dirs = [train(m, ["experiment=gpt_tiny", *common, *only("lm.")]) for m in LM_MODELS]
    lm_geo = analyse(lm_dirs, analysis_args, lm_dirs[0].parent / "lm" / "analysis")
    dino_dirs = [train(m, ["experiment=dino_digits", *common, *only("dino.")])
                 for m in DINO_MODELS]
    for d in dino_dirs:
        knn(d, paths)
    # with DINOv2-style PCA maps of the patch tokens of 8 validation digits (pca_maps.png)
    dino_geo = analyse(dino_dirs, ["pca_maps=8", *analysis_args], dino_dirs[0].parent / "dino" / "analysis")

    table("1. Supervised ViT-Tiny on the built-in digits (trainer=deit3)", VIT_COLUMNS, VIT_MODELS, vit_dirs, vit_geo)
    table("2. GPT language model on the built-in help text (trainer=gpt, BPE 4096, Muon)", LM_COLUMNS,
          LM_MODELS, lm_dirs, lm_geo)
    table("3. Self-supervised DINO on the digits, no labels (trainer=dino, ViT-S heads at width 96)",
          DINO_COLUMNS, DINO_MODELS, dino_dirs, dino_geo)
    print("(geometry at the final norm, on the validation split: within-image / within-window share of "
          "the token variance, NC1 of the class token or the CDNV of next-token classes, PCs for 99% of "
          "the token variance; bits per byte count the text's UTF-8 bytes; DINO's 20-NN classifies "
          "the validation digits by the teacher's class tokens of the training digits)")


if __name__ == "__main__":
    main(sys.argv[1:])
