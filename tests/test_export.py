"""Shareable weights: `python -m laplace.export` folders load back with equal logits through
`laplace.load_model` / `laplace.from_pretrained`, a ViT without Laplacian heads also through
plain timm; the card and config say what the model is; bad folders and hub ids are one line."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import timm
import torch

import laplace
from conftest import ROOT, randomize_
from laplace.checkpoint import CheckpointError, save_checkpoint
from laplace.errors import ConfigError
from huggingface_hub import ModelCard
from laplace.export import CITATION, export
from laplace.zoo import create_model

ENV = {**os.environ, "PYTHONPATH": str(ROOT)}
VIT0 = {"name": "vitt_0L", "depth": 2, "embed_dim": 48, "img_size": 32, "patch_size": 4, "num_classes": 10,
        "qk_norm": True}
VIT2 = {"name": "vitt_2L", "depth": 2, "embed_dim": 48, "img_size": 32, "patch_size": 4, "num_classes": 10,
        "num_laplacian_heads": [1, 2]}
GPT = {"name": "gpt_d2_1L", "vocab_size": 64, "max_seq_len": 16}
DATA = {"name": "cifar100", "mean": [0.5071, 0.4865, 0.4409], "std": [0.2673, 0.2564, 0.2762],
        "eval_crop_pct": 1.0}


def _checkpoint(tmp_path: Path, node: dict, data: dict, experiment: str = "deit3_cifar100",
                trainer: str = "deit3") -> tuple[Path, torch.nn.Module]:
    """A checkpoint as train.py lays it out: <runs>/<trainer>/<experiment>/<model>_s0/ckpt/last.pt."""
    run = tmp_path / "runs" / trainer / experiment / f"{node['name']}_s0"
    model = randomize_(create_model(**node)).eval()
    path = save_checkpoint(run / "ckpt" / "last.pt", model=model, loop={"step": 40},
                           config={"model": node, "data": data, "run_dir": str(run), "trainer": {"name": trainer}})
    return path, model


def _images(n=2):
    return torch.randn(n, 3, 32, 32, generator=torch.Generator().manual_seed(1))


def test_vit_without_laplacian_heads_round_trips_and_loads_in_plain_timm(tmp_path):
    ckpt, model = _checkpoint(tmp_path, VIT0, DATA)
    run = ckpt.parent.parent
    (run / "results.json").write_text(json.dumps({
        "model": "vitt_0L", "num_laplacian_heads": 0, "dataset": "cifar100", "checkpoint": str(ckpt),
        "steps": 40, "final": {"val_top1": 61.25, "val_loss": 1.5}, "best": {"val_top1": 62.5, "step": 30}}))
    (run / "eval" / "knn_cifar100").mkdir(parents=True)
    (run / "eval" / "knn_cifar100" / "results.json").write_text(json.dumps({
        "model": "vitt_0L", "dataset": "cifar100", "checkpoint": str(ckpt), "protocol": "knn", "k": 20,
        "knn": {"top1": 44.5, "top5": 80.0, "per_k": {"20": {"top1": 44.5}}}}))
    (run / "eval" / "knn_other").mkdir(parents=True)  # measured on another checkpoint: not this export's
    (run / "eval" / "knn_other" / "results.json").write_text(json.dumps({
        "model": "vitt_0L", "dataset": "cifar10", "checkpoint": str(run / "ckpt" / "step_10.pt"),
        "knn": {"top1": 11.0}}))
    out = export(ckpt, tmp_path / "export")
    assert sorted(p.name for p in out.iterdir()) == ["README.md", "config.json", "model.safetensors"]
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no temp folder left

    x = _images()
    with torch.no_grad():
        want = model(x)
        assert torch.equal(laplace.load_model(out)(x), want)
        assert torch.equal(laplace.from_pretrained(out)(x), want)
        assert torch.equal(laplace.load_model(ckpt)(x), want)  # the .pt path is unchanged
        # plain timm, both ways: the local-dir scheme, and the architecture + its args + the file
        t1 = timm.create_model(f"local-dir:{out}", pretrained=True).eval()
        cfg = json.loads((out / "config.json").read_text())
        # (the overlay needs num_classes: timm drops a head whose size differs from its pretrained_cfg's)
        t2 = timm.create_model(cfg["architecture"], pretrained=True, **cfg["model_args"],
                               pretrained_cfg_overlay=dict(file=str(out / "model.safetensors"),
                                                           num_classes=cfg["num_classes"])).eval()
        assert type(t1).__module__.startswith("timm.") and type(t2) is type(t1)
        torch.testing.assert_close(t1(x), want, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(t2(x), want, rtol=1e-5, atol=1e-6)

    assert cfg["laplace"]["model"] == VIT0 and cfg["laplace"]["timm"] is True
    assert cfg["laplace"]["source"]["experiment"] == "deit3_cifar100" and cfg["laplace"]["source"]["step"] == 40
    assert cfg["laplace"]["source"]["run"] == "vitt_0L_s0" and cfg["laplace"]["source"]["checkpoint"] == "ckpt/last.pt"
    assert str(tmp_path) not in (out / "config.json").read_text() + (out / "README.md").read_text()
    assert cfg["pretrained_cfg"]["mean"] == DATA["mean"] and cfg["pretrained_cfg"]["input_size"] == [3, 32, 32]
    assert "license" not in cfg["pretrained_cfg"]  # the ImageNet weights' licence is not these weights'
    card = (out / "README.md").read_text()
    assert "k = 0 of 3 heads per layer" in card and CITATION in card and "arXiv:2602.09297" in card
    assert "`experiment=deit3_cifar100` (its recipe card: docs/recipes/deit3_cifar100.md" in card
    assert "| results.json | cifar100 | validation after the last training step | final/val_top1 | 61.25 |" in card
    assert "| results.json | cifar100 | best validation during training | best/val_top1 | 62.5 |" in card
    assert "best/step" not in card
    assert ("| eval/knn_cifar100/results.json | cifar100 | weighted k-NN on frozen class tokens (DINO) | knn/top1 "
            "| 44.5 |") in card
    assert "knn_other" not in card and "per_k" not in card
    assert 'timm.create_model("local-dir:<this folder>", pretrained=True)' in card
    # k = 0 is the baseline: the card must not claim Laplacian heads; the Hub's metadata is there
    assert "with ordinary attention only (k = 0" in card and "with Laplacian heads" not in card
    meta = ModelCard.load(out / "README.md").data
    assert (meta.license, meta.library_name, meta.datasets) == ("mit", "timm", ["uoft-cs/cifar100"])
    assert {"laplace", "laplacian-heads", "image-classification"} <= set(meta.tags)


def test_a_headless_backbone_without_layerscale_loads_in_timm(tmp_path):
    """What DINO exports (num_classes=0: class-token features), here without LayerScale."""
    node = dict(VIT0, num_classes=0, init_values=0, pos_embed_resample="dino")  # 0: no LayerScale
    ckpt, model = _checkpoint(tmp_path, node, DATA, experiment="dino_digits", trainer="dino")
    out = export(ckpt, tmp_path / "export")
    x = _images()
    with torch.no_grad():
        want = model(x)
        assert want.shape == (2, 48) and torch.equal(laplace.load_model(out)(x), want)
        t = timm.create_model(f"local-dir:{out}", pretrained=True).eval()
        assert isinstance(model.blocks[0].ls1, torch.nn.Identity) and isinstance(t.blocks[0].ls1, torch.nn.Identity)
        torch.testing.assert_close(t(x), want, rtol=1e-5, atol=1e-6)
    card = (out / "README.md").read_text()
    assert "pipeline_tag: image-feature-extraction" in card and "no classes, no LayerScale, QK-norm on" in card


def test_laplacian_vit_round_trips_and_loads_in_timm_once_laplace_is_imported(tmp_path):
    ckpt, model = _checkpoint(tmp_path, VIT2, DATA)
    out = export(ckpt, tmp_path / "export")
    x = _images()
    with torch.no_grad():
        assert torch.equal(laplace.load_model(out)(x), model(x))
        assert torch.equal(laplace.from_pretrained(str(out))(x), model(x))
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["laplace"]["timm"] is False and cfg["architecture"] == "vitt_2L"  # the zoo's name, not timm's
    # `import laplace` registers the zoo's names with timm, so timm builds and loads it as it is
    with torch.no_grad():
        assert torch.equal(timm.create_model(f"local-dir:{out}", pretrained=True).eval()(x), model(x))
    card = (out / "README.md").read_text()
    assert "k = [1, 2] of 3 heads per layer" in card and "## Metrics" not in card  # no results.json in the run
    assert "A Vision Transformer with Laplacian heads" in card
    assert "timm builds it only where laplace's models are registered with timm: vitt_d2_w48_1-2L has Laplacian heads" in card
    meta = ModelCard.load(out / "README.md").data
    assert (meta.license, meta.library_name, meta.datasets) == ("mit", "laplace", ["uoft-cs/cifar100"])
    assert cfg["laplace"]["timm_unsupported"].startswith("vitt_d2_w48_1-2L has Laplacian heads ([1, 2] per layer)")


@pytest.mark.parametrize("k,label,arch", [(3, "vitt_d2_w48_3L", "vitt_3L"), ([1, 2], "vitt_d2_w48_1-2L", "vitt_2L")])
def test_a_family_node_exports_under_its_label_and_timm_builds_its_laplacian_heads(tmp_path, k, label, arch):
    """A node as train.py writes it names the family ("vitt") and holds k: config.json's timm
    `architecture` and the card's title are the label, so timm's local-dir load builds the model
    with its Laplacian heads (a per-layer k: the registered name with the most heads, and model_args'
    list sets each layer); it used to say "vitt", which timm does not know."""
    node = dict(VIT2, name="vitt", num_laplacian_heads=k)
    ckpt, model = _checkpoint(tmp_path, node, DATA)
    out = export(ckpt, tmp_path / "export")
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architecture"] == arch and cfg["laplace"]["model"] == node
    card = (out / "README.md").read_text()
    assert f"\n# {label}\n" in card and f"timm builds it only where laplace's models are registered with timm: " \
                                        f"{label} has Laplacian heads" in card
    x = _images()
    with torch.no_grad():
        t = timm.create_model(f"local-dir:{out}", pretrained=True).eval()
        assert t.num_laplacian_heads == ([k, k] if isinstance(k, int) else k)
        assert torch.equal(t(x), model(x)) and torch.equal(laplace.load_model(out)(x), model(x))


def test_gpt_round_trips(tmp_path):
    data = {"name": "pydoc_text", "tokenizer": "bytes"}
    ckpt, model = _checkpoint(tmp_path, GPT, data, experiment="gpt_pydoc", trainer="gpt")
    out = export(ckpt, tmp_path / "export")
    idx = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(laplace.load_model(out)(idx), model(idx))
        assert torch.equal(laplace.from_pretrained(out)(idx), model(idx))
    card = (out / "README.md").read_text()
    assert "nanochat GPT" in card and "k = 1 of 1 heads per layer" in card and "- Tokenizer: bytes (" in card
    assert json.loads((out / "config.json").read_text())["laplace"]["tokenizer"] == "bytes"
    assert "gpt_d2_1L is a language model" in card and CITATION in card
    assert "pipeline_tag: text-generation" in card and "- Trainer: gpt" in card
    assert "`experiment=gpt_pydoc` (its recipe card: docs/recipes/gpt_pydoc.md" in card
    with pytest.raises(RuntimeError, match=r"Unknown model \(gpt_d2_1L\)"):  # timm's one line: it has no GPT
        timm.create_model(f"local-dir:{out}", pretrained=True)


def test_an_existing_out_is_refused_unless_overwrite(tmp_path):
    ckpt, _ = _checkpoint(tmp_path, VIT0, DATA)
    out = export(ckpt, tmp_path / "export")
    before = (out / "model.safetensors").read_bytes()
    with pytest.raises(ConfigError, match=rf"out={out} exists and is not empty; choose another folder or pass "
                                          rf"overwrite=true"):
        export(ckpt, out)
    (tmp_path / "afile").write_text("x")
    with pytest.raises(ConfigError, match="out=.*afile is a file"):
        export(ckpt, tmp_path / "afile")
    other = save_checkpoint(tmp_path / "b.pt", model=randomize_(create_model(**VIT0), seed=3),
                            config={"model": VIT0, "data": DATA})
    export(other, out, overwrite=True)
    assert (out / "model.safetensors").read_bytes() != before
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []  # old and temp gone
    (tmp_path / "empty").mkdir()
    assert (export(ckpt, tmp_path / "empty") / "config.json").is_file()  # an empty folder is fine


def test_command_line_writes_the_folder_and_errors_are_one_line(tmp_path):
    from laplace.export import _main

    ckpt, _ = _checkpoint(tmp_path, VIT0, DATA)
    out = tmp_path / "export"

    def cli(*args):
        return subprocess.run([sys.executable, "-m", "laplace.export", *args], cwd=ROOT, env=ENV,
                              capture_output=True, text=True, timeout=180)

    p = cli(f"checkpoint={ckpt}", f"out={out}")
    assert p.returncode == 0, p.stderr[-2000:]
    assert (out / "model.safetensors").is_file() and f"exported {ckpt} to {out}" in p.stdout
    assert p.stderr == ""  # no warning either (runpy's, were laplace.export imported by `import laplace`)
    p = cli(f"checkpoint={ckpt}", f"out={out}")
    assert p.returncode == 1 and p.stderr.strip().splitlines() == [
        f"error: out={out} exists and is not empty; choose another folder or pass overwrite=true"], p.stderr[-2000:]
    usage = r"\(?usage: python -m laplace.export checkpoint=PATH out=DIR \[overwrite=true\]\)?"
    for args, pattern in [
        ((f"checkpoint={tmp_path / 'no.pt'}", f"out={tmp_path / 'x'}"), rf"^no checkpoint at {tmp_path / 'no.pt'}$"),
        ((f"checkpoint={ckpt}",), rf"^out= is required; {usage}$"),
        ((f"checkpoint={ckpt}", f"out={out}", "overwite=true"),
         rf"^unknown key 'overwite'; valid: checkpoint, out, overwrite {usage}$"),
        ((f"checkpoint={ckpt}", f"out={out}", "overwrite=maybe"), r"^overwrite='maybe': choose true or false$"),
        ((str(ckpt),), rf"is not key=value; {usage}$"),
    ]:
        with pytest.raises(ConfigError if "no.pt" not in args[0] else CheckpointError, match=pattern):
            _main(list(args))
    assert _main([f"checkpoint={ckpt}", f"out={out}", "overwrite=true"]) == out


def test_a_corrupt_or_foreign_folder_is_one_line(tmp_path):
    ckpt, model = _checkpoint(tmp_path, VIT0, DATA)
    good = export(ckpt, tmp_path / "good")

    def refused(folder: Path, pattern: str):
        with pytest.raises(CheckpointError, match=pattern) as e:
            laplace.load_model(folder)
        assert "\n" not in str(e.value)

    (tmp_path / "empty").mkdir()
    refused(tmp_path / "empty", r"empty is a folder without config.json, not an exported laplace model; write "
                                r"one with `python -m laplace.export")
    foreign = tmp_path / "timm_folder"  # what timm's own save_for_hf writes
    from timm.models import save_for_hf
    save_for_hf(timm.create_model("vit_tiny_patch16_224", img_size=32, patch_size=4, depth=1), str(foreign),
                safe_serialization=True)
    refused(foreign, r"timm_folder/config.json is not a laplace export's \(no laplace.format='laplace-export'\); "
                     r"a timm folder loads with timm.create_model\('local-dir:")
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text('{"laplace": {"format": "laplace-')
    refused(broken, r"broken/config.json is not readable JSON \(corrupt or truncated\)")
    newer = tmp_path / "newer"
    newer.mkdir()
    (newer / "config.json").write_text(json.dumps({"laplace": {"format": "laplace-export", "version": 99}}))
    refused(newer, r"export version 99, not one this code reads \(<= 1\); update laplace")
    no_weights = tmp_path / "no_weights"
    no_weights.mkdir()
    (no_weights / "config.json").write_bytes((good / "config.json").read_bytes())
    refused(no_weights, r"no_weights has config.json but no model.safetensors; copy the whole exported folder")
    truncated = tmp_path / "truncated"
    truncated.mkdir()
    (truncated / "config.json").write_bytes((good / "config.json").read_bytes())
    (truncated / "model.safetensors").write_bytes((good / "model.safetensors").read_bytes()[:1000])
    refused(truncated, r"truncated/model.safetensors is not a readable safetensors file \(corrupt or truncated\)")
    other = tmp_path / "other"  # weights of another shape than its config.json's model
    other.mkdir()
    (other / "config.json").write_text((good / "config.json").read_text().replace('"num_classes": 10',
                                                                                    '"num_classes": 11'))
    (other / "model.safetensors").write_bytes((good / "model.safetensors").read_bytes())
    refused(other, r"other/model.safetensors does not match model 'vitt_0L' of its config.json: .*head")


def test_a_hub_id_offline_or_malformed_is_one_line(tmp_path):
    """No network here: offline (HF_HUB_OFFLINE=1, an empty cache) the Hub id is looked up in the
    cache only and refused in one line that says so; a name that is neither a folder nor an id too."""
    code = ("import laplace\nfrom laplace.checkpoint import CheckpointError\n"
            "for name in ['laplace-org/vitt_0L', 'no/such/folder']:\n"
            "    try:\n        laplace.from_pretrained(name)\n    except CheckpointError as e:\n        print(e)\n")
    env = {**ENV, "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf")}
    p = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-2000:]
    lines = p.stdout.strip().splitlines()
    assert len(lines) == 2, p.stdout
    assert lines[0].startswith("laplace-org/vitt_0L: no such local folder, and the Hugging Face Hub did not give it: ")
    assert "HF_HUB_OFFLINE" in lines[0]
    assert lines[1] == "no/such/folder: no such file or folder, and not a Hugging Face Hub id (org/name)"


def test_a_trained_run_exports_with_its_results(make_cfg, tmp_path):
    """A real two-step run on the built-in digits: its config, checkpoint and results.json as the
    trainer wrote them; the card carries its measured numbers and timm loads the export."""
    from conftest import TINY_VIT
    from train import run

    run_dir = tmp_path / "runs" / "deit3" / "digits" / "vitt_0L_s0"
    cfg = make_cfg("model=vitt_0L", *TINY_VIT, "trainer.max_steps=2", run_dir=run_dir)
    metrics = run(cfg)
    out = export(run_dir / "ckpt" / "last.pt", tmp_path / "export")
    card = (out / "README.md").read_text()
    assert f"| results.json | digits | validation after the last training step | final/val_acc1 | " \
           f"{metrics['val_acc1']:.6g} |" in card
    assert "Recipe:" not in card and "- Data: digits" in card and "- Steps: 2" in card
    model = laplace.load_model(run_dir / "ckpt" / "last.pt")
    x = torch.randn(2, 3, cfg.data.img_size, cfg.data.img_size, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = model(x)
        assert torch.equal(laplace.from_pretrained(out)(x), want)
        torch.testing.assert_close(timm.create_model(f"local-dir:{out}", pretrained=True).eval()(x), want,
                                   rtol=1e-5, atol=1e-6)
    assert json.loads((out / "config.json").read_text())["pretrained_cfg"]["mean"] == list(cfg.data.mean)


@pytest.mark.parametrize("node,tensor", [(VIT0, "cls_token"), (VIT2, "blocks.1.attn.qkv.weight"),
                                         (GPT, "wte.weight")])
def test_non_finite_weights_are_refused_before_anything_is_written(tmp_path, node, tensor):
    """A diverged checkpoint (NaN in one tensor) is refused in one line naming the tensor: it used to
    export with rc 0 (vitt_2L, gpt_d2_1L), or fail in a traceback blaming timm (vitt_0L)."""
    ckpt, model = _checkpoint(tmp_path, node, DATA)
    sd = model.state_dict()
    sd[tensor].view(-1)[3] = float("nan")
    save_checkpoint(ckpt, model=model, config=torch.load(ckpt, weights_only=True)["config"])
    with pytest.raises(CheckpointError, match=rf"^checkpoint={ckpt}: {tensor} holds 1 NaN / inf value\(s\) of "
                                              rf"{sd[tensor].numel()}; nothing exported: export a finite checkpoint"):
        export(ckpt, tmp_path / "export")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["runs"]  # no folder, no hidden temp folder


def test_exported_files_are_readable_by_the_group(tmp_path):
    """safetensors writes its file 0600; an export's files get an ordinary file's modes (0644 under
    umask 022), so that a group on a shared file system can read them: timm's writer and ours."""
    old = os.umask(0o022)
    try:
        for node, name in ((VIT0, "timm"), (VIT2, "laplace")):
            out = export(_checkpoint(tmp_path / name, node, DATA)[0], tmp_path / name / "export")
            assert {p.name: oct(p.stat().st_mode & 0o777) for p in out.iterdir()} == {
                "README.md": "0o644", "config.json": "0o644", "model.safetensors": "0o644"}
    finally:
        os.umask(old)


# A child that exports and gets a signal once the weights are in the temp folder (a known point
# of a slow write: ViT-B's 343 MB took seconds), by patching the function that writes them.
SIGNALLED_EXPORT = """
import os, signal, sys
import laplace.export as ex
writer = getattr(ex, sys.argv[3])
def signalled(folder, *args):
    writer(folder, *args)
    os.kill(os.getpid(), getattr(signal, sys.argv[4]))
setattr(ex, sys.argv[3], signalled)
ex.main([f"checkpoint={sys.argv[1]}", f"out={sys.argv[2]}"])
"""


@pytest.mark.parametrize("node,writer", [(VIT0, "_save_for_timm"), (VIT2, "_save")])
def test_a_signal_during_the_write_leaves_nothing_and_a_kill_is_cleaned_up_next_time(tmp_path, node, writer):
    """SIGTERM (Slurm's scancel) in the middle of an export: status 143 and no temporary folder left
    (3 of 6 SIGTERMs used to leave a hidden .<name>.<hex>.tmp/); SIGKILL cannot be caught: its
    leftover is removed by the next export of the same folder."""
    ckpt, _ = _checkpoint(tmp_path, node, DATA)
    out = tmp_path / "export"

    def signalled(sig: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-c", SIGNALLED_EXPORT, str(ckpt), str(out), writer, sig], cwd=ROOT,
                              env=ENV, capture_output=True, text=True, timeout=180)

    p = signalled("SIGTERM")
    assert p.returncode == 128 + 15 and p.stderr.strip().splitlines() == ["interrupted by SIGTERM"], p.stderr[-2000:]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["runs"]
    p = signalled("SIGKILL")
    assert p.returncode == -9
    (left,) = [p for p in tmp_path.iterdir() if p.name != "runs"]
    assert left.name.startswith(".export.") and left.name.endswith(".tmp") and (left / "model.safetensors").is_file()
    export(ckpt, out)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["export", "runs"]


def test_a_gpt_export_carries_its_trained_tokenizer(tmp_path):
    """The run's BPE file goes into the folder (tokenizer.json; config.json names it, no local path
    anywhere), checked to be the one the run trained with; a retrained or missing file is refused."""
    from laplace.tokenizer import load_tokenizer, train_bpe

    texts = [f"def f{i}(x):\n    return x * {i} + {i * i}\n" for i in range(300)]
    path = tmp_path / "data" / "tokenizer.json"
    tok = train_bpe(texts, vocab_size=300, path=path)
    node = dict(GPT, vocab_size=300)
    run = tmp_path / "runs" / "gpt" / "gpt_pydoc" / "gpt_d2_1L_s0"
    ckpt = save_checkpoint(run / "ckpt" / "last.pt", model=randomize_(create_model(**node)), loop={"step": 3},
                           data_identity={"tokenizer": tok.fingerprint()[:16]},
                           config={"model": node, "data": {"name": "pydoc_bpe", "tokenizer": str(path)},
                                   "run_dir": str(run), "trainer": {"name": "gpt"}})
    out = export(ckpt, tmp_path / "export")
    assert load_tokenizer(out / "tokenizer.json").fingerprint() == tok.fingerprint()
    assert json.loads((out / "config.json").read_text())["laplace"]["tokenizer"] == "tokenizer.json"
    assert str(tmp_path) not in (out / "config.json").read_text() + (out / "README.md").read_text()
    assert "- Tokenizer: tokenizer.json in this folder" in (out / "README.md").read_text()
    train_bpe(texts[:100], vocab_size=290, path=path)  # another tokenizer under the same name
    with pytest.raises(CheckpointError, match=rf"^checkpoint={ckpt}: {path} is not the tokenizer the run trained with"):
        export(ckpt, tmp_path / "again")
    path.unlink()
    with pytest.raises(CheckpointError, match=rf"^checkpoint={ckpt}: its tokenizer cannot go with the export "
                                              rf"\(tokenizer file not found: looked for {path}"):
        export(ckpt, tmp_path / "again")
    assert not (tmp_path / "again").exists()


def test_the_card_links_the_code_it_was_trained_with(tmp_path, monkeypatch):
    """The metadata's `repository` is the checkout's origin when it is a plain https address (a
    clone's); an ssh address or one holding credentials is left out, as is a checkout without one."""
    import laplace.export as ex

    def remote(url):
        monkeypatch.setattr(ex, "git", lambda *args: url)  # laplace.checkpoint.git's output, stripped
        return ex.code_url()

    assert remote("https://github.com/org/laplace.git") == "https://github.com/org/laplace"
    assert remote("git@github.com:org/laplace.git") is None and remote("https://u:tok@github.com/o/l") is None
    assert remote("") is None
    monkeypatch.setattr(ex, "code_url", lambda: "https://github.com/org/laplace")
    out = export(_checkpoint(tmp_path, VIT2, DATA)[0], tmp_path / "export")
    assert ModelCard.load(out / "README.md").data.repository == "https://github.com/org/laplace"
    assert "trained with laplace (https://github.com/org/laplace)" in (out / "README.md").read_text()

