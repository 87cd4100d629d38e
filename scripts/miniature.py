"""The miniature reproduction: the three paradigms at CPU size, 0 / middle / all Laplacian
heads and learned gates, several seeds, then the analyses, the paper's tables and figures, the
learning curves and a verdict for each claim of the paper.

    bash scripts/miniature.sh                       # short: ~25 min on 2 cores; runs/miniature, docs/miniature
    bash scripts/miniature.sh --profile long        # long: ~2.5 h; runs/miniature_long, docs/miniature/long
    bash scripts/miniature.sh --profile study       # study: ~1.5 h; runs/miniature_study, docs/miniature/study
    python scripts/miniature.py --seeds 0 --out /tmp/mini --docs /tmp/mini/docs   # one seed, a quick look

The profiles, their recipes (one per paradigm, the same for every k) and why each setting:
scripts/miniature_runs.py. The short profile trains DeiT-III (ViT-Tiny cut to 4 blocks, digits)
and a GPT (depth 4, help text in bytes) for 300 steps, 3 seeds; the long one adds DINO on digits
and trains longer, 5 seeds: DeiT-III and DINO until their validation metric flattens, the GPT
(BPE'd standard library) as long as the 2-hour budget allowed, until its bits per byte fall
slowly (learning curves: scripts/miniature_curves.py). Both let every ViT block contribute from
the start (LayerScale 1.0, not DeiT-III's 1e-6, which at this length leaves the blocks near
identities so that the geometry would measure the patch embedding): the report's "stream
change" shows how much each block moves the residual stream.

Every run is the plain `python train.py ...` command printed before it runs (a finished run is
skipped, an interrupted one resumes), every checkpoint is measured by `python -m analysis`, and
`python -m analysis.tables` / `python -m analysis.figures` render the tables and figures.

What each claim is measured as (the paper's objects, other readings beside them), on which
arm, at which layers, and the test (paired t over seeds, Holm's correction, the smallest
detectable effect): scripts/miniature_claims.py. The study profile (~1.5 h) is the one whose
report decides the claims; short and long keep their recipes and use the same rules.
"""
from __future__ import annotations

import argparse
import datetime
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from analysis.gates import gate_groups, to_markdown  # noqa: E402
from analysis.runs import collect  # noqa: E402
from miniature_claims import (base_paradigm, block_table, by_seed, changes_table, claim_rows, claims_table, fmt,  # noqa: E402
                              mechanism_section)
from miniature_curves import curves, curves_markdown, plot_curves  # noqa: E402
from miniature_runs import PROFILES, analyse_all, run_jobs, sh  # noqa: E402
from laplace.zoo import features  # noqa: E402

_VIT_COLS = [("within-image share", "geometry.within_seq_share"), ("between-class share", "geometry.between_class_share"),
             ("within var", "geometry.within_seq_var"), ("between-class var", "geometry.between_class_var"),
             ("NC1 (image means)", "geometry.patch_nc1"), ("NC1 (cls)", "geometry.nc1"),
             ("PCs 99% per image", "geometry.per_seq_n_pcs_0.99"), ("PCs 99% pooled within", "geometry.within_n_pcs_0.99"),
             ("PCs 99% global", "geometry.n_pcs_0.99")]
COLUMNS = {"deit3": [("val top-1", "final.val_acc1"), *_VIT_COLS],
           "gpt": [("val bpb", "final.val_bpb"), ("within-window share", "geometry.within_seq_share"),
                   ("next-token CDNV", "geometry.lc_cdnv_mean"), ("PCs 99% per window", "geometry.per_seq_n_pcs_0.99"),
                   ("PCs 99% pooled within", "geometry.within_n_pcs_0.99"), ("PCs 99% global", "geometry.n_pcs_0.99")],
           "dino": [("20-NN top-1", "knn.top1"), ("linear top-1", "linear.top1"), *_VIT_COLS]}
# What each profile can and cannot show, the report's first lines.
SCOPE = {
    "short": "A smoke-sized look: 300 steps, 3 seeds, DeiT-III and GPT only; the runs are far from "
             "converged, so most verdicts are within noise by construction.",
    "long": "What this can show: at CPU size (ViTs of 4 blocks on 1,437 8x8 digits, a 2.9 M-parameter GPT on "
            "6.9 M tokens of Python's standard library), with 5 seeds per arm, whether Laplacian heads move "
            "accuracy and token geometry the paper's way by more than seed-to-seed noise, where along the depth, "
            "and where learned gates go. Read the learning curves first: a verdict on a run that has not "
            "flattened is a verdict on an undertrained model. The GPT's 500 steps were what the 2-hour budget "
            "allowed: its bits per byte still fall, slowly by the end of the constant learning rate, then "
            "faster through the warm-down of the last 20% (the anneal, nanochat's schedule), which is all of its "
            "last quarter; the quarter before says how fast it still learns. What it cannot show: anything "
            "about the paper's scale (ViT-B on ImageNet, a 561 M GPT, ADE20K), its downstream LM tasks, or "
            "effects smaller than the spread of 5 seeds; digits and stdlib code are not natural images and prose.",
    "study": "What this decides: each of the paper's claims on the paper's own object (NC1 of sequence means, "
             "per-sequence spectra, ANOVA shares; other readings beside), the baseline against the arm nearest "
             "the paper's, by a paired t over the seeds with Holm's correction, in a regime moved towards the "
             "authors': ViTs of 4 blocks with 64 patch tokens per 8x8 digit and QK-norm, with a class-token and a "
             "mean-pooled head; DINO with 5 of 6 heads Laplacian (16 tokens, as the long profile); the GPT k = 0 "
             "vs 1 of 2 at the long profile's 500 steps. Read the learning curves and the smallest detectable "
             "effects first: \"within noise\" rules out only effects above them. What it cannot show: the paper's "
             "scale (ViT-B on ImageNet, a 561 M GPT, ADE20K), its LM tasks, or smaller effects; digits and stdlib "
             "code are not natural images and prose.",
}


def variants_table(recs: dict[str, list[dict]]) -> list[str]:
    lines = []
    for paradigm, rs in recs.items():
        cols = COLUMNS[base_paradigm(paradigm)]
        lines += [f"| {paradigm} | k | mode | seeds | " + " | ".join(c for c, _ in cols) + " |",
                  "|---|---|---|---|" + "---|" * len(cols)]
        for k, mode in sorted({(r["k"], r["mode"]) for r in rs}, key=lambda km: (km[1] != "fixed", km[0])):
            n = sum(r["k"] == k and r["mode"] == mode for r in rs)
            cells = [fmt(by_seed(rs, k, m, mode).values()) for _, m in cols]
            lines.append(f"| {rs[0]['model'].rsplit('_', 1)[0]} | {k} | {mode} | {n} | " + " | ".join(cells) + " |")
        lines.append("")
    return lines


def stream_change(run_dirs: list[Path], n: int = 64) -> dict[str, list[float]]:
    """Per block, the mean over tokens of ||h_i - h_(i-1)|| / ||h_(i-1)|| on n validation
    sequences (h_(-1): the embedding that enters block 0), averaged over the given runs."""
    from analysis.geometry import eval_split
    from laplace.gpt import rms_norm
    from laplace.checkpoint import load_checkpoint, model_from_checkpoint

    per_run = []
    for d in run_dirs:
        ckpt = load_checkpoint(d / "ckpt/last.pt")
        model = model_from_checkpoint(ckpt)
        ds, _ = eval_split(model, ckpt["config"]["data"], seed=0, max_tokens=None)
        x = torch.utils.data.default_collate([ds[i] for i in range(min(n, len(ds)))])[0]
        with torch.no_grad():
            h0 = model._pos_embed(model.patch_embed(x)) if hasattr(model, "patch_embed") else rms_norm(model.wte(x))
            feats = features(model, x, norm=False)
            hs = [h0] + [feats[f"blocks.{i}"] for i in range(len(model.blocks))]
        per_run.append([float(((b - a).norm(dim=-1) / a.norm(dim=-1)).mean()) for a, b in zip(hs, hs[1:])])
    return [statistics.mean(col) for col in zip(*per_run)]


def mechanism_figures(recs: dict[str, list[dict]], out: Path) -> list[str]:
    """analysis.mechanism's per-head heatmaps of each arm's first seed, into out/mechanism_<paradigm>_<arm>.png;
    the report's line naming them ("" when no analysis measured the mechanism)."""
    import json

    from analysis.mechanism import draw_mechanism

    names = []
    for paradigm, rs in recs.items():
        for r in sorted(rs, key=lambda r: (str(r["k"]), r["mode"], str(r["seed"]))):
            name = f"mechanism_{paradigm}_{Path(r['run_dir']).name.rsplit('_s', 1)[0]}"
            if r.get("analysis") and name not in names:
                res = json.loads(Path(r["analysis"]).read_text())
                if res.get("mechanism"):
                    draw_mechanism({**res["mechanism"], "model": f"{paradigm} {res['model']}, seed {r['seed']}"},
                                   out / name)
                    names.append(name)
    return [f"Per head (layer x head, seed {min(r['seed'] for rs in recs.values() for r in rs)} of each arm): "
            + ", ".join(f"figures/{n}.png" for n in names) + ".", ""] if names else []


def gates_section(recs: dict[str, list[dict]]) -> list[str]:
    """The report's learned gates: per paradigm, analysis.gates' table and summary (what
    `python -m analysis.tables` writes as gates_*.md)."""
    if not any(r["mode"] == "learned" for rs in recs.values() for r in rs):
        return []
    lines = ["", "## Learned gates (laplacian_mode=learned; a = 1: the head is fully Laplacian)", "",
             "Where training takes them, per block and head (tables/gates_*.md; figures/gates_*.png):", ""]
    return lines + [to_markdown(g) for rs in recs.values() for g in gate_groups(rs)]


def wall_time(out: Path) -> str:
    """The profile's wall time from the runner's timings, or "" when no run was timed: the time
    during which at least one command ran (the union of their intervals, so that a paradigm
    re-run on another day adds its own time, not the days between) and the commands' summed
    times, in all and per paradigm."""
    import json

    path = out / "timings.jsonl"
    if not path.exists():
        return ""
    ts = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    if not ts:
        return ""
    wall, reach = 0.0, float("-inf")
    for start, end in sorted((t["start"], t["end"]) for t in ts):
        wall += max(0.0, end - max(start, reach))
        reach = max(reach, end)
    busy: dict[str, float] = {}
    for t in ts:
        paradigm = t["run"].split("/")[0]
        busy[paradigm] = busy.get(paradigm, 0.0) + t["end"] - t["start"]
    per = ", ".join(f"{p} {b / 60:.0f}" for p, b in busy.items())
    return (f"Runs (training and their evaluations) took {wall / 60:.0f} min of wall time (while at least one "
            f"ran), {sum(busy.values()) / 60:.0f} min summed over {len(ts)} commands ({per}; out/timings.jsonl; "
            f"a resumed run counts its last stretch only). ")


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--profile", choices=sorted(PROFILES), default="short",
                   help="short (~25 min), long (~2.5 h) or study (~1.5 h)")
    p.add_argument("--seeds", type=int, nargs="+", default=None, help="default: the profile's (short 0-2, long 0-4, study 0-3)")
    p.add_argument("--jobs", type=int, default=None, help="runs at a time (default: the profile's; short 1, long and study 2)")
    p.add_argument("--out", default=None, help="runs root (default: the profile's, runs/miniature[_long|_study])")
    p.add_argument("--docs", default=None, help="where tables, figures and the report go (default: the profile's)")
    p.add_argument("--pca-maps", type=int, default=4)
    p.add_argument("--steps", type=int, default=None, help="shorter runs (a smoke test of the script)")
    p.add_argument("--only", nargs="+", default=None, metavar="PARADIGM",
                   help="train only these paradigms of the profile (the report still reads all of its runs)")
    p.add_argument("--train-only", action="store_true",
                   help="train and evaluate the runs, then stop (analyse and report in a later call)")
    args = p.parse_args()
    prof = PROFILES[args.profile]
    unknown = sorted(set(args.only or []) - set(prof["recipes"]))
    if unknown:
        p.error(f"--only {unknown[0]}: the {args.profile} profile trains {', '.join(prof['recipes'])}")
    seeds = args.seeds if args.seeds is not None else prof["seeds"]
    out, docs = Path(args.out or ROOT / prof["out"]), Path(args.docs or ROOT / prof["docs"])
    docs.mkdir(parents=True, exist_ok=True)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    log = open(docs / "commands.log", "a")
    for cmd in prof["prepare"]:
        sh([sys.executable, *cmd], log)
    train = {pd: r for pd, r in prof["recipes"].items() if args.only is None or pd in args.only}
    run_jobs(train, out, seeds, log, args.jobs or prof["jobs"], args.steps)
    runs = run_jobs(prof["recipes"], out, seeds, log, steps=args.steps, dry=True)
    t_train = time.time() - t0
    if args.train_only:
        print(f"[miniature] trained {sum(map(len, runs.values()))} runs in {t_train:.0f} s (--train-only)")
        return
    analyse_all(runs, log, prof["recipes"])
    # The tables, figures and verdicts read exactly this invocation's runs (not others under --out).
    listed = "runs=[" + ",".join(str(d) for dirs in runs.values() for d in dirs) + "]"
    sh([sys.executable, "-m", "analysis.tables", listed, f"out={docs / 'tables'}"], log)
    sh([sys.executable, "-m", "analysis.figures", listed, f"out={docs / 'figures'}", f"pca_maps={args.pca_maps}"], log)
    metrics = {pd: r["curve"] for pd, r in prof["recipes"].items() if "curve" in r}
    curve_data = curves(runs, metrics, out / "curves")
    plot_curves(curve_data, metrics, docs / "figures" / "curves")
    (docs / "tables").mkdir(parents=True, exist_ok=True)
    (docs / "tables" / "curves.md").write_text("\n".join(curves_markdown(curve_data, metrics)) + "\n")

    recs = {pd: [r for r in collect(dirs) if r["finished"]] for pd, dirs in runs.items()}
    recs = {pd: rs for pd, rs in recs.items() if rs}
    paper, other = claim_rows(recs, "paper"), claim_rows(recs, "other")
    flags = (f" --profile {args.profile}" if args.profile != "short" else "") + \
        (" --seeds " + " ".join(map(str, seeds)) if seeds != prof["seeds"] else "") + \
        (f" --steps {args.steps}" if args.steps else "")
    report = [f"# Miniature reproduction, {args.profile} profile ({datetime.date.today().isoformat()})", "",
              SCOPE[args.profile], "",
              f"Command: `bash scripts/miniature.sh{flags}` on {platform.machine()} ({os.cpu_count()} cores), "
              f"torch {torch.__version__}. {wall_time(out)}This invocation: {time.time() - t0:.0f} s "
              f"({t_train:.0f} s training, finished runs skipped). Recipes and why: scripts/miniature_runs.py; "
              f"the claims and their test: scripts/miniature_claims.py. The paper's tables: tables/; figures: figures/.", "",
              "## Claims", "",
              "Each row: the baseline (k = 0) against the arm nearest the paper's (k of the heads), over the seeds "
              "both have, a paired t on the per-seed differences; p two-sided; Holm's adjusted p over the table's "
              "rows; the smallest detectable effect at 80% power and 5%; verdict at p < 0.05, raw and after Holm. "
              "Definitions, arms, layers and the test: scripts/miniature_claims.py.", "",
              "### On the paper's objects (these decide the claims)", "", *claims_table(paper), "",
              "### Other readings of the same claims (their own Holm family)", "", *claims_table(other), "",
              "### What the definitions and the test change, on these runs", "", *changes_table(paper, other), "",
              *mechanism_section(recs), *mechanism_figures(recs, docs / "figures"),
              "## Learning curves", "",
              "Each arm's validation metric against the step, mean ± 2 se over seeds (n); figures/curves.png.",
              "", *curves_markdown(curve_data, metrics),
              "## Results by number of Laplacian heads (mean ± std over seeds)", "", *variants_table(recs),
              "## Geometry at every block (descriptive)", "",
              "Each claim's definition at every layer (blocks.<i>: the residual stream after block i; norm: the "
              "final norm), the claim's arm minus the baseline, d ± 2 se of the paired per-seed differences: where "
              "along the depth a difference appears, not further tests. Every arm's numbers: tables/per_block.md; "
              "figures: figures/blocks_<experiment>.png.", "", *block_table(recs)]
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
