"""The token geometry on the paper's objects: per-sequence spectra averaged over sequences
(conftest.per_sequence_spectra, streamed by analysis.metrics.SequenceSpectra), the
GPT's within-window spectra, and the headline keys of analysis.runs.geometry (raw ANOVA
variances, per_seq_n_pcs_*) on a real tiny GPT analysed in-process."""
from __future__ import annotations

import math

import pytest
import torch

import laplace

from analysis.geometry import analyze_model, eval_split, load_for_analysis
from analysis.runs import geometry
from analysis import metrics as m
from analysis.formulas import sequence_spectra
from analysis.metrics import SequenceSpectra
from conftest import per_sequence_spectra, save_tiny_gpt

RANKS = (1, 2, 3, 5, 8)  # <= 9, so both 0.9 and 0.99 need every direction of an equal spectrum


def _planted(ranks, T=24, D=16, seed=0) -> torch.Tensor:
    """[len(ranks), T, D]: sequence i's tokens = its own offset + r_i orthonormal directions
    (a random rotation per sequence) with orthogonal, zero-mean, equal-norm coefficients
    (cosines of frequencies 1..r_i), so its centred spectrum is r_i equal eigenvalues."""
    g = torch.Generator().manual_seed(seed)
    t = torch.arange(T, dtype=torch.float64)
    out = []
    for r in ranks:
        basis = torch.linalg.qr(torch.randn(D, D, generator=g, dtype=torch.float64))[0][:, :r].T  # [r, D]
        coef = torch.stack([torch.cos(2 * math.pi * (j + 1) * t / T) for j in range(r)], 1)  # [T, r]
        out.append(3.0 * torch.randn(D, generator=g, dtype=torch.float64) + coef @ basis)
    return torch.stack(out)


def test_per_sequence_count_is_the_mean_of_the_planted_ranks():
    x = _planted(RANKS)
    want = sum(RANKS) / len(RANKS)
    ref = per_sequence_spectra(x.reshape(-1, x.shape[-1]), torch.arange(len(RANKS)).repeat_interleave(x.shape[1]))
    spec = SequenceSpectra()
    spec.update(x[:2])
    spec.update(x[2:])
    got = spec.compute()
    for out in (ref, got):
        assert out["n_pcs_0.9"] == out["n_pcs_0.99"] == pytest.approx(want, abs=1e-12)
        assert out["effective_rank"] == pytest.approx(want, rel=1e-9)
        assert (out["n_sequences"], out["n_no_variance"]) == (len(RANKS), 0)
    # one sequence at a time: its own r (the pooled counting rule of spectrum_metrics)
    one = sequence_spectra(x)
    assert one["n_pcs_0.99"].tolist() == list(map(float, RANKS))
    # a sequence whose tokens are all equal has no spectrum: left out of the mean, counted apart
    flat = torch.cat([x, torch.ones(1, *x.shape[1:], dtype=x.dtype)])
    spec = SequenceSpectra()
    spec.update(flat)
    got = spec.compute()
    assert got["n_pcs_0.99"] == pytest.approx(want) and (got["n_sequences"], got["n_no_variance"]) == (5, 1)


@pytest.mark.parametrize("T,D", [(17, 12), (12, 8)])  # T <= D: the T x T Gram; T > D: the D x D covariance
def test_streamed_per_sequence_equals_direct(T, D):
    g = torch.Generator().manual_seed(1)
    S = 13
    # varied spectra: a random low rank per sequence, scaled directions, a little noise
    rank = torch.randint(1, D, (S,), generator=g)
    x = torch.stack([torch.randn(T, int(r), generator=g, dtype=torch.float64)
                     @ (torch.randn(int(r), D, generator=g, dtype=torch.float64) * torch.rand(int(r), 1, generator=g,
                                                                                           dtype=torch.float64))
                     + 1e-3 * torch.randn(T, D, generator=g, dtype=torch.float64) + torch.randn(D, generator=g)
                     for r in rank])
    thr = (0.5, 0.9, 0.99)
    spec = SequenceSpectra(thresholds=thr)
    for lo, hi in ((0, 3), (3, 8), (8, 9), (9, 13)):  # batches of different sizes
        spec.update(x[lo:hi].float() if lo == 8 else x[lo:hi])  # a float32 batch is measured in float64
    got = spec.compute()
    seen = torch.cat([x[:8], x[8:9].float().double(), x[9:]])  # what the accumulator saw
    ref = per_sequence_spectra(seen.reshape(-1, D), torch.arange(S).repeat_interleave(T), thresholds=thr)
    assert ref["n_sequences"] == S and len({m.spectral_decay(s, thr)["n_pcs_0.99"] for s in seen}) > 2  # varied
    for key in ("n_pcs_0.5", "n_pcs_0.9", "n_pcs_0.99", "n_sequences", "n_no_variance"):
        assert got[key] == pytest.approx(ref[key], abs=1e-12), key
    assert got["effective_rank"] == pytest.approx(ref["effective_rank"], rel=1e-9)
    # the cap: only the first sequences are measured
    cap = SequenceSpectra(thresholds=(0.9, 0.99), max_sequences=5)
    for lo, hi in ((0, 3), (3, 8), (8, 13)):
        cap.update(x[lo:hi])
    first = per_sequence_spectra(x[:5].reshape(-1, D), torch.arange(5).repeat_interleave(T))
    assert cap.compute()["n_sequences"] == 5 and cap.compute()["n_pcs_0.99"] == pytest.approx(first["n_pcs_0.99"])


def test_gpt_within_window_spectra_and_headline_keys(tmp_path):
    torch.set_num_threads(1)
    model, _, data = load_for_analysis(save_tiny_gpt(tmp_path / "last.pt", seq_len=32), device="cpu")
    ds, T = eval_split(model, data, seed=0, max_tokens=40 * 32)
    res = analyze_model(model, ds, batch_size=16, min_count=2, progress=False)  # 40 windows: 16 + 16 + 8
    x = torch.stack([ds[i][0] for i in range(len(ds))])
    with torch.no_grad():
        f = laplace.features(model, x)["norm"].double()
    seq = torch.arange(len(ds)).repeat_interleave(T)
    got = res["results"]["tokens"]["norm"]
    assert set(got) == {"anova", "lc", "spectral", "spectral_within", "spectral_per_seq"}
    within = m.spectral_decay(f, seq_ids=seq, center="sequence")
    per_seq = per_sequence_spectra(f, seq)
    assert got["spectral_within"]["n_pcs_0.99"] == within["n_pcs_0.99"]
    assert got["spectral_within"]["effective_rank"] == pytest.approx(within["effective_rank"], rel=1e-4)
    assert got["spectral_per_seq"]["n_sequences"] == 40
    for key in ("n_pcs_0.9", "n_pcs_0.99", "effective_rank"):
        assert got["spectral_per_seq"][key] == pytest.approx(per_seq[key], rel=1e-4), key
    # the pooled within-window count is one integer, the per-window mean need not be
    assert float(got["spectral_within"]["n_pcs_0.99"]).is_integer()
    assert 1 <= got["spectral_per_seq"]["n_pcs_0.99"] <= min(T, model.width)

    g = geometry({"arch": "gpt", "results": res["results"]})
    an = got["anova"]
    assert g["within_seq_var"] == an["within_seq"] and g["between_seq_var"] == an["between_seq"]
    assert g["total_var"] == an["total"] and "between_class_var" not in g  # no classes of windows
    assert g["total_var"] == pytest.approx(g["within_seq_var"] + g["between_seq_var"], rel=1e-10)
    assert g["within_seq_share"] == pytest.approx(g["within_seq_var"] / g["total_var"], rel=1e-12)
    assert g["n_pcs_0.99"] == got["spectral"]["n_pcs_0.99"]
    assert g["within_n_pcs_0.99"] == got["spectral_within"]["n_pcs_0.99"]
    assert g["per_seq_n_pcs_0.9"] == got["spectral_per_seq"]["n_pcs_0.9"]
    assert g["per_seq_n_pcs_0.99"] == got["spectral_per_seq"]["n_pcs_0.99"]
    assert g["per_seq_effective_rank"] == got["spectral_per_seq"]["effective_rank"]
    assert "per_seq_n_sequences" not in g and "lc_cdnv_mean" in g

    # per_seq_max_sequences: the first windows only; 0 leaves the per-window spectra out
    few = analyze_model(model, ds, metrics=["spectral"], layers=[], batch_size=16, progress=False,
                        per_seq_max_sequences=20)["results"]["tokens"]["norm"]
    first = per_sequence_spectra(f[:20], seq[:20 * T])
    assert few["spectral_per_seq"]["n_sequences"] == 20
    assert few["spectral_per_seq"]["n_pcs_0.99"] == pytest.approx(first["n_pcs_0.99"], rel=1e-4)
    none = analyze_model(model, ds, metrics=["spectral"], layers=[], progress=False, per_seq_max_sequences=0)
    assert set(none["results"]["tokens"]["norm"]) == {"spectral", "spectral_within"}


def test_vit_headline_keys_name_their_objects():
    """geometry() on a hand-made ViT layer: every key from its own object."""
    anova = {"total": 4.0, "within_seq": 3.0, "between_seq": 1.0, "within_class": 0.25, "between_class": 0.75}
    anova.update({f"{k}_share": v / 4.0 for k, v in anova.items() if k != "total"})
    patch = {"anova": anova, "spectral": {"n_pcs_0.99": 30.0, "effective_rank": 9.0, "spectrum": [1.0]},
             "spectral_within": {"n_pcs_0.99": 20.0}, "spectral_per_seq": {"n_pcs_0.99": 7.5, "n_pcs_0.9": 3.25,
                                                                         "effective_rank": 2.5, "n_sequences": 64.0},
             "nc": {"nc1": 0.5, "num_classes": 10.0}}
    cls = {"nc": {"nc1": 2.0, "num_classes": 10.0}, "cdnv": {"cdnv_mean": 0.1}}
    g = geometry({"arch": "vit", "results": {"patch": {"norm": patch}, "cls": {"norm": cls}}})
    assert {k: g[k] for k in ("total_var", "within_seq_var", "between_seq_var", "within_class_var",
                              "between_class_var")} == {"total_var": 4.0, "within_seq_var": 3.0, "between_seq_var": 1.0,
                                                        "within_class_var": 0.25, "between_class_var": 0.75}
    assert (g["within_seq_share"], g["between_class_share"]) == (0.75, 0.1875)
    assert (g["n_pcs_0.99"], g["within_n_pcs_0.99"], g["per_seq_n_pcs_0.99"], g["per_seq_n_pcs_0.9"]) == (30, 20, 7.5, 3.25)
    assert (g["patch_nc1"], g["nc1"], g["per_seq_effective_rank"]) == (0.5, 2.0, 2.5)
    assert "per_seq_n_sequences" not in g and "spectrum" not in g
