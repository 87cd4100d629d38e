"""analysis/mechanism.py, "does each head smooth?": the heads' outputs sum to the attention's
output (ViT and GPT, fixed and learned gates), hand-set Laplacian heads with W_v W_o = -cI / +cI
give cos_smooth = +1 / -1 and a falling / rising within-sequence variance, the eigenvalues of
sym(W_v W_o) from the small problem equal the D x D ones, `python -m analysis` writes the
diagnostic on a tiny trained checkpoint and analysis.runs reads its summary."""
from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest
import torch
from hydra import compose, initialize_config_dir

from analysis.__main__ import analysis_dir, run as analysis_run
from analysis.geometry import eval_split, load_for_analysis
from analysis.mechanism import (HeadAccumulator, head_mechanism, head_outputs, summary, sym_eigenvalues,
                                to_markdown)
from analysis.runs import metric_value, read_run
from conftest import CONFIGS, ROOT, randomize_, train_tiny_vit
from laplace.attention import Attention
from laplace.config import model_node
from laplace.zoo import create_model


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
        before = model.forward_features(x)["norm"]
    accs = {}
    heads = head_mechanism(model, data, batch_size=4, accumulators=accs)
    with torch.no_grad():
        after = model.forward_features(x)["norm"]
    torch.testing.assert_close(before, after, rtol=0, atol=0)  # the hooks are gone
    assert list(heads) == [f"blocks.{i}" for i in range(len(model.blocks))]
    for acc in accs.values():
        assert acc.sequences == 6 and 0 <= acc.recon_err < 1e-5
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
    whole = head_mechanism(model, data, batch_size=5)
    monkeypatch.setattr(HeadAccumulator, "CHUNK_ELEMENTS", 1)  # one sequence per chunk
    parts = head_mechanism(model, data, batch_size=2)
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
        acc.update(x, P, out)
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


def test_dvar_is_the_relative_change_of_the_within_sequence_variance():
    h, _ = _hand_set(-0.5)
    attn = Attention(8, 1, num_laplacian_heads=1, qkv_bias=False, proj_bias=False, fused=False)
    g = torch.Generator().manual_seed(0)  # the same x as _hand_set's
    with torch.no_grad():
        attn.qkv.weight.copy_(torch.randn(24, 8, generator=g) / math.sqrt(8))
    xs = [torch.randn(4, 10, 8, generator=g).double() for _ in range(3)]
    qk = attn.qkv.weight.double()
    W = lambda z: ((z - z.mean(1, keepdim=True)) ** 2).sum()  # noqa: E731 (summed over sequences)
    before = after = 0.0
    for x in xs:
        q, k = x @ qk[:8].T, x @ qk[8:16].T
        P = ((q @ k.transpose(1, 2)) / math.sqrt(8)).softmax(-1)
        before, after = before + W(x), after + W(x + 0.5 * (P @ x - x))
    assert h["dvar"] == pytest.approx(((after - before) / before).item(), rel=1e-5)


def test_sym_eigenvalues_are_those_of_the_full_matrix():
    g = torch.Generator().manual_seed(3)
    A, B = torch.randn(20, 4, generator=g, dtype=torch.float64), torch.randn(4, 20, generator=g, dtype=torch.float64)
    M = A @ B
    full = torch.linalg.eigvalsh((M + M.T) / 2)
    nonzero = full[full.abs() > 1e-9]
    assert len(nonzero) == 8
    torch.testing.assert_close(sym_eigenvalues(A, B), nonzero)


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
                             "trace_fro.softmax": 0.1}
    md = to_markdown({"model": "m", "heads": heads, "n_tokens": 10, "n_sequences": 2})
    assert "| blocks.0 | 1 | laplacian | +0.600 | +0.500 | -0.0200 | 0.900 | -1.000 |" in md
    assert "| laplacian | +0.6000 | +0.5000 | -0.0200 | +0.9000 | -1.0000 |" in md


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
    assert mech["n_sequences"] == 64 and mech["n_tokens"] == 64 * 17 and mech["batch_size"] == 16
    assert mech["recon_err"] < 1e-5 and list(mech["heads"]) == ["blocks.0", "blocks.1"]
    assert [h["type"] for h in mech["heads"]["blocks.1"]] == ["softmax", "softmax", "laplacian"]
    assert "[analysis] mechanism: 1,088 tokens" in analysed["stdout"]
    # the same numbers in-process on the same split
    model, _, data = load_for_analysis(analysed["ckpt"], device="cpu")
    ds, _ = eval_split(model, data, seed=0, max_tokens=1100)
    again = head_mechanism(model, ds, batch_size=64)
    for layer, hs in again.items():
        for got, want in zip(mech["heads"][layer], hs):
            for key in ("cos_smooth", "cos_token", "dvar", "neg_mass", "trace_fro", "eig_min"):
                assert got[key] == pytest.approx(want[key], rel=1e-6, abs=1e-9), (layer, key)
    md = (out / "mechanism.md").read_text()
    assert "| blocks.1 | 2 | laplacian |" in md and "Means over the heads" in md
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
