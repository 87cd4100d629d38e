"""`python -m analysis` on tiny checkpoints: the analysis.json layout, the ANOVA identities, the
streamed per-layer values against the in-memory metrics on the same features, the figures, the
one-line errors, and the quick start's geometry columns."""
from __future__ import annotations

import json
from pathlib import Path
import os
import subprocess
import sys

import pytest
import torch

import laplace
from hydra import compose, initialize_config_dir

from analysis import metrics as m
from analysis.__main__ import analysis_dir, run as analysis_run
from analysis.geometry import eval_split, load_for_analysis
from conftest import CONFIGS, ROOT, per_sequence_spectra, save_tiny_gpt, train_tiny_vit

VIT_ARGS = ["max_tokens=1100", "batch_size=24", "pca_maps=2"]  # 64 images of 17 tokens, 3 uneven batches
FIGURES = ("anova", "collapse", "spectrum")


def _tiny_vit(model: str, tmp) -> str:
    return str(train_tiny_vit(tmp, model))


def _analysis(*args):
    return subprocess.run([sys.executable, "-m", "analysis", *args, "cpu_threads=1", "progress=false"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def vit(tmp_path_factory):
    """Two 2-step tiny ViTs (0 and 3 Laplacian heads) analysed in one call."""
    tmp = tmp_path_factory.mktemp("vit")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # module fixtures run before conftest's per-test thread setting
    try:
        ckpts = [_tiny_vit(name, tmp) for name in ("vitt_0L", "vitt_3L")]
    finally:
        torch.set_num_threads(threads)
    proc = _analysis(f"checkpoint=[{','.join(ckpts)}]", f"analysis_out={tmp / 'compare'}", *VIT_ARGS)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = [json.loads((analysis_dir(c) / "analysis.json").read_text()) for c in ckpts]
    return {"ckpts": ckpts, "results": results, "compare": tmp / "compare", "stdout": proc.stdout}


def _approx(a, b, rel=1e-4):
    assert a == pytest.approx(b, rel=rel, abs=1e-8)


def test_vit_analysis_json_layout(vit):
    r0, r3 = vit["results"]
    assert (r0["model"], r0["num_laplacian_heads"], r3["num_laplacian_heads"]) == ("vitt_d2_w48_0L", 0, 3)
    assert r0["arch"] == "vit" and r0["layers"] == ["blocks.0", "blocks.1", "norm"]
    assert r0["n_sequences"] == 64 and r0["n_tokens"] == 64 * 17 == r0["throughput"]["tokens"]
    assert r0["throughput"]["tokens_per_s"] > 0 and r0["throughput"]["peak_rss_mib"] > 0
    for layer in r0["layers"]:
        patch, cls = r0["results"]["patch"][layer], r0["results"]["cls"][layer]
        assert set(patch) == {"anova", "cdnv", "spectral", "spectral_within", "spectral_per_seq", "nc"}
        assert patch["spectral_per_seq"]["n_sequences"] == 64 and patch["spectral_per_seq"]["n_no_variance"] == 0
        assert set(cls) == {"nc", "cdnv", "spectral"}
        a = patch["anova"]
        _approx(a["within_seq"] + a["between_seq"], a["total"], rel=1e-10)
        _approx(a["within_class"] + a["between_class"], a["between_seq"], rel=1e-10)
        _approx(a["within_seq_share"] + a["within_class_share"] + a["between_class_share"], 1.0, rel=1e-10)
        assert len(patch["spectral"]["spectrum"]) == 48 and cls["nc"]["num_classes"] == 10
    assert "within_seq_share=" in vit["stdout"] and "tokens/s" in vit["stdout"]


def test_vit_streamed_equals_in_memory(vit):
    """Every layer's JSON values == analysis.metrics on the same features, computed here."""
    torch.set_num_threads(1)  # as the CLI ran: the same float32 reductions
    ckpt, res = vit["ckpts"][1], vit["results"][1]
    model, _, data = load_for_analysis(ckpt, device="cpu")
    ds, _ = eval_split(model, data, seed=0, max_tokens=1100)
    x = torch.stack([ds[i][0] for i in range(len(ds))])
    y = torch.tensor([ds[i][1] for i in range(len(ds))])
    with torch.no_grad():
        feats = laplace.features(model, x)
    W, b = model.head.weight, model.head.bias
    for layer in ("blocks.0", "norm"):
        f = feats[layer].double()
        patches, cls = f[:, 1:], f[:, 0]
        P = patches.shape[1]
        seq, lab = torch.arange(64).repeat_interleave(P), y.repeat_interleave(P)
        got_patch, got_cls = res["results"]["patch"][layer], res["results"]["cls"][layer]
        ref = {"anova": m.anova(patches, seq, lab), "cdnv": m.cdnv(patches, lab),
               "spectral": m.spectral_decay(patches),
               "spectral_within": m.spectral_decay(patches, seq_ids=seq, center="sequence"),
               "spectral_per_seq": per_sequence_spectra(patches, seq),
               "nc": m.neural_collapse(patches.mean(1), y, W, b)}
        ref_cls = {"nc": m.neural_collapse(cls, y, W, b), "cdnv": m.cdnv(cls, y), "spectral": m.spectral_decay(cls)}
        for got, want in ((got_patch, ref), (got_cls, ref_cls)):
            for group, values in want.items():
                for key, v in values.items():
                    if key == "spectrum":
                        assert got[group][key][:5] == pytest.approx(v[:5], rel=1e-4)
                    elif group == "spectral_per_seq" and key.startswith("n_pcs_"):  # a mean of counts
                        assert got[group][key] == pytest.approx(v, abs=1e-12), (layer, group, key)
                    elif key.startswith("n_pcs_") or key == "num_classes":
                        assert got[group][key] == v, (layer, group, key)
                    else:
                        _approx(got[group][key], v)


def test_vit_figures(vit):
    for folder in [analysis_dir(c) for c in vit["ckpts"]] + [vit["compare"]]:
        for name in FIGURES:
            for ext in ("png", "pdf"):
                assert (folder / f"{name}.{ext}").stat().st_size > 5000, folder / f"{name}.{ext}"
    assert (vit["compare"] / "pca_maps.png").stat().st_size > 5000
    summary = json.loads((vit["compare"] / "summary.json").read_text())
    assert [r["model"] for r in summary["runs"]] == ["vitt_d2_w48_0L", "vitt_d2_w48_3L"]
    assert all(r["nc1"] > 0 and 0 < r["within_seq_share"] < 1 for r in summary["runs"])


def test_an_exported_folder_is_analysed_as_its_checkpoint(vit, tmp_path):
    """python -m analysis checkpoint=<a folder python -m laplace.export wrote> (issue 47): the same
    numbers as its checkpoint's analysis; the data node from the export's config.json when it
    records one, else data=<name>, and without it one line saying so."""
    from laplace.checkpoint import read_export_config
    from laplace.export import export

    folder = export(vit["ckpts"][1], tmp_path / "exports" / "vitt_3L")
    args = [a for a in VIT_ARGS if not a.startswith("pca_maps")] + ["figures=false"]
    if not read_export_config(folder).get("data"):
        bad = _analysis(f"checkpoint={folder}", *args)
        err = bad.stderr.strip().splitlines()
        assert bad.returncode == 1 and len(err) == 1, bad.stderr[-2000:]
        assert err[0].startswith(f"error: checkpoint={folder}: it records no data node; pass data=<name>")
        args.append("data=digits")  # the data the tiny ViTs trained on
    proc = _analysis(f"checkpoint={folder}", *args)
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads((analysis_dir(folder) / "analysis.json").read_text())
    assert analysis_dir(folder) == tmp_path / "exports" / "vitt_3L_analysis"
    want = vit["results"][1]
    assert (res["model"], res["num_laplacian_heads"], res["n_tokens"]) == (want["model"], 3, want["n_tokens"])
    for layer in want["layers"]:
        for kind, group, key in (("patch", "anova", "within_seq_share"), ("patch", "nc", "nc1"),
                                 ("cls", "nc", "nc1"), ("patch", "spectral", "n_pcs_0.99")):
            _approx(res["results"][kind][layer][group][key], want["results"][kind][layer][group][key], rel=1e-6)
    assert res["mechanism"]["summary"]["cos_smooth.laplacian"] == pytest.approx(
        want["mechanism"]["summary"]["cos_smooth.laplacian"], rel=1e-6)


def test_gpt_checkpoint(tmp_path):
    ckpt = save_tiny_gpt(tmp_path / "gpt" / "ckpt" / "last.pt")
    proc = _analysis(f"checkpoint={ckpt}", "max_tokens=2048", "batch_size=12", "min_count=2")
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads((analysis_dir(ckpt) / "analysis.json").read_text())
    assert res["arch"] == "gpt" and res["num_laplacian_heads"] == 1 and res["n_tokens"] == 32 * 64
    assert set(res["results"]) == {"tokens"} and res["layers"] == ["blocks.0", "blocks.1", "norm"]
    for name in FIGURES:
        assert (analysis_dir(ckpt) / f"{name}.png").stat().st_size > 5000

    torch.set_num_threads(1)
    model, _, data = load_for_analysis(ckpt, device="cpu")
    ds, _ = eval_split(model, data, seed=0, max_tokens=2048)
    x = torch.stack([ds[i][0] for i in range(len(ds))])
    nxt = torch.stack([ds[i][1] for i in range(len(ds))]).reshape(-1)
    with torch.no_grad():
        f = laplace.features(model, x)["norm"].double()
    seq = torch.arange(len(ds)).repeat_interleave(64)
    got = res["results"]["tokens"]["norm"]
    assert set(got) == {"anova", "lc", "spectral", "spectral_within", "spectral_per_seq"}
    for key, v in m.anova(f, seq).items():
        _approx(got["anova"][key], v)
    lc = m.linguistic_collapse(f, nxt, unembedding=model.lm_head.weight, min_count=2)
    for key in ("lc_num_classes", "lc_cdnv_mean", "lc_equinorm", "lc_coherence_std", "lc_self_duality"):
        _approx(got["lc"][key], lc[key])
    assert got["spectral"]["n_pcs_0.99"] == m.spectral_decay(f)["n_pcs_0.99"]
    assert got["spectral_within"]["n_pcs_0.99"] == m.spectral_decay(f, seq_ids=seq, center="sequence")["n_pcs_0.99"]
    per_seq = per_sequence_spectra(f, seq)
    assert got["spectral_per_seq"]["n_sequences"] == 32
    assert got["spectral_per_seq"]["n_pcs_0.99"] == pytest.approx(per_seq["n_pcs_0.99"], abs=1e-12)


def test_a_glob_and_skip_done_measure_only_what_is_missing(vit, tmp_path, monkeypatch, capsys):
    """checkpoint= as a quoted glob finds a sweep's checkpoints (sorted); skip_done leaves out those
    whose analysis.json exists, so a re-run of a sweep's analyses resumes; a glob matching nothing
    is one line."""
    import analysis.__main__ as cli

    folder = Path(vit["ckpts"][0]).parent.parent.parent  # <tmp>/<run>/ckpt/last.pt
    measured = []
    monkeypatch.setattr(cli, "analyze_checkpoint", lambda p, **kw: measured.append(p) or pytest.fail("re-measured"))
    with initialize_config_dir(config_dir=CONFIGS, version_base="1.3"):
        cfg = compose("analysis", overrides=[f"checkpoint='{folder}/*/ckpt/last.pt'", "skip_done=true",
                                             "progress=false", "figures=false"])
        assert cli._checkpoints(cfg) == sorted(Path(c) for c in vit["ckpts"])
        assert cli.run(cfg) == [] and not measured
        assert "[analysis] skip_done: 2 checkpoints analysed already, 0 to go" in capsys.readouterr().out
        bad = compose("analysis", overrides=[f"checkpoint='{tmp_path}/*/ckpt/last.pt'", "progress=false"])
    with pytest.raises(ValueError, match=r"checkpoint=.*: the pattern matches no file"):
        cli.run(bad)


def test_missing_checkpoint_is_one_line(tmp_path):
    proc = _analysis(f"checkpoint={tmp_path / 'nope.pt'}")
    err = proc.stderr.strip().splitlines()
    assert proc.returncode != 0 and err and err[-1].startswith("error: checkpoint=")
    assert "no such file" in err[-1] and "ckpt/last.pt" in err[-1], proc.stderr[-2000:]


@pytest.mark.parametrize("overrides,expect", [
    ([], "checkpoint is required"),
    (["checkpoint=x.pt", "metrics=[anova,nc9]"], "unknown metric 'nc9'"),
    (["checkpoint=GPT", "layers=[5]"], "layers=[5]: 5 is not a block index"),
    (["checkpoint=GPT", "metrics=[]"], "nothing to do"),
    (["checkpoint=GPT", "spectrum_layer=blocks.7"], "spectrum_layer=blocks.7: not a measured layer"),
])
def test_bad_input_messages(overrides, expect, tmp_path):
    ckpt = save_tiny_gpt(tmp_path / "last.pt")
    with initialize_config_dir(config_dir=CONFIGS, version_base="1.3"):
        cfg = compose("analysis", overrides=[o.replace("GPT", ckpt) for o in overrides] + ["progress=false"])
    with pytest.raises(ValueError, match=expect.replace("[", r"\[").replace("]", r"\]")):
        analysis_run(cfg)


# Its subprocess may take 600 s under load; the per-test limit stays above it.
@pytest.mark.timeout(900)
@pytest.mark.slow
def test_quickstart_prints_geometry(tmp_path):
    """The three paradigms' tables: the ViT pair, the LM pair (BPE and shards prepared on the
    way) and the DINO pair with its k-NN accuracies and PCA maps."""
    proc = subprocess.run([sys.executable, "scripts/quickstart.py", "trainer.max_steps=2",
                           f"paths.runs_dir={tmp_path}", f"paths.data_dir={tmp_path / 'data'}",
                           "vit.model.depth=2", "vit.model.embed_dim=48", "vit.trainer.global_batch_size=32",
                           "lm.data.seq_len=64", "trainer.num_workers=0", "dino.model.depth=1",
                           "dino.trainer.head.out_dim=64", "dino.trainer.head.hidden_dim=32",
                           "analysis.max_tokens=1000", "analysis.cpu_threads=1"],
                          cwd=ROOT, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "LAPLACE_INSTALL_SECONDS": "7"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    vit, lm, dino = [i for i, ln in enumerate(lines) if ln.startswith("model ")]
    assert all(c in lines[vit] for c in ("within-seq share", "NC1 (cls)", "n_pcs_0.99"))
    rows = [ln.split() for ln in lines[vit + 1:vit + 3]]
    assert [r[0] for r in rows] == ["vitt_0L", "vitt_3L"]
    for r in rows:
        share, nc1, npcs = float(r[4]), float(r[5]), float(r[6])
        assert 0 < share < 1 and nc1 > 0 and 1 <= npcs <= 48
    assert all(c in lines[lm] for c in ("val bpb", "within-seq share", "next-tok CDNV"))
    rows = [ln.split() for ln in lines[lm + 1:lm + 3]]
    assert [(r[0], r[1]) for r in rows] == [("gpt_d2_0L", "0"), ("gpt_d2_1L", "1")]
    for r in rows:
        bpb, share = float(r[2]), float(r[4])
        assert 0 < bpb < float(r[3]) and 0 < share < 1
    assert all(c in lines[dino] for c in ("20-NN top-1 (%)", "within-seq share", "NC1 (cls)"))
    rows = [ln.split() for ln in lines[dino + 1:dino + 3]]
    assert [(r[0], r[1]) for r in rows] == [("vits_0L", "0"), ("vits_5L", "5")]
    for r in rows:
        top1, share = float(r[2]), float(r[4])
        assert 0 <= top1 <= 100 and 0 < share < 1
    assert (tmp_path / "data" / "pydoc_bpe" / "tokenizer.json").exists()
    for paradigm in ("vit", "lm", "dino"):
        assert (tmp_path / "quickstart" / paradigm / "analysis" / "spectrum.png").exists()
    assert (tmp_path / "quickstart" / "dino" / "analysis" / "pca_maps.png").exists()  # both models' rows
    # the closing table: the install's time (from scripts/env.sh), one row per command, the totals
    head = next(i for i, ln in enumerate(lines) if ln.startswith("Stage times on "))
    assert "cores, torch CPU kernels" in lines[head]  # the machine the times are of
    stages = lines[head + 2:]
    names = [ln[:42].strip() for ln in stages]
    assert names == ["install (.venv; 0 when already there)", "train vitt_0L", "train vitt_3L",
                     "prepare (BPE 4096, shards)", "train gpt_d2_0L", "train gpt_d2_1L", "train vits_0L",
                     "train vits_5L", "analysis vit", "analysis lm", "analysis dino", "k-NN vits_0L",
                     "k-NN vits_5L", "total after the install", "total"]
    assert stages[0].split()[-1] == "0:07.0"
    walls = [60 * float(m) + float(s) for m, s in (ln.split()[-2].split(":") for ln in stages[1:-2])]
    cpus = [float(ln.split()[-1]) for ln in stages[1:-2]]
    assert all(w > 0 for w in walls) and sum(cpus) > 0
