"""An export writes only a folder of its own, atomically and exclusively, and what an export folder
holds is checked before it is trusted (issue 53); one loader takes every kind of source (issue 52)."""
from __future__ import annotations

import json
import sys

import pytest
import timm
import torch

import laplace
from laplace.checkpoint import CheckpointError, save_checkpoint
from laplace.errors import ConfigError
from laplace.export import export
from test_export import DATA, GPT, VIT0, VIT2, _checkpoint, _images


# Issue 53, item 1: an export writes only a folder of its own, atomically and exclusively.
@pytest.mark.parametrize("where", ["run", "runs", "ckpt"])
def test_an_export_never_replaces_the_run_it_exports(tmp_path, where):
    """out=<the run> (or any folder above the checkpoint) with overwrite=true exited 0 and left only
    the export there: ckpt/, metrics.jsonl, results.json and train.log were gone."""
    ckpt, _ = _checkpoint(tmp_path, VIT0, DATA)
    run = ckpt.parent.parent
    for name in ("metrics.jsonl", "results.json", "train.log"):
        (run / name).write_text("{}\n")
    before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    out = {"run": run, "runs": tmp_path / "runs", "ckpt": run / "ckpt"}[where]
    for overwrite in (True, False):
        with pytest.raises(ConfigError, match=rf"^out={out} holds the checkpoint it would export \({ckpt}\); "
                                              r"write the export into a folder of its own, e.g. out=exports/vitt_0L_s0$"):
            export(ckpt, out, overwrite=overwrite)
    with pytest.raises(ConfigError, match=rf"^out={run} holds the checkpoint"):  # the run folder as checkpoint=
        export(run, run, overwrite=True)
    assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")) == before


def test_overwrite_replaces_only_an_export(tmp_path):
    """overwrite=true used to replace any folder: another run's, or an export a user added files to."""
    ckpt, _ = _checkpoint(tmp_path, VIT0, DATA)
    other_run = _checkpoint(tmp_path / "b", VIT2, DATA)[0].parent.parent
    with pytest.raises(ConfigError, match=rf"^out={other_run} is not a folder python -m laplace.export wrote \(it "
                                          r"holds ckpt\); overwrite=true replaces only an export: choose another"):
        export(ckpt, other_run, overwrite=True)
    assert (other_run / "ckpt" / "last.pt").is_file()
    out = export(ckpt, tmp_path / "export")
    (out / "notes.txt").write_text("mine")
    with pytest.raises(ConfigError, match=r"is not a folder python -m laplace.export wrote \(it holds README.md, "):
        export(ckpt, out, overwrite=True)
    (out / "notes.txt").unlink()
    assert export(ckpt, out, overwrite=True) == out  # an export as it was written: replaced


def test_of_two_exports_to_one_folder_the_later_is_refused(tmp_path, monkeypatch):
    """Two exports started 0.5 s apart to one out= both exited 0, the later silently replacing the
    earlier. Here the second starts and finishes while the first writes: the first to finish keeps
    the folder, the other is refused in one line, and neither's temp folder is removed by the other."""
    import laplace.export as ex

    first, _ = _checkpoint(tmp_path, VIT0, DATA)
    second, _ = _checkpoint(tmp_path / "b", VIT2, DATA)
    out, writer = tmp_path / "export", ex._save_for_timm

    def meanwhile(folder, *args):
        writer(folder, *args)
        ex.export(second, out)  # its stale-folder sweep must leave this live temp folder alone
        assert folder.is_dir()

    monkeypatch.setattr(ex, "_save_for_timm", meanwhile)
    with pytest.raises(ConfigError, match=rf"^out={out} was written by another export or program meanwhile; "
                                          r"nothing replaced: choose another folder"):
        ex.export(first, out)
    assert json.loads((out / "config.json").read_text())["laplace"]["model"] == VIT2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["b", "export", "runs"]  # no temp folder left


def test_a_symlinked_checkpoint_or_a_run_folder_exports(tmp_path):
    """A symlink to a checkpoint gave a traceback (ValueError from relative_to); the run folder itself
    is accepted too (its ckpt/last.pt). Both export the real run's checkpoint and results."""
    ckpt, model = _checkpoint(tmp_path, VIT2, DATA)
    (tmp_path / "links").mkdir()
    (tmp_path / "links" / "best.pt").symlink_to(ckpt)
    for i, src in enumerate([tmp_path / "links" / "best.pt", ckpt.parent.parent]):
        out = export(src, tmp_path / f"export{i}")
        source = json.loads((out / "config.json").read_text())["laplace"]["source"]
        assert (source["run"], source["checkpoint"]) == ("vitt_2L_s0", "ckpt/last.pt")


# Issue 53, item 2: what an export folder holds is checked before it is trusted.
@pytest.mark.parametrize("change,pattern", [
    ("float16", r"blocks.0.attn.qkv.weight is F16 \(and 0 more tensors not F32\); laplace exports are float32"),
    ("float64", r"is F64"), ("int32", r"is I32"),
    ("nan", r"blocks.0.attn.qkv.weight holds 1 NaN / inf value\(s\) of 6912; export a finite checkpoint again")])
def test_export_weights_of_another_dtype_or_not_finite_are_refused(tmp_path, change, pattern):
    """float16 / float64 / int32 / NaN weights in model.safetensors used to load silently (cast by
    load_state_dict): a converted or damaged file is refused in one line naming the tensor."""
    from safetensors.torch import load_file, save_file

    out = export(_checkpoint(tmp_path, VIT2, DATA)[0], tmp_path / "export")
    sd = load_file(out / "model.safetensors")
    key = "blocks.0.attn.qkv.weight"
    if change == "nan":
        sd[key].view(-1)[5] = float("nan")
    else:
        sd[key] = sd[key].to(getattr(torch, change))
    save_file(sd, out / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=pattern) as e:
        laplace.load_model(out)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("spec", ["/etc/passwd", "../data/tokenizer.json", "sub/tokenizer.json"])
def test_an_export_tokenizer_is_its_own_file_or_built_in(tmp_path, spec):
    """config.json's laplace.tokenizer was read as a path from anywhere (eval.generate loaded it)."""
    from eval.generate import gpt_source

    out = export(_checkpoint(tmp_path, GPT, {"name": "pydoc_text", "tokenizer": "bytes"}, trainer="gpt")[0],
                 tmp_path / "export")
    cfg = json.loads((out / "config.json").read_text())
    cfg["laplace"]["tokenizer"] = spec
    (out / "config.json").write_text(json.dumps(cfg))
    for load in (laplace.load_model, gpt_source):
        with pytest.raises(CheckpointError, match=rf"laplace.tokenizer='{spec}'; an export's tokenizer is bytes, "
                                                  r"gpt2 or tokenizer.json \(the file in the folder\)$"):
            load(out)


def test_an_export_config_with_another_depth_is_one_line_before_building(tmp_path, monkeypatch):
    """depth 4096 in config.json: the model was built (seconds to minutes, or an allocation failure)
    before the weights were found not to fit."""
    out = export(_checkpoint(tmp_path, VIT2, DATA)[0], tmp_path / "export")
    cfg = json.loads((out / "config.json").read_text())
    cfg["laplace"]["model"].update(depth=4096, num_laplacian_heads=2)
    (out / "config.json").write_text(json.dumps(cfg))
    monkeypatch.setattr("laplace.zoo.create_model", lambda **kw: pytest.fail("built before checking"))
    with pytest.raises(CheckpointError, match=r"config.json: laplace.model.depth=4096 but model.safetensors holds 2 "
                                              r"layers; copy the whole exported folder, or export the checkpoint"):
        laplace.load_model(out)


def test_an_export_says_its_input_size_and_classes_to_timm(tmp_path):
    """pretrained_cfg lacked input_size and num_classes for a ViT with Laplacian heads, so timm's data
    config fed 224 px to a 32 px model."""
    from timm.data import resolve_data_config

    out = export(_checkpoint(tmp_path, VIT2, DATA)[0], tmp_path / "export")
    pretrained = json.loads((out / "config.json").read_text())["pretrained_cfg"]
    assert pretrained["input_size"] == [3, 32, 32] and pretrained["num_classes"] == 10
    t = timm.create_model(f"local-dir:{out}", pretrained=True)
    assert tuple(resolve_data_config({}, model=t)["input_size"]) == (3, 32, 32)


def test_a_run_stopped_early_says_so_in_the_card_and_on_the_console(tmp_path, capsys):
    """A checkpoint of step 40 of 100 exported with no word of it."""
    ckpt, model = _checkpoint(tmp_path, VIT2, DATA)
    config = torch.load(ckpt, weights_only=True)["config"]
    save_checkpoint(ckpt, model=model, config=config, loop={"step": 40, "total_steps": 100})
    out = export(ckpt, tmp_path / "export")
    assert "- Stopped early: these weights are step 40 of the 100 the run planned, not its finished model" in \
        (out / "README.md").read_text()
    assert "the run stopped early, and the export is of unfinished weights" in capsys.readouterr().err
    save_checkpoint(ckpt, model=model, config=config, loop={"step": 100, "total_steps": 100})
    assert "Stopped early" not in (export(ckpt, tmp_path / "done") / "README.md").read_text()
    assert capsys.readouterr().err == ""


def test_the_gpt_card_says_plainly_that_timm_does_not_load_it(tmp_path):
    """It said "timm builds it only where laplace's models are registered with timm: ... timm has no
    such architecture", which contradicts itself."""
    out = export(_checkpoint(tmp_path, GPT, {"name": "pydoc_text"}, trainer="gpt")[0], tmp_path / "export")
    card = (out / "README.md").read_text()
    assert "timm does not load it: gpt_d2_1L is a language model (GPT); timm has no such architecture." in card
    assert "timm builds it" not in card


def test_frozen_feature_evaluations_take_an_export_or_run_folder(tmp_path):
    """eval.knn checkpoint=<export folder> said "no such file" for a folder that exists."""
    from laplace.pretrained import load_backbone

    ckpt, model = _checkpoint(tmp_path, VIT2, DATA)
    out = export(ckpt, tmp_path / "export")
    x = _images()
    with torch.no_grad():
        want = load_backbone(ckpt)[0](x)
        for folder, file in ((out, out / "model.safetensors"), (ckpt.parent.parent, ckpt)):
            got, info = load_backbone(folder)
            assert torch.equal(got(x), want) and (info["step"], info["checkpoint"]) == (40, str(file))


# Issue 52: one loader for every kind of source.
def test_one_loader_takes_a_run_folder_a_hub_id_and_hands_nanochat_folders_on(tmp_path, monkeypatch):
    import types

    import huggingface_hub

    ckpt, model = _checkpoint(tmp_path, VIT2, DATA)
    out = export(ckpt, tmp_path / "export")
    x = _images()
    asked = {}

    def snapshot_download(repo_id, revision=None, cache_dir=None, allow_patterns=None):
        asked.update(repo_id=repo_id, revision=revision)
        return str(out)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    with torch.no_grad():
        assert torch.equal(laplace.load_model(ckpt.parent.parent)(x), model(x))  # a run: its ckpt/last.pt
        assert torch.equal(laplace.from_pretrained("org/vitt_2L", revision="v1")(x), model(x))
    assert asked == {"repo_id": "org/vitt_2L", "revision": "v1"}
    # a nanochat checkpoint folder (model_<step>.pt + meta_<step>.json) goes to laplace.nanochat.load
    nano = tmp_path / "nanochat" / "d20"
    nano.mkdir(parents=True)
    (nano / "model_000100.pt").write_bytes(b"")
    (nano / "meta_000100.json").write_text("{}")
    monkeypatch.setitem(sys.modules, "laplace.nanochat",
                        types.SimpleNamespace(load=lambda folder, map_location: model.train()))
    assert laplace.load_model(nano) is model and not model.training
    with pytest.raises(CheckpointError, match=r"^no checkpoint at runs/x/ckpt/last.pt$"):
        laplace.load_model("runs/x/ckpt/last.pt")
    with pytest.raises(CheckpointError, match=r"^runs/x/y: no such file or folder, and not a Hugging Face Hub id"):
        laplace.load_model("runs/x/y")  # never asked of the Hub
