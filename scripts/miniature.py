"""The miniature reproduction: every paradigm that has landed, at CPU size, with 3 seeds, then
the analyses, the paper's tables and figures, and a verdict for each claim of the paper.

    bash scripts/miniature.sh                       # ~25 min on 2 cores; runs/miniature, docs/miniature
    python scripts/miniature.py --seeds 0 --out /tmp/mini --docs /tmp/mini/docs   # one seed, a quick look

Paradigms (DINO joins when its trainer lands):
    deit3  ViT-Tiny (3 heads) cut to 4 blocks, built-in digits, 300 steps; k = 0, 1, 3 Laplacian
           heads, and k = 1 with learned gates (beyond the paper)
    gpt    nanochat GPT depth 4 (256 wide, 2 heads of 128), built-in help text (bytes), 300
           steps of 16 x 64 tokens; k = 0, 1, 2, and k = 1 learned
Both recipes let every block contribute from the start (the ViT's LayerScale starts at 1.0, not
DeiT-III's 1e-6, which at this length leaves the blocks near identities so that the geometry
would measure the patch embedding): the report's "stream change" shows how much each block
moves the residual stream.

Every run is the plain `python train.py ...` command printed before it runs (a finished run is
skipped, an interrupted one resumes), every checkpoint is measured by `python -m analysis`, and
`python -m analysis.tables` / `python -m analysis.figures` render the tables and figures.

Verdict rule, per claim, over the seeds: d = mean(all-Laplacian) - mean(baseline) and its
standard error se = sqrt(s0^2 / n0 + s1^2 / n1) (sample standard deviations); "agrees" if d
points the paper's way and |d| > 2 se, "disagrees" if it points the other way and |d| > 2 se,
else "within noise". With one seed there is no spread: the verdict is "one seed: <direction>".
Each geometry claim is judged at the layer the paper measured it at; PAPER.md names none, so
the claims table says "final norm (paper silent)" (`claim_layer`), and the same rule is applied
at every block beside it (the analyses measure layers=all).
"""
from __future__ import annotations

import argparse
import datetime
import math
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from analysis.gates import gate_groups, to_markdown  # noqa: E402
from analysis.runs import collect, metric_value  # noqa: E402

COMMON = ["trainer.num_workers=0", "trainer.progress=false", "trainer.log_every=25"]
RECIPES = {
    "deit3": dict(variants=[("vitt_0L", []), ("vitt_1L", []), ("vitt_3L", []),
                            ("vitt_1L", ["model.laplacian_mode=learned"])],
                  args=["model.depth=4", "model.init_values=1.0", "trainer.max_steps=300",
                        "trainer.global_batch_size=64", "trainer.eval_every=100", "trainer.ckpt_every=100",
                        "optim.lr=1e-3", "optim.schedules.lr.warmup=20"]),
    "gpt": dict(variants=[("gpt_d4_0L", []), ("gpt_d4_1L", []), ("gpt_d4_2L", []),
                          ("gpt_d4_1L", ["model.laplacian_mode=learned"])],
                args=["experiment=gpt_pydoc", "data.seq_len=64", "trainer.global_batch_size=16",
                      "trainer.max_steps=300", "trainer.eval_every=100", "trainer.ckpt_every=100"]),
}
# The paper's claims: (paradigm, what, metric of analysis.runs records, +1 if the paper says it
# grows with Laplacian heads, -1 if it shrinks).
CLAIMS = [
    ("deit3", "accuracy improves (val top-1)", "final.val_acc1", +1),
    ("deit3", "within-image variance share drops (patch tokens)", "geometry.within_seq_share", -1),
    ("deit3", "between-class variance share grows (patch tokens)", "geometry.between_class_share", +1),
    ("deit3", "neural collapse strengthens (NC1 of the class token falls)", "geometry.nc1", -1),
    ("deit3", "spectrum decays faster (PCs for 99% of patch variance fall)", "geometry.n_pcs_0.99", -1),
    ("gpt", "language modelling improves (val bits per byte fall)", "final.val_bpb", -1),
    ("gpt", "within-window variance share drops (shown for ViTs; asked of the LM too)", "geometry.within_seq_share", -1),
    ("gpt", "linguistic collapse strengthens (next-token CDNV falls)", "geometry.lc_cdnv_mean", -1),
    ("gpt", "spectrum decays faster (PCs for 99% of token variance fall)", "geometry.n_pcs_0.99", -1),
]
COLUMNS = {"deit3": [("val top-1", "final.val_acc1"), ("within-image share", "geometry.within_seq_share"),
                     ("between-class share", "geometry.between_class_share"), ("NC1 (cls)", "geometry.nc1"),
                     ("n_pcs_0.99", "geometry.n_pcs_0.99")],
           "gpt": [("val bpb", "final.val_bpb"), ("within-window share", "geometry.within_seq_share"),
                   ("next-token CDNV", "geometry.lc_cdnv_mean"), ("n_pcs_0.99", "geometry.n_pcs_0.99")]}


def sh(cmd: list[str], log) -> str:
    line = "$ " + " ".join(cmd[1:] if cmd[0] == sys.executable else cmd)
    print(line, flush=True)
    log.write(line + "\n")
    out = subprocess.run(cmd, cwd=ROOT, check=True, stdout=subprocess.PIPE, text=True).stdout
    log.write(out)
    return out


def label(name: str, extra: list[str]) -> str:
    return name + ("_learned" if "model.laplacian_mode=learned" in extra else "")


def train_all(out: Path, seeds, log, steps: int | None = None) -> dict[str, list[Path]]:
    """Train every (paradigm, variant, seed); {paradigm: run dirs}. `steps` shortens the
    recipes (a smoke test, not the miniature)."""
    runs: dict[str, list[Path]] = {}
    for paradigm, r in RECIPES.items():
        for name, extra in r["variants"]:
            for seed in seeds:
                run_dir = out / paradigm / f"{label(name, extra)}_s{seed}"
                runs.setdefault(paradigm, []).append(run_dir)
                if (run_dir / "results.json").exists():
                    continue  # finished earlier: this script is re-runnable
                short = [f"trainer.max_steps={steps}"] if steps else []
                sh([sys.executable, "train.py", f"model={name}", f"seed={seed}", *r["args"], *extra, *COMMON,
                    *short, f"run_dir={run_dir}"], log)
    return runs


def analyse_all(runs: dict[str, list[Path]], log):
    """One `python -m analysis` per paradigm over all its checkpoints (one process, shared axes)."""
    for paradigm, dirs in runs.items():
        todo = [d for d in dirs if not (d / "ckpt/last_analysis/analysis.json").exists()]
        if todo:
            ckpts = ",".join(str(d / "ckpt/last.pt") for d in todo)
            sh([sys.executable, "-m", "analysis", f"checkpoint=[{ckpts}]", "layers=all", "progress=false", "figures=false",
                f"analysis_out={dirs[0].parent / 'compare'}"], log)


def verdict(base: list[float], lap: list[float], sign: int) -> tuple[str, float, float]:
    """(verdict, d, se) by the rule of the module docstring."""
    d = statistics.mean(lap) - statistics.mean(base)
    if min(len(base), len(lap)) < 2:
        way = "no difference" if d == 0 else "paper's direction" if d * sign > 0 else "the other direction"
        return f"one seed: {way}", d, float("nan")
    se = math.sqrt(statistics.variance(base) / len(base) + statistics.variance(lap) / len(lap))
    if abs(d) > 2 * se:
        return ("agrees" if d * sign > 0 else "disagrees"), d, se
    return "within noise", d, se


def _values(recs: list[dict], k: int, mode: str, metric: str) -> list[float]:
    return [v for r in recs if r["k"] == k and r["mode"] == mode
            for v in [metric_value(r, metric)] if v is not None]


def _fmt(xs: list[float]) -> str:
    return f"{statistics.mean(xs):.4g}" + (f" ± {statistics.stdev(xs):.2g}" if len(xs) > 1 else "") if xs else ""


def claim_layer(metric: str) -> tuple[str | None, str]:
    """(layer, how the report names it) of a claim's metric. PAPER.md names no layer for any
    geometry claim, so each is read at the final norm (what the head reads) and says so;
    accuracy and bits per byte are the model's output, at no layer."""
    return ("norm", "final norm (paper silent)") if metric.startswith("geometry.") else (None, "model output")


def at_layer(metric: str, layer: str | None) -> str:
    """The records' key of a geometry metric at a layer ("geometry@blocks.2.nc1")."""
    return metric if layer is None else f"geometry@{layer}.{metric[len('geometry.'):]}"


def _arms(rs: list[dict], metric: str) -> tuple[list[float], list[float]]:
    """(baseline k = 0, every head Laplacian) values of a metric."""
    k_all = max((r["k"] for r in rs), default=0)
    return _values(rs, 0, "fixed", metric), _values(rs, k_all, "fixed", metric)


def claims_table(recs: dict[str, list[dict]]) -> list[str]:
    """One row per claim: baseline (k = 0) vs every head Laplacian at the claim's layer, the verdict."""
    lines = ["| paradigm | claim (baseline vs all heads Laplacian) | layer | baseline | all Laplacian | d | 2 se | verdict |",
             "|---|---|---|---|---|---|---|---|"]
    for paradigm, what, metric, sign in CLAIMS:
        layer, where = claim_layer(metric)
        base, lap = _arms(recs.get(paradigm, []), at_layer(metric, layer))
        if not base or not lap:
            lines.append(f"| {paradigm} | {what} | {where} | | | | | not measured |")
            continue
        v, d, se = verdict(base, lap, sign)
        lines.append(f"| {paradigm} | {what} | {where} | {_fmt(base)} | {_fmt(lap)} | {d:+.3g} | {2 * se:.2g} | **{v}** |")
    return lines


def block_claims_table(recs: dict[str, list[dict]]) -> list[str]:
    """The geometry claims' verdicts at every measured layer (where along the depth a
    difference appears), one table per paradigm: cells "d ± 2 se verdict"."""
    from analysis.runs import layer_order

    lines = []
    for paradigm, rs in recs.items():
        claims = [c for c in CLAIMS if c[0] == paradigm and claim_layer(c[2])[0] is not None]
        layers = layer_order(rs)
        if not claims or not layers:
            continue
        lines += [f"| {paradigm}: claim | " + " | ".join(layers) + " |", "|---|" + "---|" * len(layers)]
        for _, what, metric, sign in claims:
            cells = []
            for layer in layers:
                base, lap = _arms(rs, at_layer(metric, layer))
                if base and lap:
                    v, d, se = verdict(base, lap, sign)
                    cells.append(f"{d:+.3g}" + ("" if math.isnan(se) else f" ± {2 * se:.2g}") + f" {v}")
                else:
                    cells.append("")
            lines.append(f"| {what} | " + " | ".join(cells) + " |")
        lines.append("")
    return lines


def variants_table(recs: dict[str, list[dict]]) -> list[str]:
    lines = []
    for paradigm, rs in recs.items():
        cols = COLUMNS[paradigm]
        lines += [f"| {paradigm} | k | mode | seeds | " + " | ".join(c for c, _ in cols) + " |",
                  "|---|---|---|---|" + "---|" * len(cols)]
        for k, mode in sorted({(r["k"], r["mode"]) for r in rs}, key=lambda km: (km[1] != "fixed", km[0])):
            n = sum(r["k"] == k and r["mode"] == mode for r in rs)
            cells = [_fmt(_values(rs, k, mode, m)) for _, m in cols]
            lines.append(f"| {rs[0]['model'].rsplit('_', 1)[0]} | {k} | {mode} | {n} | " + " | ".join(cells) + " |")
        lines.append("")
    return lines


def stream_change(run_dirs: list[Path], n: int = 64) -> dict[str, list[float]]:
    """Per block, the mean over tokens of ||h_i - h_(i-1)|| / ||h_(i-1)|| on n validation
    sequences (h_(-1): the embedding that enters block 0), averaged over the given runs."""
    from analysis.geometry import eval_split
    from laplace.attention import rms_norm
    from laplace.checkpoint import load_checkpoint, model_from_checkpoint

    per_run = []
    for d in run_dirs:
        ckpt = load_checkpoint(d / "ckpt/last.pt")
        model = model_from_checkpoint(ckpt)
        ds, _ = eval_split(model, ckpt["config"]["data"], seed=0, max_tokens=None)
        x = torch.utils.data.default_collate([ds[i] for i in range(min(n, len(ds)))])[0]
        with torch.no_grad():
            h0 = model.embed(x) if hasattr(model, "embed") else rms_norm(model.wte(x))
            feats = model.forward_features(x, norm=False)
            hs = [h0] + [feats[f"blocks.{i}"] for i in range(len(model.blocks))]
        per_run.append([float(((b - a).norm(dim=-1) / a.norm(dim=-1)).mean()) for a, b in zip(hs, hs[1:])])
    return [statistics.mean(col) for col in zip(*per_run)]


def gates_section(recs: dict[str, list[dict]]) -> list[str]:
    """The report's learned gates: per paradigm, analysis.gates' table and summary (what
    `python -m analysis.tables` writes as gates_*.md)."""
    lines = ["", "## Learned gates (laplacian_mode=learned; a = 1: the head is fully Laplacian)", "",
             "Where training takes them, per block and head (tables/gates_*.md; figures/gates_*.png):", ""]
    return lines + [to_markdown(g) for rs in recs.values() for g in gate_groups(rs)]


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--out", default=str(ROOT / "runs/miniature"), help="runs root")
    p.add_argument("--docs", default=str(ROOT / "docs/miniature"), help="where tables, figures and the report go")
    p.add_argument("--pca-maps", type=int, default=4)
    p.add_argument("--steps", type=int, default=None, help="shorter runs (a smoke test of the script)")
    args = p.parse_args()
    out, docs = Path(args.out), Path(args.docs)
    docs.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    log = open(docs / "commands.log", "a")
    runs = train_all(out, args.seeds, log, args.steps)
    t_train = time.time() - t0
    analyse_all(runs, log)
    sh([sys.executable, "-m", "analysis.tables", f"runs={out}", f"out={docs / 'tables'}"], log)
    sh([sys.executable, "-m", "analysis.figures", f"runs={out}", f"out={docs / 'figures'}",
        f"pca_maps={args.pca_maps}"], log)

    recs = {pd: [r for r in collect([out / pd]) if r["finished"]] for pd in runs}
    report = [f"# Miniature reproduction ({datetime.date.today().isoformat()})", "",
              f"Command: `bash scripts/miniature.sh{' --seeds ' + ' '.join(map(str, args.seeds)) if args.seeds != [0, 1, 2] else ''}`"
              f" on {platform.machine()} ({os.cpu_count()} cores), torch {torch.__version__}; "
              f"{time.time() - t0:.0f} s in all ({t_train:.0f} s training). Recipes and the verdict rule: "
              f"scripts/miniature.py. The paper's tables: tables/; figures: figures/.", "",
              "## Claims", "", *claims_table(recs), "",
              "## Results by number of Laplacian heads (mean ± std over seeds)", "", *variants_table(recs),
              "## Geometry at every block", "",
              "The claims above at every layer (blocks.<i>: the residual stream after block i; norm: the final "
              "norm), baseline vs every head Laplacian, d ± 2 se and the verdict. Every arm's numbers: "
              "tables/per_block.md; figures: figures/blocks_<experiment>.png.", "", *block_claims_table(recs)]
    report += ["", "## How much the blocks change the residual stream", "",
               "Mean over tokens of ||h_i - h_(i-1)|| / ||h_(i-1)|| per block (h_(-1) = the embedding), "
               "64 validation sequences, averaged over seeds:", ""]
    for pd, dirs in runs.items():
        for lab in dict.fromkeys(d.name.rsplit("_s", 1)[0] for d in dirs):
            change = stream_change([d for d in dirs if d.name.rsplit("_s", 1)[0] == lab])
            report.append(f"- {pd} {lab}: " + ", ".join(f"{c:.3f}" for c in change))
    report += gates_section(recs)
    text = "\n".join(report) + "\n"
    (docs / "README.md").write_text(text)
    print("\n" + text)
    print(f"[miniature] wrote {docs / 'README.md'} in {time.time() - t0:.0f} s")


if __name__ == "__main__":
    main()
