"""The quick start: baseline vs Laplacian models of the paper's three paradigms on built-in data,
side by side, with the paper's token-geometry measurements of each.

    python scripts/quickstart.py                       # the full quick start (CPU, minutes)
    python scripts/quickstart.py trainer.max_steps=2   # Hydra overrides for every training run
    python scripts/quickstart.py vit.model.depth=2 lm.data.seq_len=64 dino.trainer.epochs=2   # one paradigm only
    python scripts/quickstart.py analysis.max_tokens=2000 analysis.pca_maps=8   # options of the analysis

1. Supervised ViT (DeiT-III trainer) on the built-in digits: vitt_0L vs vitt_3L (every head of
   ViT-Tiny Laplacian), `python train.py model=<name>`.
2. Language model on Python's built-in help text: `python prepare.py source=pydoc
   vocab_size=4096` (our BPE and token shards, seconds), then `python train.py experiment=gpt_tiny
   model=<name>` with Muon for gpt_d2_0L vs gpt_d2_1L (its one head Laplacian).
3. Self-supervised DINO (trainer=dino) on the digits without their labels: `python train.py
   experiment=dino_digits model=<name>` for vits_0L vs vits_5L (ViT-S's six heads at width 96,
   five of them Laplacian, as the paper's best DINO model), then DINO's weighted 20-NN
   classifier on the teacher's class tokens, `python -m eval.knn checkpoint=<run>/ckpt/last.pt`.

Each run is the plain command printed before it; running this again resumes (or, when finished,
re-reads) the same run directories, and it ends with each stage's wall and CPU time. Overrides:
`vit.` / `lm.` / `dino.` ones go to that paradigm's training runs, `analysis.` ones to the
analyses, `paths.*` to every command, the rest to every training run.
"""
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
VIT_MODELS = ("vitt_0L", "vitt_3L")  # ViT-Tiny has 3 heads: 3L = every head Laplacian
LM_MODELS = ("gpt_d2_0L", "gpt_d2_1L")  # a depth-2 GPT has one 128-wide head: 1L = all Laplacian
DINO_MODELS = ("vits_0L", "vits_5L")  # experiment=dino_digits: 6 heads of 16, 5 Laplacian


# (stage, wall s, CPU s) per command run, for the closing table: where a user's minutes go.
STAGES: list[tuple[str, float, float]] = []


def _run_side_by_side(jobs: list[tuple[list[str], str]]) -> list[str]:
    """Run the (command, stage) jobs at once and return their stdouts. Two or more get one torch
    thread each: on 2 cores a pair side by side with 1 thread each took less than half the CPU
    time of one after the other with torch's 2 threads (docs/LOG.md)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"} if len(jobs) > 1 else None
    running, ended = {}, {}
    for cmd, stage in jobs:
        print("$ python", " ".join(cmd[1:]), flush=True)
        out = tempfile.TemporaryFile("w+")  # a file, not a pipe: a chatty run cannot block
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=out, text=True, env=env)
        running[proc.pid] = (cmd, stage, out, time.perf_counter())
    while len(ended) < len(jobs):
        pid, status, ru = os.wait4(-1, 0)  # wait4: each child's own CPU time
        if pid in running:
            ended[pid] = (time.perf_counter(), ru.ru_utime + ru.ru_stime, os.waitstatus_to_exitcode(status))
    outs = []
    for pid, (cmd, stage, out, start) in running.items():  # in the jobs' order
        end, cpu, rc = ended[pid]
        STAGES.append((stage, end - start, cpu))
        out.seek(0)
        outs.append(out.read())
        print(outs[-1], end="")
        if rc != 0:
            raise subprocess.CalledProcessError(rc, cmd, output=outs[-1])
    return outs


def _minsec(s: float) -> str:
    return f"{int(s // 60)}:{s % 60:04.1f}"


def stage_table(elapsed: float) -> None:
    """Each stage's wall and CPU time, the install's (scripts/env.sh exports it) and the totals."""
    from bench.report import machine

    install, m = os.environ.get("LAPLACE_INSTALL_SECONDS"), machine("cpu")
    # Machines of one name differ (AVX-512 or AVX2 kernels, the VM's day): the times name both.
    print(f"\nStage times on {m['cpu']}, {m['cores']} cores, torch CPU kernels {m['cpu_capability']} "
          f"(wall m:s, CPU s = user + system of the stage's processes)")
    print("  (a pair's two trainings, and the analyses with the k-NN, run side by side, one thread each: "
          "their wall times overlap)")
    if install:
        print(f"  {'install (.venv; 0 when already there)':<40} {_minsec(float(install)):>8}")
    for stage, wall, cpu in STAGES:
        print(f"  {stage:<40} {_minsec(wall):>8} {cpu:>8.0f}")
    wall, cpu = elapsed, sum(c for _, _, c in STAGES)
    print(f"  {'total after the install':<40} {_minsec(wall):>8} {cpu:>8.0f}")
    if install:
        print(f"  {'total':<40} {_minsec(wall + float(install)):>8}")


def train(models: tuple[str, ...], overrides: list[str]) -> list[Path]:
    """`python train.py model=<model> ...` into <runs_dir>/quickstart/<model>, the models side by side."""
    outs = _run_side_by_side([([sys.executable, "train.py", f"model={m}", f"run_dir=${{paths.runs_dir}}/quickstart/{m}",
                                "trainer.progress=false", *overrides], f"train {m}") for m in models])
    # train.py's first line names the resolved run directory.
    lines = [next(ln for ln in out.splitlines() if ln.startswith("[laplace] run_dir=")) for out in outs]
    return [ROOT / ln.split("run_dir=", 1)[1].split()[0] for ln in lines]


def analysis_job(run_dirs: list[Path], overrides: list[str], out_dir: Path) -> tuple[list[str], str]:
    """`python -m analysis` on both checkpoints, as a (command, stage) job."""
    ckpts = [d / "ckpt" / "last.pt" for d in run_dirs]
    return ([sys.executable, "-m", "analysis", f"checkpoint=[{','.join(map(str, ckpts))}]",
             f"analysis_out={out_dir}", "progress=false", *overrides], f"analysis {out_dir.parent.name}")


def analysis_results(out: str) -> list[dict]:
    """The analysis.json contents an analysis job wrote: one "[analysis] wrote <dir>/analysis.json"
    line per checkpoint, in order."""
    wrote = [ln.split("wrote ", 1)[1] for ln in out.splitlines()
             if ln.startswith("[analysis] wrote ") and ln.endswith("analysis.json")]
    return [json.loads(Path(p).read_text()) for p in wrote]


def _geo(header: str, fmt: str, key: str):
    """A column of a headline geometry value at the final norm (analysis.runs.geometry; NaN if not measured)."""
    from analysis.runs import geometry

    return header, fmt, lambda r, g: geometry(g).get(key, float("nan"))


# (header, format, value of (results.json, analysis.json)) per column of a paradigm's table. The
# geometry is `python -m analysis` of both checkpoints at the final-norm layer, on the validation
# split: the within-sequence (image / window) share of the token variance, NC1 of the class token
# (ViT) or the next-token CDNV (LM), and the principal components for 99% of the token variance
# (the paper: Laplacian heads lower the share and the collapse measures, and spectra decay faster).
SHARE, NC1, PCS = (_geo("within-seq share", ".4f", "within_seq_share"), _geo("NC1 (cls)", ".3f", "nc1"),
                   _geo("n_pcs_0.99", ".0f", "n_pcs_0.99"))
VIT_COLUMNS = [("val top-1 (%)", ".2f", lambda r, g: r["final"]["val_acc1"]),
               ("best top-1 (%)", ".2f", lambda r, g: r["best"]["val_acc1"]), SHARE, NC1, PCS]
LM_COLUMNS = [("val bpb", ".4f", lambda r, g: r["final"]["val_bpb"]),
              ("val loss", ".4f", lambda r, g: r["final"]["val_loss"]),
              SHARE, _geo("next-tok CDNV", ".3f", "lc_cdnv_mean"), PCS]
# DINO's k-NN: eval.knn's results.json in the run's folder.
DINO_COLUMNS = [("20-NN top-1 (%)", ".2f", lambda r, g: json.loads(
                    (Path(r["run_dir"]) / "eval" / "knn_digits" / "results.json").read_text())["knn"]["top1"]),
                ("final loss", ".3f", lambda r, g: r["final"]["train_loss"]), SHARE, NC1, PCS]


def table(title: str, columns, models, run_dirs, geometries):
    print(f"\n{title}")
    header = " ".join(f"{h:>{len(h) + 1}}" for h, _, _ in columns)
    print(f"{'model':<10} {'Laplacian heads':>16} {header}  run dir")
    for model, run_dir, geo in zip(models, run_dirs, geometries):
        res = {**json.loads((run_dir / "results.json").read_text()), "run_dir": str(run_dir)}
        cells = " ".join(f"{fn(res, geo):>{len(h) + 1}{fmt}}" for h, fmt, fn in columns)
        print(f"{model:<10} {res['num_laplacian_heads']:>16} {cells}  {run_dir}")


def main(args: list[str]):
    # A prefix sends an override to one paradigm's training runs (vit., lm., dino.) or to the
    # analyses (analysis.); paths.* go to every command (one runs_dir / data_dir); the rest to
    # every training run. The BPE and shards are made once under paths.data_dir.
    common = [a for a in args if not a.startswith(("analysis.", "vit.", "lm.", "dino."))]
    paths = [a for a in args if a.startswith("paths.")]  # same runs_dir / data_dir everywhere
    only = lambda prefix: [a[len(prefix):] for a in args if a.startswith(prefix)]  # noqa: E731
    analysis_args = only("analysis.") + paths

    start = time.perf_counter()
    # the digits need no loader processes: workers only add processes to the 2 cores
    vit_dirs = train(VIT_MODELS, ["trainer.num_workers=0", *common, *only("vit.")])
    _run_side_by_side([([sys.executable, "prepare.py", "source=pydoc", "vocab_size=4096", "progress=false", *paths],
                        "prepare (BPE 4096, shards)")])
    lm_dirs = train(LM_MODELS, ["experiment=gpt_tiny", *common, *only("lm.")])
    dino_dirs = train(DINO_MODELS, ["experiment=dino_digits", *common, *only("dino.")])
    # The analyses and DINO's k-NN only read finished checkpoints: run side by side, they keep both
    # cores busy, where one analysis at a time (its figures single-threaded) left one half idle.
    outs = _run_side_by_side([
        analysis_job(vit_dirs, analysis_args, vit_dirs[0].parent / "vit" / "analysis"),
        analysis_job(lm_dirs, analysis_args, lm_dirs[0].parent / "lm" / "analysis"),
        # with DINOv2-style PCA maps of the patch tokens of 8 validation digits (pca_maps.png)
        analysis_job(dino_dirs, ["pca_maps=8", *analysis_args], dino_dirs[0].parent / "dino" / "analysis"),
        # `python -m eval.knn` on each DINO run's last checkpoint: <run>/eval/knn_digits/results.json
        *[([sys.executable, "-m", "eval.knn", f"checkpoint={d / 'ckpt' / 'last.pt'}", "num_workers=1", *paths],
           f"k-NN {d.name}") for d in dino_dirs]])
    vit_geo, lm_geo, dino_geo = map(analysis_results, outs[:3])

    table("1. Supervised ViT-Tiny on the built-in digits (trainer=deit3)", VIT_COLUMNS, VIT_MODELS, vit_dirs, vit_geo)
    table("2. GPT language model on the built-in help text (trainer=gpt, BPE 4096, Muon)", LM_COLUMNS,
          LM_MODELS, lm_dirs, lm_geo)
    table("3. Self-supervised DINO on the digits, no labels (trainer=dino, ViT-S heads at width 96)",
          DINO_COLUMNS, DINO_MODELS, dino_dirs, dino_geo)
    print("(geometry at the final norm, on the validation split: within-image / within-window share of "
          "the token variance, NC1 of the class token or the CDNV of next-token classes, PCs for 99% of "
          "the token variance; bits per byte count the text's UTF-8 bytes; DINO's 20-NN classifies "
          "the validation digits by the teacher's class tokens of the training digits)")
    stage_table(time.perf_counter() - start)


if __name__ == "__main__":
    main(sys.argv[1:])
