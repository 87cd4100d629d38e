"""The paper's token-geometry metrics: ANOVA, Neural Collapse (NC1-NC4), CDNV, linguistic collapse
and spectral decay, exact at any scale: one pass over batches, memory independent of the number
of tokens.

    from analysis.metrics import anova, neural_collapse, spectral_decay
    anova(feats, seq_ids, labels)["within_seq_share"]                 # in memory: a feature matrix
    neural_collapse(seq_means, seq_labels, weight=head.weight, bias=head.bias)["nc1"]

    acc = GeometryAccumulator(768)                                    # streamed: a batch at a time
    for feats, seq_ids, labels in batches:                            # [B, T, D], [B, T], [B, T]
        acc.update(feats, seq_ids, labels)
    out = acc.compute(weight=head.weight)                             # anova, nc1-nc3, cdnv, spectra
    acc = GeometryAccumulator(1280, metrics=("anova_seq", "lc", "spectral"))   # LM: next-token labels

The in-memory functions take features [N, D] (numpy or torch; [B, T, D] is flattened) with integer
seq_ids [N] and/or labels [N] and return a dict of floats: they are the accumulator fed every row
at once, so each metric has one implementation. The accumulator keeps, in float64 on the device of
the incoming tensors (GPU when there is one):
    N, sum x, sum ||x||^2, sum x x^T [D, D]            (the scatter: only for nc and spectral)
    per sequence: sum S_s, count n_s, label           (sequences may span batches)
    per class:    sum T_c, count n_c, sum ||x||^2     (a table grown to the largest label)
so memory is O(D^2 + (#sequences + #classes) D); analysis/formulas.py finishes each metric from
them. NC4 compares every row with the final class means (`neural_collapse` does, on its rows);
NC of the sequence means (the paper's ViT object) is `neural_collapse` on `acc.sequence_means()`.
"""
from typing import Optional, Sequence

import torch

from analysis.formulas import (add_shares, as_float64, as_index, cdnv_from_class_stats,
                               class_mean_geometry, lc_from_class_stats, nc1_from_scatter, ncc_mismatch,
                               sequence_spectra, spectrum_metrics, sq_norms)

METRICS = ("anova", "anova_seq", "nc", "cdnv", "lc", "spectral")


def _grow(t: torch.Tensor, n: int, fill=0) -> torch.Tensor:
    """Return t with at least n rows (capacity doubles, so growth costs O(final size))."""
    if t.shape[0] >= n:
        return t
    extra = torch.full((max(n, 2 * t.shape[0]) - t.shape[0], *t.shape[1:]), fill, dtype=t.dtype, device=t.device)
    return torch.cat([t, extra])


def _add(table: torch.Tensor, idx: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """table (grown to the largest id) with `values` summed into the rows `idx`."""
    return _grow(table, int(idx.max()) + 1 if idx.numel() else 0).index_add_(0, idx, values)


def _ids(ids, x: torch.Tensor, what: str) -> torch.Tensor:
    """One non-negative integer id per row of x (a negative one would index a table from its end)."""
    t = as_index(ids, x.device)
    if t.numel() != x.shape[0] or (t.numel() and int(t.min()) < 0):
        raise ValueError(f"{what} must be one non-negative integer per row ({x.shape[0]} rows, {t.numel()} {what})")
    return t


class GeometryAccumulator:
    """Accumulates the sufficient statistics of token representations batch by batch.

    Args:
        dim: feature dimension D.
        metrics: any of "anova" (sequence and class parts; labels must be constant within a
            sequence), "anova_seq" (sequence parts only, e.g. with next-token labels), "nc"
            (NC1-NC3), "cdnv", "lc" (linguistic collapse without the NCC agreement) and
            "spectral". "anova*" need seq_ids in every update; "anova", "nc", "cdnv", "lc"
            need labels (non-negative class ids).
        device: where the statistics live; default the device of the first batch.
    """

    def __init__(self, dim: int, metrics: Sequence[str] = ("anova", "nc", "cdnv", "spectral"), device=None):
        unknown = set(metrics) - set(METRICS)
        if unknown:
            raise ValueError(f"unknown metrics {sorted(unknown)}; choose from {METRICS}")
        self.dim, self.metrics = dim, set(metrics)
        self.device = torch.device(device) if device is not None else None
        self.needs_seq = bool(self.metrics & {"anova", "anova_seq"})
        self.needs_labels = bool(self.metrics & {"anova", "nc", "cdnv", "lc"})
        # the D x D scatter costs O(B D^2) per batch: kept only for the metrics that need it
        self.needs_scatter = bool(self.metrics & {"nc", "spectral"})
        self.n = 0
        self.shift = None
        self.seq_labels_consistent = True  # one label per sequence so far

    @torch.no_grad()
    def update(self, features, seq_ids=None, labels=None):
        """Add one batch: features [..., D], seq_ids [...] and labels [...] (ids >= 0)."""
        x = as_float64(features, self.device)
        if x.shape[1] != self.dim:
            raise ValueError(f"expected dim {self.dim}, got {x.shape[1]}")
        if self.shift is None:  # the first batch: the statistics live on its device
            self.device = x.device
            f64 = dict(dtype=torch.float64, device=x.device)
            # every row is stored shifted by the first batch's mean: sums of squares then stay near the
            # data's spread, so differences like sum |x|^2 - N |mu|^2 do not cancel catastrophically
            self.shift = x.mean(0)
            self.sum, self.sq = torch.zeros(self.dim, **f64), torch.zeros((), **f64)
            self.xtx = torch.zeros(self.dim, self.dim, **f64) if self.needs_scatter else None
            # the tables per sequence (sum, count, label: -1 unseen) and per class (sum, count, sum of
            # squares) are indexed by the id itself and grow to the largest seen: neither the number of
            # sequences nor a vocabulary need be known in advance, and a sequence may span batches
            self.seq_sum, self.seq_n = torch.zeros(0, self.dim, **f64), torch.zeros(0, **f64)
            self.seq_label = torch.zeros(0, dtype=torch.int64, device=x.device)
            self.cls_sum, self.cls_n, self.cls_sq = torch.zeros(0, self.dim, **f64), torch.zeros(0, **f64), \
                torch.zeros(0, **f64)
        x = x - self.shift  # the shift leaves every variance unchanged; the means get it back
        sq = sq_norms(x)
        self.n += x.shape[0]
        self.sum += x.sum(0)
        self.sq += sq.sum()
        if self.xtx is not None:
            self.xtx.addmm_(x.T, x)  # the O(B D^2) step that dominates the cost
        sid, y = (None if v is None else _ids(v, x, what) for v, what in ((seq_ids, "seq_ids"), (labels, "labels")))
        if y is None and self.needs_labels:
            raise ValueError(f"metrics {sorted(self.metrics)} need labels")
        if sid is None and self.needs_seq:
            raise ValueError("the ANOVA needs seq_ids in every batch")
        if sid is not None:
            self.seq_sum, self.seq_n = _add(self.seq_sum, sid, x), _add(self.seq_n, sid, torch.ones_like(sq))
            if y is not None:
                # one label per sequence, also across batches: each sequence's label in this batch
                # (any of its tokens') against all its tokens and against what an earlier batch said
                before = _grow(self.seq_label, self.seq_n.shape[0], fill=-1)
                self.seq_label = before.clone().scatter_(0, sid, y)
                bad = bool((self.seq_label[sid] != y).any()) or bool(((before[sid] >= 0) & (before[sid] != y)).any())
                self.seq_labels_consistent &= not bad
                if bad and "anova" in self.metrics:
                    raise ValueError("labels vary within a sequence (its tokens have different labels); the ANOVA's "
                                     "class parts need one label per sequence (next-token labels: metrics 'anova_seq')")
        if y is not None and self.needs_labels:
            # sum, count and sum of squares per class: the class means and within-class variances
            self.cls_sum, self.cls_n = _add(self.cls_sum, y, x), _add(self.cls_n, y, torch.ones_like(sq))
            self.cls_sq = _add(self.cls_sq, y, sq)

    # ------------------------------------------------------------------ finished quantities
    def _classes(self):
        """Present class ids, their shifted means, counts and variances sigma_c^2."""
        classes = torch.nonzero(self.cls_n > 0).flatten()
        T, n_c = self.cls_sum[classes], self.cls_n[classes]
        means = T / n_c[:, None]
        # E|x|^2 - |E x|^2 may round below 0 for a class of identical rows
        return classes, means, n_c, (self.cls_sq[classes] / n_c - sq_norms(means)).clamp_min(0)

    def class_means(self, min_count: int = 1):
        """(class ids [K], means [K, D]) of the classes with at least min_count rows."""
        classes, means, n_c, _ = self._classes()
        kept = n_c >= min_count
        return classes[kept], means[kept] + self.shift

    def sequence_means(self):
        """(sequence ids [S], means [S, D], labels [S] or None) of the sequences seen, by id; labels
        only when every token of each sequence came with the same label (an image's class, not next
        tokens)."""
        ids = torch.nonzero(self.seq_n > 0).flatten()
        has = self.seq_labels_consistent and self.seq_label.numel() and bool((self.seq_label[ids] >= 0).all())
        return ids, self.seq_sum[ids] / self.seq_n[ids, None] + self.shift, self.seq_label[ids] if has else None

    def _rows(self, w, classes):
        if w is None:
            return None
        w = as_float64(w, self.device)
        if int(classes.max()) >= w.shape[0]:
            raise ValueError(f"labels must index the {w.shape[0]} classifier rows")
        return w[classes]

    @torch.no_grad()
    def compute(self, weight=None, unembedding=None, thresholds=(0.9, 0.99), min_count: int = 1,
                lc_center: str = "classes") -> dict:
        """Finish every requested metric; the keys are those of `analysis.metrics`.

        Args:
            weight: classifier [K, D] for nc2_equinorm_w and nc3 (nc4: analysis.metrics.neural_collapse).
            unembedding: [V, D] LM head for the lc self-duality measures.
            thresholds: as in `spectra.spectral_decay` (the global spectrum; `spectral` the others).
            min_count, lc_center: as in `metrics.linguistic_collapse`.
        """
        if self.n == 0:
            raise ValueError("no data: call update() first")
        N, mu = self.n, self.sum / self.n
        Q, mu2 = float(self.sq), float(sq_norms(mu))
        present = self.seq_n > 0
        ns, S, n_s = int(present.sum()), self.seq_sum[present], self.seq_n[present]
        # The ANOVA from sums alone (all about the shifted origin): N total = Q - N |mu|^2,
        # N within_seq = Q - A, N between_seq = A - N |mu|^2
        A = float((sq_norms(S) / n_s).sum()) if ns else float("nan")  # sum_s ||S_s||^2 / n_s
        out = {}
        if self.metrics & {"anova", "anova_seq"}:
            # max(.., 0): a sequence of identical tokens makes Q - A a rounding-level difference
            out.update(total=Q / N - mu2, within_seq=max(Q - A, 0.0) / N, between_seq=A / N - mu2)
        if self.needs_labels:
            classes, means, n_c, var = self._classes()
        if "anova" in self.metrics:
            # the class parts nest the sequence parts: one label per sequence, so within_class = (A - B) / N
            B = float((sq_norms(means) * n_c).sum())  # sum_c ||T_c||^2 / n_c
            out.update(within_class=max(A - B, 0.0) / N, between_class=B / N - mu2)
        if "total" in out:
            add_shares(out, Q / N)
        if "nc" in self.metrics:
            # the within-class scatter from the total scatter less the class means' part: no second pass
            sigma_w = (self.xtx - (means * n_c[:, None]).T @ means) / N
            out.update(num_classes=float(classes.numel()), nc1=nc1_from_scatter(sigma_w, means - mu))
            out.update(class_mean_geometry(means, mu, self._rows(weight, classes)))
        if "cdnv" in self.metrics:
            out.update(cdnv_from_class_stats(means, var))
        if "lc" in self.metrics:
            # next-token classes seen fewer than min_count times have no stable mean (Wu & Papyan's cut)
            kept = n_c >= min_count
            if int(kept.sum()) < 2:
                raise ValueError(f"fewer than 2 classes have {min_count} or more rows")
            out.update(lc_from_class_stats(means[kept], n_c[kept], var[kept],
                                           self._rows(unembedding, classes[kept]), lc_center))
        if "spectral" in self.metrics:
            out.update(self.spectral(thresholds))
        return out

    @torch.no_grad()
    def spectral(self, thresholds=(0.9, 0.99), center: str = "global") -> dict:
        """The spectral keys of `compute` alone (n_pcs_<t>, effective_rank, total_variance,
        spectrum): center="global", the covariance of all rows about their mean; "sequence", the
        pooled within-sequence covariance (every row less its own sequence's mean; needs seq_ids)."""
        if "spectral" not in self.metrics or self.n == 0:
            raise ValueError("the spectrum needs metrics 'spectral' and data (call update() first)")
        N, mu, present = self.n, self.sum / self.n, self.seq_n > 0
        if center == "global":
            # the shift cancels: both the scatter and mu are about the same shifted origin
            cov = (self.xtx - N * torch.outer(mu, mu)) / N
        elif center == "sequence" and present.any():
            S, n_s = self.seq_sum[present], self.seq_n[present]
            # sum_i (x_i - mu_s(i))(...)^T = X^T X - sum_s S_s S_s^T / n_s: each token less its own sequence's mean
            cov = (self.xtx - (S / n_s[:, None]).T @ S) / N
        else:
            raise ValueError(f"center={center!r}: 'global', or 'sequence' with seq_ids in the updates")
        # the rows' mean square tells rounding from real variance (spectrum_metrics' no-variance rule)
        return spectrum_metrics(cov, thresholds, mean_square=float(self.sq) / N)


class SequenceSpectra:
    """Per-sequence spectra averaged over sequences, streamed: each sequence's own tokens,
    centred on their own mean, counted as `spectra.spectrum_metrics` counts
    (`spectra.sequence_spectra`, batched), then averaged over the sequences that vary.

    Every update holds whole sequences, one per row of [B, T, D] (a ViT's patch tokens of B
    images, a GPT's B windows). The sums stay on the device until `compute`.

        spec = SequenceSpectra(thresholds=(0.9, 0.99))
        for feats in batches:            # [B, T, D]
            spec.update(feats)
        spec.compute()  # {"n_pcs_0.9", "n_pcs_0.99", "effective_rank", "n_sequences", "n_no_variance"}

    Its in-memory reference, a spectral_decay per sequence, is tests/conftest.py's per_sequence_spectra.

    Args:
        thresholds: explained-variance fractions for n_pcs_<t>.
        max_sequences: only the first this many sequences are measured (later rows are
            ignored); None: all. One small eigendecomposition per sequence and layer is the
            cost, and a mean over a few thousand sequences is already precise.
    """

    def __init__(self, thresholds: Sequence[float] = (0.9, 0.99), max_sequences: Optional[int] = None):
        self.thresholds = tuple(thresholds)
        self.max_sequences = max_sequences
        self.seen = 0
        self.parts = []  # sequence_spectra of each batch, on the features' device: no host sync per batch

    @torch.no_grad()
    def update(self, features):
        """Add B whole sequences: features [B, T, D]."""
        x = features.detach().to(torch.float64)
        if x.dim() != 3:
            raise ValueError(f"expected [B, T, D] whole sequences, got shape {tuple(x.shape)}")
        if self.max_sequences is not None:
            # the first max_sequences of the fixed order: every checkpoint measures the same sequences
            x = x[:max(0, self.max_sequences - self.seen)]
        self.seen += x.shape[0]
        if x.shape[0]:
            self.parts.append(sequence_spectra(x, self.thresholds))

    def compute(self) -> dict:
        if not self.parts:
            raise ValueError("no data: call update() first")
        one = {k: torch.cat([p[k] for p in self.parts]) for k in self.parts[0]}
        # a sequence of identical tokens has no spectrum: counted apart, not averaged as one component
        v = one.pop("varies")
        out = {k: float(t[v].mean()) if v.any() else float("nan") for k, t in one.items()}
        return {**out, "n_sequences": float(v.sum()), "n_no_variance": float((~v).sum())}


# ----------------------------------------------------------------------------- in memory
def one_pass(metrics, features, seq_ids=None, labels=None):
    """(a GeometryAccumulator fed every row at once, the rows as float64 [N, D])."""
    x = as_float64(features)
    acc = GeometryAccumulator(x.shape[1], metrics, device=x.device)
    acc.update(x, seq_ids, labels)
    return acc, x


def anova(features, seq_ids, labels=None) -> dict:
    """Variance decomposition of token representations into within/between sequence and class.

    With mu the mean of all rows, mu_s the mean of sequence s, mu_c the mean of class c:
        total       = mean_i ||x_i - mu||^2             = within_seq + between_seq
        within_seq  = mean_i ||x_i - mu_s(i)||^2
        between_seq = mean_i ||mu_s(i) - mu||^2         = within_class + between_class
        within_class  = mean_i ||mu_s(i) - mu_c(i)||^2
        between_class = mean_i ||mu_c(i) - mu||^2
    and the shares <part>_share = part / total. `labels`: the class of each token, the same for
    every token of a sequence; None for the sequence parts only.
    """
    return one_pass(("anova_seq",) if labels is None else ("anova",), features, seq_ids, labels)[0].compute()


def neural_collapse(features, labels, weight=None, bias=None) -> dict:
    """Neural Collapse NC1-NC4 (Papyan, Han & Donoho 2020) of rows `features` with class `labels`.

    mu is the mean of all rows, mu_c the class means, M the rows mu_c - mu, C the classes present:
        nc1 = tr(Sigma_W pinv(Sigma_B)) / C, Sigma_W = 1/N sum_i (x_i - mu_c(i))(...)^T,
              Sigma_B = 1/C sum_c (mu_c - mu)(...)^T
        nc2_equinorm = std_c ||mu_c - mu|| / mean_c ||mu_c - mu||
        nc2_equiangular = std over c != c' of cos(mu_c - mu, mu_c' - mu)
        nc2_maxangle = mean over c != c' of |cos(mu_c - mu, mu_c' - mu) + 1/(C-1)|
    and with the classifier `weight` [K, D] (rows indexed by label) and `bias` [K]:
        nc2_equinorm_w = std / mean of the row norms of W
        nc3 = || W/||W||_F - M/||M||_F ||_F^2
        nc4 = fraction of rows where argmax_c (W x + b)_c != argmin_c ||x - mu_c||
    Stds are population stds (ddof=0); num_classes is returned too.
    """
    acc, x = one_pass(("nc",), features, labels=labels)
    out = acc.compute(weight=weight)
    if weight is not None:
        # NC4 compares every row with the final class means: a second look at the rows
        classes, means = acc.class_means()
        b = None if bias is None else as_float64(bias, x.device).reshape(-1)[classes]
        out["nc4"] = ncc_mismatch(x, means, as_float64(weight, x.device)[classes], b) / x.shape[0]
    return out


def cdnv(features, labels) -> dict:
    """Class-distance normalised variance (Galanti et al. 2022; Wu & Papyan 2024's NC1 measure):
    per pair of classes (sigma_c^2 + sigma_c'^2) / (2 ||mu_c - mu_c'||^2), with sigma_c^2 the mean
    over the rows of c of ||x - mu_c||^2; the mean and population std over pairs (cdnv_mean, cdnv_std)."""
    return one_pass(("cdnv",), features, labels=labels)[0].compute()


def linguistic_collapse(features, labels, unembedding=None, min_count: int = 1, center: str = "classes") -> dict:
    """Wu & Papyan's "linguistic collapse" measures, classes = next-token ids.

    As "Linguistic Collapse: Neural Collapse in (Large) Language Models" (NeurIPS 2024,
    arXiv:2405.17767) computes them in its code (rhubarbwu/linguistic-collapse, lib/collapse.py):
    class means of the classes with at least `min_count` rows (its --min_per_class), centred by
    the unweighted mean of those class means (center="tokens": the token-weighted mean), the
    unembedding rows as they are.
    Keys (pairs are ordered pairs c != c', stds are population stds):
        lc_num_classes            number of kept classes
        lc_cdnv_mean, lc_cdnv_std CDNV over pairs of kept classes (within-class variability, NC1)
        lc_equinorm               std / mean of ||mu_c - mu_G|| (NC2 equinormness)
        lc_coherence_mean/_std    mean / std of cos(mu_c - mu_G, mu_c' - mu_G) (the code's
                                  "coherence" / "interference"; unlike the code, without c = c')
        lc_abs_coherence_mean/_std  the same for |cos|
        lc_self_duality_cos_mean  mean_c cos(mu_c - mu_G, w_c)     (with an unembedding)
        lc_self_duality           1 - lc_self_duality_cos_mean      (NC3 self-duality distance)
        lc_uniform_duality        std_c cos(mu_c - mu_G, w_c)       (UNC3 uniform duality)
        lc_ncc_agreement          fraction of kept-class rows whose argmax_c w_c . x (over kept
                                  classes) is the nearest kept class mean (NC4)
    """
    acc, x = one_pass(("lc",), features, labels=labels)
    out = acc.compute(unembedding=unembedding, min_count=min_count, lc_center=center)
    if unembedding is not None:
        # rows of dropped classes are removed first, as the code's --min_per_class does
        classes, means = acc.class_means(min_count)
        rows = x[torch.isin(as_index(labels, x.device), classes)]
        W = as_float64(unembedding, x.device)[classes]
        out["lc_ncc_agreement"] = 1.0 - ncc_mismatch(rows, means, W) / rows.shape[0]
    return out


def spectral_decay(features, thresholds: Sequence[float] = (0.9, 0.99), seq_ids=None,
                   center: str = "global") -> dict:
    """Eigen-spectrum of the covariance of centred token representations [N, D]: n_pcs_<t>,
    effective_rank (exp of the entropy of the normalised spectrum), total_variance (trace) and
    spectrum (eigenvalues / sum, descending; a list). center="global" subtracts the mean of all
    rows; "sequence" each sequence's own mean (`seq_ids` [N]): the spectrum of within-sequence
    variation, e.g. of the tokens of one image."""
    # (another `center` is refused by GeometryAccumulator.spectral)
    acc, _ = one_pass(("spectral",), features, seq_ids if center == "sequence" else None)
    return acc.spectral(thresholds, center)
