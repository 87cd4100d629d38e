"""analysis/mechanism.py, "does each head smooth the residual stream?": the heads' outputs sum
to the attention's output (ViT and GPT, fixed and learned gates) and, after LayerScale, to the
block's attention branch; hand-set Laplacian heads with W_v W_o = -cI / +cI give cos_smooth =
+1 / -1 and a falling / rising within-sequence variance and share (first order, against finite
differences); a LayerScale of -1 turns a smoothing head into a sharpening one in the stream; the
eigenvalues of sym(M) from the small problem equal the D x D ones, a random rank-d head has d
of each sign (the 0.5 null); `python -m analysis` writes the diagnostic on a tiny trained
checkpoint and analysis.runs reads its summary."""
from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest
import torch

import laplace
from hydra import compose, initialize_config_dir

from analysis.__main__ import analysis_dir, run as analysis_run
from analysis.geometry import eval_split, load_for_analysis
from analysis.mechanism import (HeadAccumulator, head_outputs, mechanism_model, stream_frame, summary,
                                sym_eigenvalues, to_markdown, weight_spectrum)
from analysis.runs import metric_value, read_run
from conftest import CONFIGS, ROOT, randomize_, train_tiny_vit
from laplace.attention import LaplacianAttention
from train.config import model_node
from laplace.zoo import create_model


def Attention(dim, heads, fused=True, **kwargs):
    """A LaplacianAttention on the fused or the reference path (timm's `fused_attn`)."""
    attn = LaplacianAttention(dim, heads, **kwargs)
    attn.fused_attn = fused
    return attn


def _model(name: str, mode: str):
    node = model_node(name)
    if name.startswith("vit"):
        node.update(depth=2, embed_dim=48, patch_size=8, img_size=32, num_classes=10, laplacian_mode=mode)
    else:
        node.update(vocab_size=97, max_seq_len=32, laplacian_mode=mode)
    torch.manual_seed(0)
    return randomize_(create_model(**node)).eval()


def _data(model, n: int = 6):
    g = torch.Generator().manual_seed(1)
    if hasattr(model, "patch_embed"):
        return [(torch.randn(3, 32, 32, generator=g), 0) for _ in range(n)]
    return [(torch.randint(0, 97, (32,), generator=g), torch.zeros(32, dtype=torch.long)) for _ in range(n)]


@pytest.mark.parametrize("name", ["vitt_1L", "gpt_d4_1L"])
@pytest.mark.parametrize("mode", ["fixed", "learned"])
def test_head_outputs_sum_to_the_module_output(name, mode):
    """In the model's own forward (causal mask, rotary, QK-norm for the GPT): sum_h O_h + bias
    == the attention's output, and the hooks leave the features unchanged."""
    model = _model(name, mode)
    data = _data(model)
    x = torch.stack([d[0] for d in data])
    with torch.no_grad():
        before = laplace.features(model, x)["norm"]
    res = mechanism_model(model, data, batch_size=4)
    heads = res["heads"]
    with torch.no_grad():
        after = laplace.features(model, x)["norm"]
    torch.testing.assert_close(before, after, rtol=0, atol=0)  # the hooks are gone
    assert list(heads) == [f"blocks.{i}" for i in range(len(model.blocks))]
    assert res["n_sequences"] == 6 and 0 <= res["recon_err"] < 1e-5  # the largest over the layers
    a = model.blocks[0].attn
    types = [h["type"] for h in heads["blocks.0"]]
    if mode == "fixed":
        k = a.num_laplacian_heads
        assert k >= 1 and types == ["softmax"] * (a.num_heads - k) + ["laplacian"] * k
    else:
        assert all(t.startswith("learned a=") for t in types)
        assert [h["gate"] for h in heads["blocks.0"]] == pytest.approx(a.gates().tolist())
    for hs in heads.values():
        for h in hs:
            assert -1 <= h["cos_smooth"] <= 1 and -1 <= h["cos_token"] <= 1 and 0 <= h["neg_mass"] <= 1
            assert math.isfinite(h["dvar"]) and h["eig_min"] <= h["eig_max"] and h["out_norm"] > 0

    # standalone, learned gates away from 0 / 1: O_h by hand from P, V and W_o
    attn = model.blocks[0].attn
    xin = torch.randn(2, 5, attn.proj.weight.shape[0], generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        out, P = attn(xin, is_causal=name.startswith("gpt"), return_attn=True)
    O = head_outputs(attn, xin, P)
    bias = 0 if attn.proj.bias is None else attn.proj.bias.double()
    torch.testing.assert_close(O.sum(1) + bias, out.double(), rtol=1e-5, atol=1e-5)
    if mode == "fixed":  # a Laplacian head's output is -(P X - X) M_h, the M whose eigenvalues are reported
        D, dh = attn.proj.weight.shape[0], attn.head_dim
        h = attn.num_heads - 1
        Wv, Wo = attn.qkv.weight.double()[2 * D:], attn.proj.weight.double()
        M = Wv[h * dh:(h + 1) * dh].T @ Wo[:, h * dh:(h + 1) * dh].T
        S = P[:, h].double() @ xin.double() - xin.double()
        torch.testing.assert_close(O[:, h], -S @ M, rtol=1e-6, atol=1e-6)


def test_chunks_and_batches_do_not_change_the_numbers(monkeypatch):
    model = _model("gpt_d4_1L", "fixed")
    data = _data(model, 5)
    whole = mechanism_model(model, data, batch_size=5)["heads"]
    monkeypatch.setattr(HeadAccumulator, "CHUNK_ELEMENTS", 1)  # one sequence per chunk
    parts = mechanism_model(model, data, batch_size=2)["heads"]
    for layer, hs in whole.items():
        for a, b in zip(hs, parts[layer]):
            assert a.pop("type") == b.pop("type")
            assert a == pytest.approx(b, rel=1e-6, abs=1e-9)


def _hand_set(c: float, D: int = 8, causal: bool = False):
    """One Laplacian head with D = head dim, W_v = I and W_o = c I: M = W_v W_o = c I."""
    attn = Attention(D, 1, num_laplacian_heads=1, qkv_bias=False, proj_bias=False, fused=False)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        attn.qkv.weight.copy_(torch.randn(3 * D, D, generator=g) / math.sqrt(D))
        attn.qkv.weight[2 * D:] = torch.eye(D)
        attn.proj.weight.copy_(c * torch.eye(D))
    acc = HeadAccumulator(attn)
    for b in range(3):
        x = torch.randn(4, 10, D, generator=g)
        with torch.no_grad():
            out, P = attn(x, is_causal=causal, return_attn=True)
        torch.testing.assert_close(out.double(), (c * (x - P[:, 0] @ x)).double(), rtol=1e-5, atol=1e-5)
        acc.update(x, x, P, out)  # a bare attention: the stream is its input
    h, = acc.compute()
    return h, acc


@pytest.mark.parametrize("causal", [False, True])
def test_a_negative_diffusion_smooths_and_a_positive_one_sharpens(causal):
    """W_v W_o = -c I: the head outputs c (P X - X), exactly the smoothing direction."""
    c = 0.5
    h, acc = _hand_set(-c, causal=causal)
    assert h["type"] == "laplacian" and h["gate"] == 1.0 and acc.recon_err < 1e-6
    assert h["cos_smooth"] == pytest.approx(1.0, abs=1e-12) and h["cos_token"] == pytest.approx(1.0, abs=1e-12)
    assert h["dvar"] < -0.1
    assert h["neg_mass"] == pytest.approx(1.0) and h["eig_min"] == pytest.approx(-c) == h["eig_max"]
    assert h["trace_fro"] == pytest.approx(-math.sqrt(8))  # -8c / (c sqrt 8)
    if causal:  # the first position attends to itself only: S = 0 there, left out of the per-token mean
        assert acc.cos_n.item() == 3 * 4 * 9
    h, _ = _hand_set(+c, causal=causal)
    assert h["cos_smooth"] == pytest.approx(-1.0, abs=1e-12) and h["cos_token"] == pytest.approx(-1.0, abs=1e-12)
    assert h["dvar"] > 0.1 and h["neg_mass"] == 0.0 and h["trace_fro"] == pytest.approx(math.sqrt(8))


def test_dvar_and_dshare_are_the_first_order_changes():
    """dvar and dshare are the derivatives at 0 of W(x + e D) / W(x) and of the within-sequence
    share W / T along the head's part D (checked by central finite differences)."""
    h, _ = _hand_set(-0.5)
    attn = Attention(8, 1, num_laplacian_heads=1, qkv_bias=False, proj_bias=False, fused=False)
    g = torch.Generator().manual_seed(0)  # the same x as _hand_set's
    with torch.no_grad():
        attn.qkv.weight.copy_(torch.randn(24, 8, generator=g) / math.sqrt(8))
    xs = torch.cat([torch.randn(4, 10, 8, generator=g).double() for _ in range(3)])
    qk = attn.qkv.weight.double()
    q, k = xs @ qk[:8].T, xs @ qk[8:16].T
    P = ((q @ k.transpose(1, 2)) / math.sqrt(8)).softmax(-1)
    D = 0.5 * (P @ xs - xs)  # the head's output: -(PX - X) W_v W_o with W_v W_o = -0.5 I

    def W(z):  # the within-sequence sum of squares, summed over sequences
        return ((z - z.mean(1, keepdim=True)) ** 2).sum()

    def share(z):
        return W(z) / ((z - z.reshape(-1, 8).mean(0)) ** 2).sum()

    e = 1e-6
    dW = (W(xs + e * D) - W(xs - e * D)) / (2 * e)
    assert h["dvar"] == pytest.approx((dW / W(xs)).item(), rel=1e-6) and h["dvar"] < 0
    ds = (share(xs + e * D) - share(xs - e * D)) / (2 * e)
    assert h["dshare"] == pytest.approx(ds.item(), rel=1e-5)
    # exactly, with D added whole: the first order plus |D - mean_seq(D)|^2 / W, which is positive
    assert h["dvar_exact"] == pytest.approx(((W(xs + D) - W(xs)) / W(xs)).item(), rel=1e-6)
    assert h["dvar_exact"] - h["dvar"] == pytest.approx((W(D) / W(xs)).item(), rel=1e-6) and W(D) > 0
    assert h["dshare_exact"] == pytest.approx((share(xs + D) - share(xs)).item(), rel=1e-6)
    assert h["out_norm"] == pytest.approx((D.norm() / xs.norm()).item(), rel=1e-6)


def test_a_head_that_overshoots_smooths_to_first_order_and_sharpens_exactly():
    """W_v W_o = -3 I: x + D = 3 P x - 2 x points toward the attention-weighted mean (first order:
    smooths) but goes three times past it: the exact within-sequence variance grows."""
    h, _ = _hand_set(-3.0)
    assert h["cos_smooth"] == pytest.approx(1.0) and h["dvar"] < 0 < h["dvar_exact"] and h["out_norm"] > 1


def test_sym_eigenvalues_are_those_of_the_full_matrix():
    g = torch.Generator().manual_seed(3)
    A, B = torch.randn(20, 4, generator=g, dtype=torch.float64), torch.randn(4, 20, generator=g, dtype=torch.float64)
    M = A @ B
    full = torch.linalg.eigvalsh((M + M.T) / 2)
    nonzero = full[full.abs() > 1e-9]
    assert len(nonzero) == 8
    torch.testing.assert_close(sym_eigenvalues(A, B), nonzero)
    # a rank-4 head that does not write into the subspace it reads: 4 eigenvalues of each sign, the
    # reason a neg_mass of 0.5 is the null and not a sign of smoothing
    assert int((nonzero < 0).sum()) == int((nonzero > 0).sum()) == 4


class _Block(torch.nn.Module):
    """A pre-norm block's attention branch, as the ViT's: x + ls1(attn(norm1(x)))."""

    def __init__(self, attn, gain, gamma):
        from timm.layers import LayerScale

        super().__init__()
        D = gain.numel()
        self.norm1, self.attn, self.ls1 = torch.nn.LayerNorm(D), attn, LayerScale(D, 1.0)
        with torch.no_grad():
            self.norm1.weight.copy_(gain)
            self.ls1.gamma.copy_(gamma)

    def forward(self, x):
        return x + self.ls1(self.attn(self.norm1(x)))


def test_the_stream_frame_includes_the_norm_gain_and_layerscale():
    """A Laplacian head with W_v W_o = -cI smooths its normed input; with LayerScale -1 it
    sharpens the stream (neg_mass 0, cos_smooth < 0), with +1 it smooths it (neg_mass 1); with
    any gain and LayerScale, neg_mass is that of Pi diag(g) W_v W_o diag(lambda) computed on the
    D x D matrix, and the heads' parts sum to the block's attention branch."""
    D, c = 8, 0.5
    g = torch.Generator().manual_seed(4)
    attn = Attention(D, 1, num_laplacian_heads=1, qkv_bias=False, proj_bias=True, fused=False)
    with torch.no_grad():
        attn.qkv.weight.copy_(torch.randn(3 * D, D, generator=g) / math.sqrt(D))
        attn.qkv.weight[2 * D:] = torch.eye(D)
        attn.proj.weight.copy_(-c * torch.eye(D))
        attn.proj.bias.copy_(torch.randn(D, generator=g))
    x = torch.randn(6, 10, D, generator=g)
    for gamma, sign in ((torch.ones(D), +1), (-torch.ones(D), -1)):
        blk = _Block(attn, torch.ones(D), gamma)
        frame = stream_frame(blk)
        assert frame["center"] and torch.equal(frame["scale"], gamma.double())
        h, = weight_spectrum(attn, **frame)
        assert h["neg_mass"] == pytest.approx(1.0 if sign > 0 else 0.0, abs=1e-8)  # Pi's zero: rounding
        acc = HeadAccumulator(attn, frame)
        with torch.no_grad():
            out, P = attn(blk.norm1(x), return_attn=True)
        acc.update(x, blk.norm1(x), P, out)
        assert h["neg_mass"] == acc.compute()[0]["neg_mass"] and sign * acc.compute()[0]["cos_smooth"] > 0.5
    # a gain and a mixed-sign LayerScale: the small problem against the full matrix
    gain, gamma = torch.rand(D, generator=g) + 0.5, torch.randn(D, generator=g)
    blk = _Block(attn, gain, gamma)
    h, = weight_spectrum(attn, **stream_frame(blk))
    Pi = torch.eye(D, dtype=torch.float64) - 1.0 / D
    M = Pi @ torch.diag(gain.double()) @ (-c * torch.eye(D, dtype=torch.float64)) @ torch.diag(gamma.double())
    e = torch.linalg.eigvalsh((M + M.T) / 2)
    e = e[e.abs() > 1e-9]
    assert h["neg_mass"] == pytest.approx((e.clamp_max(0).abs().sum() / e.abs().sum()).item())
    assert h["trace_fro"] == pytest.approx((M.trace() / M.norm()).item())
    with torch.no_grad():
        xn = blk.norm1(x)
        out, P = attn(xn, return_attn=True)
        parts = head_outputs(attn, xn, P) * gamma.double()  # [B, H, N, D] as each head enters the stream
        branch = blk(x) - x
    torch.testing.assert_close(parts.sum(1) + attn.proj.bias.double() * gamma.double(), branch.double(),
                               rtol=1e-5, atol=1e-5)


def test_summary_and_markdown():
    heads = {"blocks.0": [{"head": 0, "type": "softmax", "gate": 0.0, "cos_smooth": 0.2, "cos_token": 0.1,
                           "dvar": 0.01, "neg_mass": 0.4, "trace_fro": 0.5, "eig_min": -1.0, "eig_max": 2.0,
                           "out_norm": 0.3},
                          {"head": 1, "type": "laplacian", "gate": 1.0, "cos_smooth": 0.6, "cos_token": 0.5,
                           "dvar": -0.02, "neg_mass": 0.9, "trace_fro": -1.0, "eig_min": -2.0, "eig_max": 0.1,
                           "out_norm": 0.2}],
             "blocks.1": [{"head": 0, "type": "softmax", "gate": 0.0, "cos_smooth": 0.0, "cos_token": float("nan"),
                           "dvar": 0.03, "neg_mass": 0.6, "trace_fro": 0.1, "eig_min": -1.0, "eig_max": 1.0,
                           "out_norm": 0.3}]}
    s = summary(heads)
    assert s["cos_smooth.softmax"] == pytest.approx(0.1) and s["cos_smooth.laplacian"] == 0.6
    assert s["cos_token.softmax"] == 0.1 and s["dvar.softmax"] == pytest.approx(0.02)
    assert s["blocks.1"] == {"cos_smooth.softmax": 0.0, "dvar.softmax": 0.03, "neg_mass.softmax": 0.6,
                             "trace_fro.softmax": 0.1, "out_norm.softmax": 0.3}
    md = to_markdown({"model": "m", "heads": heads, "n_tokens": 10, "n_sequences": 2})
    rows = [[c.strip() for c in ln.strip().strip("|").split("|")] for ln in md.splitlines() if ln.startswith("|")]
    assert ["blocks.0", "1", "laplacian", "+0.600", "+0.500", "-0.0200", "nan", "0.900", "-1.000"] in \
        [r[:9] for r in rows]  # no dshare in these hand-written heads: nan
    assert ["laplacian", "+0.6000", "+0.5000", "-0.0200", "nan", "+0.9000", "-1.0000", "nan", "nan", "+0.2000"] in rows


@pytest.fixture(scope="module")
def analysed(tmp_path_factory):
    """A 2-step tiny vitt_1L (the last of 3 heads Laplacian) through `python -m analysis`."""
    tmp = tmp_path_factory.mktemp("mech")
    ckpt = train_tiny_vit(tmp)
    proc = subprocess.run([sys.executable, "-m", "analysis", f"checkpoint={ckpt}", "metrics=[anova]",
                           "max_tokens=1100", "batch_size=24", "mechanism_batch_size=16", "cpu_threads=1",
                           "progress=false"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return {"ckpt": ckpt, "run": tmp / "vitt_1L", "stdout": proc.stdout,
            "res": json.loads((analysis_dir(ckpt) / "analysis.json").read_text())}


def test_cli_writes_the_mechanism(analysed):
    mech, out = analysed["res"]["mechanism"], analysis_dir(analysed["ckpt"])
    assert mech["n_sequences"] == 64 and mech["n_tokens"] == 64 * 16 and mech["batch_size"] == 16  # patch tokens
    assert mech["recon_err"] < 1e-5 and list(mech["heads"]) == ["blocks.0", "blocks.1"]
    assert [h["type"] for h in mech["heads"]["blocks.1"]] == ["softmax", "softmax", "laplacian"]
    assert "[analysis] mechanism: 1,024 tokens" in analysed["stdout"]
    # the same numbers in-process on the same split
    model, _, data = load_for_analysis(analysed["ckpt"], device="cpu")
    ds, _ = eval_split(model, data, seed=0, max_tokens=1100)
    again = mechanism_model(model, ds, batch_size=64)["heads"]
    for layer, hs in again.items():
        for got, want in zip(mech["heads"][layer], hs):
            for key in ("cos_smooth", "cos_token", "dvar", "dshare", "neg_mass", "trace_fro", "eig_min"):
                assert got[key] == pytest.approx(want[key], rel=1e-6, abs=1e-9), (layer, key)
    md = (out / "mechanism.md").read_text()
    assert any(ln.replace(" ", "").startswith("|blocks.1|2|laplacian|") for ln in md.splitlines())
    assert "Means over the heads" in md
    for ext in ("png", "pdf"):
        assert (out / f"mechanism.{ext}").stat().st_size > 5000


def test_runs_read_the_summary(analysed):
    r = read_run(analysed["run"])
    heads = analysed["res"]["mechanism"]["heads"]
    lap = [h["cos_smooth"] for hs in heads.values() for h in hs if h["type"] == "laplacian"]
    soft1 = [h["dvar"] for h in heads["blocks.1"] if h["type"] == "softmax"]
    assert len(lap) == 2 and len(soft1) == 2
    assert metric_value(r, "mechanism.cos_smooth.laplacian") == pytest.approx(sum(lap) / 2)
    assert metric_value(r, "mechanism@blocks.1.dvar.softmax") == pytest.approx(sum(soft1) / 2)
    assert metric_value(r, "mechanism.neg_mass.softmax") is not None
    assert metric_value(r, "mechanism.cos_smooth.learned") is None  # no learned heads
    assert metric_value(r, "mechanism.blocks.1") is None  # a layer is not a number
    with pytest.raises(ValueError, match="mechanism@blocks.<i>.<key>"):
        metric_value(r, "mechanism@norm.dvar.softmax")


@pytest.mark.parametrize("overrides,expect", [
    (["mechanism=3"], "mechanism=3: true or false"),
    (["mechanism_batch_size=0"], "mechanism_batch_size=0: a positive number"),
])
def test_bad_options_are_one_line(overrides, expect, analysed):
    with initialize_config_dir(config_dir=CONFIGS, version_base="1.3"):
        cfg = compose("analysis", overrides=[f"checkpoint={analysed['ckpt']}", *overrides, "progress=false"])
    with pytest.raises(ValueError, match=expect):
        analysis_run(cfg)
