"""Token-geometry metrics: known answers on synthetic data, plain-loop references (the in-memory
functions are the accumulator fed every row at once), and the streamed accumulator, in uneven
batches with sequences spanning them, against one batch."""
import itertools

import numpy as np
import pytest
import torch

from analysis import formulas as f
from analysis import metrics as m
from analysis.metrics import GeometryAccumulator


def make_tokens(seed=0, n_seq=12, n_cls=4, D=8, offset=5.0):
    """Tokens of sequences of uneven length; one class per sequence; a large global offset."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(5, 60, n_seq)
    seq_cls = np.arange(n_seq) % n_cls
    cls_mu = rng.normal(size=(n_cls, D)) * 3
    seq_mu = cls_mu[seq_cls] + rng.normal(size=(n_seq, D))
    seq_ids = np.repeat(np.arange(n_seq) * 7 + 100, lengths)  # arbitrary, non-contiguous ids
    rows = np.repeat(np.arange(n_seq), lengths)
    x = offset + seq_mu[rows] + rng.normal(size=(lengths.sum(), D)) * rng.uniform(0.2, 1.0, D)
    return x, seq_ids, seq_cls[rows]


def loop_means(x, ids):
    return {k: x[ids == k].mean(0) for k in np.unique(ids)}


def cos(a, b):
    return a @ b / np.linalg.norm(a) / np.linalg.norm(b)


def simplex_etf(C, D, seed=0):
    """C unit vectors in R^D with pairwise cosine -1/(C-1), randomly rotated."""
    q, _ = np.linalg.qr(np.random.default_rng(seed).normal(size=(D, C)))
    return np.sqrt(C / (C - 1)) * (np.eye(C) - 1 / C) @ q.T


# ----------------------------------------------------------------------------- ANOVA
def test_anova_matches_loops_and_parts_sum():
    x, s, y = make_tokens()
    out = m.anova(x, s, y)
    mu, ms, mc = x.mean(0), loop_means(x, s), loop_means(x, y)
    ref = dict(total=0.0, within_seq=0.0, between_seq=0.0, within_class=0.0, between_class=0.0)
    for xi, si, yi in zip(x, s, y):
        ref["total"] += np.sum((xi - mu) ** 2) / len(x)
        ref["within_seq"] += np.sum((xi - ms[si]) ** 2) / len(x)
        ref["between_seq"] += np.sum((ms[si] - mu) ** 2) / len(x)
        ref["within_class"] += np.sum((ms[si] - mc[yi]) ** 2) / len(x)
        ref["between_class"] += np.sum((mc[yi] - mu) ** 2) / len(x)
    for k, v in ref.items():
        assert out[k] == pytest.approx(v, rel=1e-10)
    assert out["within_seq"] + out["between_seq"] == pytest.approx(out["total"], rel=1e-12)
    assert out["within_class"] + out["between_class"] == pytest.approx(out["between_seq"], rel=1e-12)
    shares = out["within_seq_share"] + out["within_class_share"] + out["between_class_share"]
    assert shares == pytest.approx(1.0, rel=1e-12)
    seq_only = m.anova(torch.from_numpy(x), torch.from_numpy(s))
    assert "within_class" not in seq_only and seq_only["within_seq"] == pytest.approx(ref["within_seq"])


def test_anova_collapsed_tokens_have_no_within_variance():
    cls_mu = simplex_etf(3, 5) + 2.0
    y = np.repeat(np.arange(6) % 3, 10)
    out = m.anova(cls_mu[y], np.repeat(np.arange(6), 10), y)
    assert out["within_seq"] == pytest.approx(0.0, abs=1e-12)
    assert out["within_class"] == pytest.approx(0.0, abs=1e-12)
    assert out["between_class_share"] == pytest.approx(1.0)


def test_anova_rejects_labels_varying_within_a_sequence():
    x, s, y = make_tokens()
    y = y.copy()
    y[3] = (y[3] + 1) % 4
    with pytest.raises(ValueError, match="different labels"):
        m.anova(x, s, y)


# ----------------------------------------------------------------------------- Neural Collapse
def test_neural_collapse_matches_loops():
    x, _, y = make_tokens(seed=1, n_cls=5)
    rng = np.random.default_rng(1)
    W, b = rng.normal(size=(5, x.shape[1])), rng.normal(size=5)
    out = m.neural_collapse(x, y, W, b)
    C, N = 5, len(x)
    mu, mc = x.mean(0), loop_means(x, y)
    Sw = sum(np.outer(xi - mc[yi], xi - mc[yi]) for xi, yi in zip(x, y)) / N
    Sb = sum(np.outer(mc[c] - mu, mc[c] - mu) for c in range(C)) / C
    assert out["nc1"] == pytest.approx(np.trace(Sw @ np.linalg.pinv(Sb)) / C, rel=1e-8)
    norms = [np.linalg.norm(mc[c] - mu) for c in range(C)]
    assert out["nc2_equinorm"] == pytest.approx(np.std(norms) / np.mean(norms), rel=1e-10)
    coss = [cos(mc[a] - mu, mc[b] - mu) for a, b in itertools.permutations(range(C), 2)]
    assert out["nc2_equiangular"] == pytest.approx(np.std(coss), rel=1e-10)
    assert out["nc2_maxangle"] == pytest.approx(np.mean(np.abs(np.array(coss) + 1 / (C - 1))), rel=1e-10)
    wn = np.linalg.norm(W, axis=1)
    assert out["nc2_equinorm_w"] == pytest.approx(np.std(wn) / np.mean(wn), rel=1e-10)
    M = np.stack([mc[c] - mu for c in range(C)])
    assert out["nc3"] == pytest.approx(np.sum((W / np.linalg.norm(W) - M / np.linalg.norm(M)) ** 2), rel=1e-10)
    wrong = 0
    for xi in x:
        nearest = min(range(C), key=lambda c: np.sum((xi - mc[c]) ** 2))
        wrong += int(np.argmax(W @ xi + b) != nearest)
    assert out["nc4"] == pytest.approx(wrong / N) and 0 < out["nc4"] < 1


def test_nc1_with_more_classes_than_dimensions():
    x, _, y = make_tokens(seed=10, n_cls=6, D=3)  # Sigma_B has full rank D < C - 1
    mu, mc = x.mean(0), loop_means(x, y)
    Sw = sum(np.outer(xi - mc[yi], xi - mc[yi]) for xi, yi in zip(x, y)) / len(x)
    Sb = sum(np.outer(mc[c] - mu, mc[c] - mu) for c in mc) / 6
    assert m.neural_collapse(x, y)["nc1"] == pytest.approx(np.trace(Sw @ np.linalg.pinv(Sb)) / 6, rel=1e-9)


def test_collapsed_simplex_etf_aligned_classifier_is_perfect_collapse():
    C, D = 4, 7
    etf = simplex_etf(C, D, seed=3)
    y = np.repeat(np.arange(C), 25)  # balanced, so the global mean is the ETF's centre
    x = 3.0 + 2.0 * etf[y]
    W = 0.5 * etf  # the classifier equals M up to scale: nc3 = 0
    out = m.neural_collapse(x, y, W, bias=-W @ np.full(D, 3.0))  # bias cancels the offset
    assert out["nc1"] == pytest.approx(0.0, abs=1e-12)
    for k in ("nc2_equinorm", "nc2_equiangular", "nc2_maxangle", "nc2_equinorm_w", "nc3", "nc4"):
        assert out[k] == pytest.approx(0.0, abs=1e-10), k


def test_nc4_is_zero_for_the_nearest_class_mean_classifier():
    x, _, y = make_tokens(seed=2)
    mc = np.stack([x[y == c].mean(0) for c in range(4)])
    out = m.neural_collapse(x, y, weight=mc, bias=-0.5 * np.sum(mc ** 2, 1))
    assert out["nc4"] == 0.0
    assert m.neural_collapse(x, y, weight=-mc)["nc4"] > 0.5  # a wrong classifier disagrees


# ----------------------------------------------------------------------------- CDNV, linguistic collapse
def test_cdnv_matches_loop():
    x, _, y = make_tokens(seed=4, n_cls=5)
    x32 = torch.from_numpy(x).float()  # float32 input is computed in float64
    x = x32.double().numpy()
    mc = loop_means(x, y)
    var = {c: np.mean(np.sum((x[y == c] - mc[c]) ** 2, 1)) for c in mc}
    vals = [(var[a] + var[b]) / (2 * np.sum((mc[a] - mc[b]) ** 2)) for a, b in itertools.combinations(mc, 2)]
    out = m.cdnv(x32, torch.from_numpy(y))
    assert out["cdnv_mean"] == pytest.approx(np.mean(vals), rel=1e-9)
    assert out["cdnv_std"] == pytest.approx(np.std(vals), rel=1e-9)


def test_offdiag_stats_is_independent_of_chunking():
    U = f._unit_rows(torch.randn(37, 6, dtype=torch.float64))
    fn = f._cosine_block(U, lambda c: {"abs": c.abs()})
    a, b = f.offdiag_stats(fn, 37, chunk=1), f.offdiag_stats(fn, 37, chunk=37)
    for k in ("cos", "abs"):
        assert a[k] == pytest.approx(b[k], rel=1e-12)


@pytest.mark.parametrize("center", ["classes", "tokens"])
def test_linguistic_collapse_matches_loops(center):
    rng = np.random.default_rng(5)
    V, D, N = 12, 6, 400
    y = np.minimum(rng.zipf(1.6, N) - 1, V - 1)  # imbalanced "next tokens"
    x = rng.normal(size=(V, D))[y] * 2 + rng.normal(size=(N, D)) + 1.0
    U = rng.normal(size=(V, D))
    out = m.linguistic_collapse(x, y, unembedding=U, min_count=5, center=center)
    kept = [c for c in range(V) if np.sum(y == c) >= 5]
    rows = np.isin(y, kept)
    mc = {c: x[y == c].mean(0) for c in kept}
    mu = np.mean([mc[c] for c in kept], 0) if center == "classes" else x[rows].mean(0)
    assert out["lc_num_classes"] == len(kept) >= 3
    norms = [np.linalg.norm(mc[c] - mu) for c in kept]
    assert out["lc_equinorm"] == pytest.approx(np.std(norms) / np.mean(norms), rel=1e-10)
    coss = [cos(mc[a] - mu, mc[b] - mu) for a, b in itertools.permutations(kept, 2)]
    assert out["lc_coherence_mean"] == pytest.approx(np.mean(coss), rel=1e-9)
    assert out["lc_coherence_std"] == pytest.approx(np.std(coss), rel=1e-9)
    assert out["lc_abs_coherence_mean"] == pytest.approx(np.mean(np.abs(coss)), rel=1e-9)
    dual = [cos(mc[c] - mu, U[c]) for c in kept]
    assert out["lc_self_duality"] == pytest.approx(1 - np.mean(dual), rel=1e-9)
    assert out["lc_uniform_duality"] == pytest.approx(np.std(dual), rel=1e-9)
    var = {c: np.mean(np.sum((x[y == c] - mc[c]) ** 2, 1)) for c in kept}
    cd = [(var[a] + var[b]) / (2 * np.sum((mc[a] - mc[b]) ** 2)) for a, b in itertools.combinations(kept, 2)]
    assert out["lc_cdnv_mean"] == pytest.approx(np.mean(cd), rel=1e-9)
    agree = [kept[np.argmax(U[kept] @ xi)] == min(kept, key=lambda c: np.sum((xi - mc[c]) ** 2))
             for xi in x[rows]]
    assert out["lc_ncc_agreement"] == pytest.approx(np.mean(agree))


# ----------------------------------------------------------------------------- spectra
def test_planted_rank_gives_its_number_of_components():
    rng = np.random.default_rng(6)
    r, D, n_seq, L = 5, 20, 10, 40
    basis = np.linalg.qr(rng.normal(size=(D, r)))[0].T * np.linspace(1, 2, r)[:, None]
    seq = np.repeat(np.arange(n_seq), L)
    x = rng.normal(size=(n_seq * L, r)) @ basis + 4.0
    out = m.spectral_decay(x)
    assert out["n_pcs_0.99"] == r and 1 <= out["n_pcs_0.9"] <= r
    assert sum(out["spectrum"]) == pytest.approx(1.0) and 1 < out["effective_rank"] <= r
    # per-sequence offsets in other directions add components unless centred per sequence
    offsets = rng.normal(size=(n_seq, D)) * 5
    y = x + offsets[seq]
    assert m.spectral_decay(y)["n_pcs_0.99"] > r
    assert m.spectral_decay(y, seq_ids=seq, center="sequence")["n_pcs_0.99"] == r


# ----------------------------------------------------------------------------- streaming
def stream(batches, **kw):
    acc = GeometryAccumulator(batches[0][0].shape[-1], **kw)
    for b in batches:
        acc.update(*b)
    return acc


INPUTS = ["numpy", "cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def split(x, s, y, sizes, kind):
    """Uneven batches as numpy arrays or torch tensors on a device."""
    conv = (lambda a: a) if kind == "numpy" else (lambda a: torch.from_numpy(a).to(kind))
    edges = np.cumsum([0, *sizes])
    return [(conv(x[a:b]), conv(s[a:b]), conv(y[a:b])) for a, b in zip(edges[:-1], edges[1:])]


def assert_same(a, b):
    assert set(b) <= set(a)
    for k in b:
        np.testing.assert_allclose(a[k], b[k], rtol=1e-8, atol=1e-12, err_msg=k)


@pytest.mark.cuda
@pytest.mark.parametrize("kind", INPUTS)
def test_streaming_equals_in_memory(kind):
    x, s, y = make_tokens(seed=7, n_seq=15, n_cls=5, offset=50.0)
    perm = np.random.default_rng(7).permutation(len(x))  # every sequence spans several batches
    x, s, y = x[perm], s[perm], y[perm]
    rng = np.random.default_rng(8)
    W, b = rng.normal(size=(5, x.shape[1])), rng.normal(size=5)
    sizes = [1, 37, 200, 3, len(x) - 241]
    acc = stream(split(x, s, y, sizes, kind), metrics=("anova", "nc", "cdnv", "lc", "spectral"))
    out = acc.compute(weight=W, unembedding=W, min_count=1)
    assert_same(out, m.anova(x, s, y))
    nc = m.neural_collapse(x, y, W, b)
    assert_same(out, {k: v for k, v in nc.items() if k != "nc4"})
    assert_same(out, m.cdnv(x, y))
    lc = m.linguistic_collapse(x, y, unembedding=W)
    assert_same(out, {k: v for k, v in lc.items() if k != "lc_ncc_agreement"})
    assert_same(out, m.spectral_decay(x))
    seq_spec = acc.spectral((0.5, 0.95), center="sequence")
    assert_same(seq_spec, m.spectral_decay(x, (0.5, 0.95), seq_ids=s, center="sequence"))
    # a second look at the rows: NC4 from the streamed class means
    classes, means = acc.class_means()
    classes = classes.cpu().numpy()
    x64 = torch.from_numpy(x).to(means.device)
    W64, b64 = (torch.from_numpy(a[classes]).to(means.device) for a in (W, b))
    assert f.ncc_mismatch(x64, means, W64, b64) / len(x) == pytest.approx(nc["nc4"])
    # sequence means feed the in-memory NC of the paper's ViT analysis
    ids, seq_means, seq_labels = acc.sequence_means()
    ref = {k: x[s == k].mean(0) for k in ids.tolist()}
    np.testing.assert_allclose(seq_means.cpu().numpy(), np.stack([ref[k] for k in ids.tolist()]), rtol=1e-10)
    assert seq_labels.tolist() == [int(y[s == k][0]) for k in ids.tolist()]


def test_streaming_language_model_setup():
    """Next-token labels vary within a sequence: 'anova_seq' + 'lc', NCC agreement on kept classes."""
    rng = np.random.default_rng(9)
    V, D, N = 10, 6, 500
    y = np.minimum(rng.zipf(1.5, N) - 1, V - 1)
    x = rng.normal(size=(V, D))[y] + rng.normal(size=(N, D)) * 0.7
    s = np.repeat(np.arange(5), N // 5)
    U = rng.normal(size=(V, D))
    batches = split(x, s, y, [128, 128, 128, 116], kind="cpu")
    with pytest.raises(ValueError, match="vary within a sequence"):
        stream(batches, metrics=("anova",))
    acc = stream(batches, metrics=("anova_seq", "lc", "spectral"))
    out = acc.compute(unembedding=U, min_count=4)
    assert "within_class" not in out and acc.sequence_means()[2] is None
    assert_same(out, m.anova(x, s))
    lc = m.linguistic_collapse(x, y, unembedding=U, min_count=4)
    assert_same(out, {k: v for k, v in lc.items() if k != "lc_ncc_agreement"})
    classes, means = acc.class_means(min_count=4)
    rows = torch.from_numpy(x[np.isin(y, classes.numpy())])
    agree = 1 - f.ncc_mismatch(rows, means, torch.from_numpy(U[classes.numpy()])) / len(rows)
    assert agree == pytest.approx(lc["lc_ncc_agreement"])


def test_rows_that_do_not_vary_give_nan_shares_and_spectra_not_zero_by_zero():
    """Identical tokens (a collapsed model), or one token per sequence under the sequence-centred
    spectrum: the ANOVA shares and the normalised spectrum are 0/0, reported as NaN (in memory
    a ZeroDivisionError before, streaming rounding noise; the spectrum claimed 1 component)."""
    x = np.tile(np.array([0.1, 2.0, -3.0, 7.0]), (12, 1))
    s, y = np.arange(12) // 3, np.arange(12) // 6
    for out in (m.anova(x, s, y), stream([(x, s, y)], metrics=("anova",)).compute()):
        assert out["total"] == pytest.approx(0.0, abs=1e-12)
        assert all(np.isnan(out[f"{p}_share"]) for p in ("within_seq", "between_seq", "within_class",
                                                         "between_class"))
    for spec in (m.spectral_decay(x), stream([(x, s, y)], metrics=("spectral",)).compute(),
                 m.spectral_decay(np.random.default_rng(0).normal(size=(5, 4)), seq_ids=np.arange(5),
                                  center="sequence")):
        assert np.isnan(spec["n_pcs_0.99"]) and np.isnan(spec["effective_rank"])
        assert spec["total_variance"] == pytest.approx(0.0, abs=1e-12) and np.isnan(spec["spectrum"]).all()
    varied = m.spectral_decay(x + np.random.default_rng(1).normal(size=x.shape))
    assert varied["n_pcs_0.99"] >= 1 and not np.isnan(varied["spectrum"]).any()
