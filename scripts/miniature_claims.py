"""The miniature's claims: what each of the paper's claims is measured as, where, on which arm, and
how it is decided (scripts/miniature.py writes the report with these tables).

Objects. Each claim names its definition. The paper's object is the row the claim is decided on
(family "paper"); other readings of the same words are kept beside it (family "other"), tested
the same way and corrected within their own family:
  - neural collapse: NC1 of the sequence means (the image means of the patch tokens; the paper's
    "sequence means form a simplex ETF aligned with the classifier"); the class token's NC1 beside;
  - spectra: per sequence (the tokens of one image / window centred on their mean), the PCs for
    99% of its variance, averaged over sequences (the paper's "tokens of one image concentrate";
    its 547.7 PCs is not an integer, so, our reading, an average over sequences); beside it the
    pooled within-sequence spectrum (one covariance, each sequence's mean removed) and the
    global one (one covariance of all tokens);
  - ANOVA: within-sequence and between-class shares of the variance; the raw (per-token) parts
    beside.

Arms. A claim compares the baseline (k = 0) with the arm nearest the paper's: every head
Laplacian for the supervised ViT (ViT-B-12L) and the LM's spectrum, 5 of 10 heads for the LM's
accuracy, 5 of 6 for DINO (ViT-S-5L); the row names the k it used.

Layers. PAPER.md names no layer. A geometry claim is judged at the final norm and, where the loss
does not reach it, also at the deepest layer the loss reaches: a class-token head reads
norm(x)[:, 0] only, so the last block's patch-token outputs get no gradient; the deepest patch
tokens the loss reaches are the last block's input, blocks.<depth - 2>. A mean-pooled head
(model.global_pool=avg) and the GPT (every position is predicted) reach the final norm.

Test. The seeds pair the arms (same data order, same initial weights: Laplacian heads add no
parameter), so each row is a paired t over the per-seed differences (analysis.stats): d, t with
its degrees of freedom, the two-sided p, Holm's adjusted p over the row's family, and the
smallest effect the design could detect (80% power at 5%). Verdict: "agrees" / "disagrees" when
p < 0.05 in the paper's direction / the other, else "within noise"; given raw and after Holm.
The per-block tables are descriptive (d ± 2 se of the paired differences), not more tests.
"""
from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from pathlib import Path

from analysis.runs import layer_order, metric_value
from analysis.stats import holm, paired, verdict


@dataclass(frozen=True)
class Claim:
    paradigm: str     # deit3 (also its variants: deit3_avg), gpt, dino
    what: str         # the claim in the paper's words
    metric: str       # an analysis.runs metric key
    sign: int         # +1: the paper says it grows with Laplacian heads; -1: it falls
    definition: str   # what the metric is
    arm: float        # the paper's fraction of Laplacian heads for this claim
    family: str = "paper"  # "paper": the paper's object, decides the claim; "other": another reading

    @property
    def geometry(self) -> bool:
        return self.metric.startswith("geometry.")


ALL, DINO_BEST, LM_BEST = 1.0, 5 / 6, 5 / 10
_PATCH, _WIN = "patch tokens", "tokens of a window"
CLAIMS = [
    Claim("deit3", "accuracy improves", "final.val_acc1", +1, "val top-1", ALL),
    Claim("deit3", "within-image variance drops", "geometry.within_seq_share", -1,
          f"ANOVA, {_PATCH}: within-image share of the variance", ALL),
    Claim("deit3", "between-class variance grows", "geometry.between_class_share", +1,
          f"ANOVA, {_PATCH}: between-class share", ALL),
    Claim("deit3", "neural collapse strengthens (NC1 falls)", "geometry.patch_nc1", -1,
          "NC1 of the image means of the patch tokens (sequence means)", ALL),
    Claim("deit3", "spectrum decays faster (PCs for 99% fall)", "geometry.per_seq_n_pcs_0.99", -1,
          "per image: PCs for 99% of its patch tokens' variance, mean over images", ALL),
    Claim("deit3", "within-image variance drops", "geometry.within_seq_var", -1,
          f"ANOVA, {_PATCH}: within-image variance (raw, per token)", ALL, "other"),
    Claim("deit3", "between-class variance grows", "geometry.between_class_var", +1,
          f"ANOVA, {_PATCH}: between-class variance (raw, per token)", ALL, "other"),
    Claim("deit3", "neural collapse strengthens (NC1 falls)", "geometry.nc1", -1,
          "NC1 of the class token", ALL, "other"),
    Claim("deit3", "spectrum decays faster (PCs for 99% fall)", "geometry.within_n_pcs_0.99", -1,
          f"{_PATCH} less their image's mean, pooled: PCs for 99%", ALL, "other"),
    Claim("deit3", "spectrum decays faster (PCs for 99% fall)", "geometry.n_pcs_0.99", -1,
          f"all {_PATCH}, one covariance: PCs for 99%", ALL, "other"),
    Claim("gpt", "language modelling improves", "final.val_bpb", -1, "val bits per byte (falls)", LM_BEST),
    Claim("gpt", "linguistic collapse strengthens (CDNV falls)", "geometry.lc_cdnv_mean", -1,
          "mean CDNV of next-token classes", ALL),
    Claim("gpt", "spectrum decays faster (PCs for 99% fall)", "geometry.per_seq_n_pcs_0.99", -1,
          "per window: PCs for 99% of its tokens' variance, mean over windows", ALL),
    Claim("gpt", "spectrum decays faster (PCs for 99% fall)", "geometry.n_pcs_0.99", -1,
          "all tokens, one covariance: PCs for 99%", ALL, "other"),
    Claim("gpt", "spectrum decays faster (PCs for 99% fall)", "geometry.within_n_pcs_0.99", -1,
          f"{_WIN} less its mean, pooled: PCs for 99%", ALL, "other"),
    Claim("gpt", "within-window variance drops (shown for ViTs, asked of the LM)", "geometry.within_seq_share", -1,
          "ANOVA: within-window share of the variance", ALL, "other"),
    Claim("dino", "accuracy improves (20-NN)", "knn.top1", +1, "20-NN top-1 of the teacher", DINO_BEST),
    Claim("dino", "accuracy improves (linear probe)", "linear.top1", +1, "linear probe top-1", DINO_BEST),
    Claim("dino", "spectrum decays faster (PCs for 99% fall)", "geometry.per_seq_n_pcs_0.99", -1,
          "per image: PCs for 99% of its patch tokens' variance, mean over images", DINO_BEST),
    Claim("dino", "spectrum decays faster (PCs for 99% fall)", "geometry.n_pcs_0.99", -1,
          f"all {_PATCH}, one covariance: PCs for 99%", DINO_BEST, "other"),
    Claim("dino", "spectrum decays faster (PCs for 99% fall)", "geometry.within_n_pcs_0.99", -1,
          f"{_PATCH} less their image's mean, pooled: PCs for 99%", DINO_BEST, "other"),
    Claim("dino", "within-image variance drops (shown supervised, asked of DINO)", "geometry.within_seq_share", -1,
          f"ANOVA, {_PATCH}: within-image share", DINO_BEST, "other"),
]
# The class token's own metrics (the loss reaches the class token at the final norm).
_CLS_KEYS = ("nc1", "nc2", "nc3", "nc4", "cdnv_mean")


def base_paradigm(paradigm: str) -> str:
    """The claims' paradigm of a profile's recipe: "deit3_avg" -> "deit3"."""
    return paradigm.split("_")[0]


def claims_of(paradigm: str, family: str | None = None) -> list[Claim]:
    return [c for c in CLAIMS if c.paradigm == base_paradigm(paradigm) and family in (None, c.family)]


def num_heads(model: str) -> int:
    """Heads per layer of a zoo name (the profiles' models keep the zoo's head count)."""
    from laplace.gpt import gpt_dims
    from laplace.zoo import model_defaults

    d = model_defaults(model)
    return d["num_heads"] if d["arch"] == "vit" else gpt_dims(d["depth"])[1]


def claim_arm(rs: list[dict], fraction: float) -> int | None:
    """The trained fixed k nearest fraction x heads (ties: the larger), None if only k = 0."""
    ks = sorted({r["k"] for r in rs if r["mode"] == "fixed" and isinstance(r["k"], int) and r["k"] > 0})
    if not ks:
        return None
    want = fraction * num_heads(rs[0]["model"])
    return min(ks, key=lambda k: (abs(k - want), -k))


def _global_pool(rs: list[dict]) -> str:
    from omegaconf import OmegaConf

    cfg = Path(rs[0]["run_dir"]) / "config.yaml"
    model = OmegaConf.load(cfg).get("model", {}) if cfg.exists() else {}
    return model.get("global_pool", "token")


def claim_layers(rs: list[dict], claim: Claim) -> list[tuple[str | None, str]]:
    """[(layer, how the report names it)] a claim is judged at (see the module docstring)."""
    if not claim.geometry:
        return [(None, "model output")]
    out = [("norm", "final norm")]
    key = claim.metric[len("geometry."):]
    blocks = [n for n in layer_order(rs) if n != "norm"]
    vit = rs[0].get("arch") == "vit"
    if vit and key not in _CLS_KEYS and _global_pool(rs) == "token" and len(blocks) >= 2:
        out.append((blocks[-2], f"{blocks[-2]} (deepest the loss reaches)"))
    return out


def at_layer(metric: str, layer: str | None) -> str:
    """The records' key of a geometry metric at a layer ("geometry@blocks.2.nc1")."""
    return metric if layer is None else f"geometry@{layer}.{metric[len('geometry.'):]}"


def by_seed(rs: list[dict], k, metric: str, mode: str = "fixed") -> dict:
    """{seed: value} of one arm."""
    return {r["seed"]: v for r in rs if r["k"] == k and r["mode"] == mode
            for v in [metric_value(r, metric)] if v is not None}


def fmt(xs) -> str:
    xs = list(xs)
    return f"{statistics.mean(xs):.4g}" + (f" ± {statistics.stdev(xs):.2g}" if len(xs) > 1 else "") if xs else ""


def _g(x: float, spec: str = ".3g") -> str:
    return "" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)


def _p(p: float) -> str:
    return "" if math.isnan(p) else f"{p:.2g}" if p >= 1e-4 else "<1e-4"


def claim_rows(recs: dict[str, list[dict]], family: str = "paper") -> list[dict]:
    """Every (claim, layer) of a family over the trained paradigms, tested and Holm-corrected
    together: dicts with paradigm, claim, layer, where, k, base, arm (values), test (Paired),
    verdict, holm_p, holm_verdict; a row without both arms has test None."""
    rows = []
    for paradigm, rs in recs.items():
        for c in claims_of(paradigm, family):
            k = claim_arm(rs, c.arm)
            for layer, where in claim_layers(rs, c):
                key = at_layer(c.metric, layer)
                base, arm = by_seed(rs, 0, key), (by_seed(rs, k, key) if k is not None else {})
                test = paired(base, arm) if set(base) & set(arm) else None
                rows.append(dict(paradigm=paradigm, claim=c, layer=layer, where=where, k=k,
                                 heads=num_heads(rs[0]["model"]), base=base, arm=arm, test=test))
    adjusted = holm([r["test"].p if r["test"] else float("nan") for r in rows])
    for r, hp in zip(rows, adjusted):
        t = r["test"]
        r["verdict"] = verdict(t.d, t.p, r["claim"].sign) if t else "not measured"
        r["holm_p"] = hp
        r["holm_verdict"] = verdict(t.d, hp, r["claim"].sign) if t else "not measured"
    return rows


def claims_table(rows: list[dict]) -> list[str]:
    """The claims' markdown table from `claim_rows`."""
    lines = ["| paradigm | claim | definition | layer | k | baseline | arm | d | t (df) | p | Holm p | "
             "smallest detectable | verdict | after Holm |", "|---" * 14 + "|"]
    for r in rows:
        c, t = r["claim"], r["test"]
        arm = "" if r["k"] is None else f"{r['k']} of {r['heads']}"
        if t is None:
            lines.append(f"| {r['paradigm']} | {c.what} | {c.definition} | {r['where']} | {arm} | "
                         f"{fmt(r['base'].values())} | {fmt(r['arm'].values())} | | | | | | not measured | |")
            continue
        tdf = "" if math.isnan(t.t) else f"{t.t:+.2f} ({t.df})"
        lines.append(f"| {r['paradigm']} | {c.what} | {c.definition} | {r['where']} | {arm} | "
                     f"{fmt(r['base'].values())} | {fmt(r['arm'].values())} | {t.d:+.3g} | {tdf} | {_p(t.p)} | "
                     f"{_p(r['holm_p'])} | {_g(t.mde)} | **{r['verdict']}** | **{r['holm_verdict']}** |")
    return lines


def old_rule(base: dict, arm: dict, sign: int) -> str:
    """The earlier reports' rule (unpaired): |d| > 2 sqrt(s0^2/n0 + s1^2/n1) in a direction."""
    b, a = list(base.values()), list(arm.values())
    if min(len(a), len(b)) < 2:
        return "one seed"
    d = statistics.mean(a) - statistics.mean(b)
    se = math.sqrt(statistics.variance(b) / len(b) + statistics.variance(a) / len(a))
    return ("agrees" if d * sign > 0 else "disagrees") if abs(d) > 2 * se else "within noise"


def changes_table(paper: list[dict], other: list[dict]) -> list[str]:
    """What the definitions and the test change, on these runs: per claim of the paper's object,
    the earlier reports' reading (class-token NC1, global spectrum, final norm, the unpaired 2 se
    rule) beside the paired test on the paper's object, raw and after Holm."""
    earlier = {"geometry.patch_nc1": "geometry.nc1", "geometry.per_seq_n_pcs_0.99": "geometry.n_pcs_0.99"}
    lines = ["| paradigm | claim | earlier reading (definition, final norm, unpaired 2 se) | same runs, this "
             "definition, unpaired 2 se | paired t | after Holm |", "|---|---|---|---|---|---|"]
    seen = set()
    for r in paper:
        c = r["claim"]
        if r["test"] is None or (r["paradigm"], c.metric) in seen:
            continue
        seen.add((r["paradigm"], c.metric))
        old_metric = earlier.get(c.metric, c.metric)
        old = next((o for o in other + paper if o["paradigm"] == r["paradigm"] and o["claim"].metric == old_metric
                    and o["layer"] == (None if not c.geometry else "norm")), None)
        here = next(o for o in paper if o["paradigm"] == r["paradigm"] and o["claim"].metric == c.metric
                    and o["layer"] == r["layer"])
        old_text = (f"{old_rule(old['base'], old['arm'], c.sign)} ({old['claim'].definition})"
                    if old and old["test"] else "")
        lines.append(f"| {r['paradigm']} | {c.what} | {old_text} | {old_rule(here['base'], here['arm'], c.sign)} | "
                     f"{here['verdict']} | {here['holm_verdict']} |")
    return lines


def block_table(recs: dict[str, list[dict]]) -> list[str]:
    """Descriptive: every geometry claim (both families) at every measured layer, the claim's arm
    minus the baseline, d ± 2 se of the paired differences (not tests: no verdicts)."""
    lines = []
    for paradigm, rs in recs.items():
        layers = layer_order(rs)
        claims = [c for c in claims_of(paradigm) if c.geometry]
        if not claims or not layers:
            continue
        lines += [f"| {paradigm}: definition (arm k) | " + " | ".join(layers) + " |", "|---|" + "---|" * len(layers)]
        for c in claims:
            k = claim_arm(rs, c.arm)
            cells = []
            for layer in layers:
                key = at_layer(c.metric, layer)
                base, arm = by_seed(rs, 0, key), (by_seed(rs, k, key) if k is not None else {})
                if not set(base) & set(arm):
                    cells.append("")
                    continue
                t = paired(base, arm)
                cells.append(f"{t.d:+.3g}" + ("" if math.isnan(t.se) else f" ± {2 * t.se:.2g}"))
            lines.append(f"| {c.definition} (k={k}) | " + " | ".join(cells) + " |")
        lines.append("")
    return lines


# The per-head mechanism (analysis/mechanism.py), pooled by head type over layers and seeds.
MECHANISM = (("cos_smooth", "cos(out, PX - X)"), ("dvar", "within-seq var change"), ("neg_mass", "neg. eigen-mass of sym(W_v W_o)"))


def mechanism_section(recs: dict[str, list[dict]]) -> list[str]:
    """Whether the heads smooth: per paradigm and arm, per layer, the mean over the heads of a type
    (softmax / Laplacian) of the cosine between a head's output and -(X - P X), the relative change
    of within-sequence variance its output alone makes, and the negative eigen-mass of the
    symmetric part of its W_v W_o; mean ± std over seeds."""
    lines = ["## Do the heads smooth? (the mechanism, per head: analysis/mechanism.py)", "",
             "A head smooths when its output points along -(X - P X) (cosine > 0) and adding it lowers the "
             "within-sequence variance (change < 0); a Laplacian head outputs (I - P) X W_v W_o, which smooths "
             "when the symmetric part of W_v W_o is negative (negative eigen-mass near 1). X: the attention's "
             "input (the normed stream). Mean over the heads of each type in a layer (all: every layer), "
             "mean ± std over seeds. Per head: each run's ckpt/last_analysis/mechanism.md.", ""]
    found = False
    for paradigm, rs in recs.items():
        for k, mode in sorted({(r["k"], r["mode"]) for r in rs if isinstance(r["k"], int)},
                              key=lambda km: (km[1] != "fixed", km[0])):
            arm = [r for r in rs if r["k"] == k and r["mode"] == mode]
            layers = sorted({n for r in arm for n in (r.get("mechanism") or {}) if n.startswith("blocks.")},
                            key=lambda n: int(n.split(".")[1]))
            if not layers:
                continue
            found = True
            types = ("softmax", "laplacian") if mode == "fixed" else ("learned",)
            cols = [(t, key, name) for t in types for key, name in MECHANISM
                    if any(metric_value(r, f"mechanism.{key}.{t}") is not None for r in arm)]
            lines += [f"**{paradigm}, k = {k} {mode}** (n = {len(arm)})", "",
                      "| layer | " + " | ".join(f"{t}: {name}" for t, _, name in cols) + " |",
                      "|---|" + "---|" * len(cols)]
            for layer in layers + ["all"]:
                at = (lambda key: f"mechanism.{key}") if layer == "all" else (lambda key: f"mechanism@{layer}.{key}")
                cells = [fmt([v for r in arm for v in [metric_value(r, at(f"{key}.{t}"))] if v is not None])
                         for t, key, _ in cols]
                lines.append(f"| {layer} | " + " | ".join(cells) + " |")
            lines.append("")
    return lines if found else []
