"""DINO's frozen-backbone evaluations: weighted k-NN (eval/knn.py) and the linear probe with an
lr grid chosen on held-out training data (eval/linear.py), on features extracted and cached by
eval/features.py; end to end on a tiny checkpoint trained on the built-in digits."""
from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest
import torch

import laplace
import torch.nn.functional as F
from conftest import CONFIGS, ROOT, TINY_VIT, randomize_
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf
from torch.utils.data import TensorDataset

from eval.features import batch_features, cache_key, extract_features, probe_data_node
from eval.knn import knn_classify
from eval.linear import accuracy, evaluate_linear, linear_probe
from laplace import create_model
from laplace.checkpoint import save_checkpoint
from laplace.pretrained import backbone_source, load_backbone
from train.config import model_node
from train.rundir import results_header

NODE = dict(model_node("vitt_0L"), depth=3, embed_dim=48, num_heads=3, img_size=16, patch_size=8, num_classes=10)


def _planted(n_per: int, classes: int, dim: int, noise: float, seed: int):
    g = torch.Generator().manual_seed(seed)
    centres = F.normalize(torch.randn(classes, dim, generator=g), dim=1)
    y = torch.arange(classes).repeat_interleave(n_per)
    x = centres[y] + noise * torch.randn(len(y), dim, generator=g)
    return x, y


# ----------------------------------------------------------------------------- k-NN


def test_knn_separable_features_are_all_right():
    x, y = _planted(30, 5, 16, 0.05, seed=0)
    xt, yt = _planted(10, 5, 16, 0.05, seed=0)  # same centres (same seed draws them first)
    res = knn_classify(F.normalize(x, dim=1), y, F.normalize(xt, dim=1), yt, ks=(1, 10, 20), T=0.07, chunk=7)
    assert all(r["top1"] == 100.0 and r["top5"] == 100.0 for r in res.values())


def test_knn_weights_by_hand():
    """6 training points on the unit circle, 3 classes, one query at angle 0. The vote of class c
    is the sum over its neighbours among the k most similar of exp(cos / T): a close neighbour
    outweighs two far ones at small T, counts decide at large T."""
    ang = torch.tensor([0.05, 0.8, -0.8, 2.0, 2.5, 3.0])
    labels = torch.tensor([2, 1, 1, 0, 0, 0])
    train, q = torch.stack((ang.cos(), ang.sin()), 1), torch.tensor([[1.0, 0.0]])
    sims = [math.cos(a) for a in ang.tolist()]
    order = sorted(range(6), key=lambda i: -sims[i])

    def by_hand(k, T):
        votes = [0.0] * 3
        for i in order[:k]:
            votes[int(labels[i])] += math.exp(sims[i] / T)
        return max(range(3), key=lambda c: votes[c])

    cases = {(3, 0.07): 2, (3, 1.0): 1, (6, 1.0): 1, (6, 100.0): 0, (1, 0.07): 2}
    for (k, T), want in cases.items():
        assert by_hand(k, T) == want
        for yq in range(3):
            res = knn_classify(train, labels, q, torch.tensor([yq]), ks=(k,), T=T, num_classes=3)
            assert res[k]["top1"] == (100.0 if yq == want else 0.0), (k, T, yq)
            # 3 classes are all in the top 5, but DINO counts only the first min(5, k) predictions
            assert res[k]["top5"] == (100.0 if k >= 3 else res[k]["top1"])


# ----------------------------------------------------------------------------- linear probe


def test_linear_probe_learns_and_picks_lr_on_heldout_train():
    torch.set_num_threads(1)  # tiny matrices: a second thread only waits (seconds on a loaded machine)
    x, y = _planted(60, 4, 12, 0.2, seed=1)
    xv, yv = _planted(20, 4, 12, 0.2, seed=1)
    # lr 0 never learns. (A huge lr is no use as the useless one: argmax is scale-invariant, so a
    # linear probe with lr 1e6 still separates these classes, and its inf / NaN arithmetic is slow.)
    grid = [0.0, 0.1, 1.0]
    kw = dict(num_classes=4, epochs=8, batch_size=64, val_fraction=0.1, seed=0)
    r = linear_probe(x, y, xv, yv, grid, **kw)
    assert r["base_lr"] != 0.0 and r["top1"] > 95.0 and r["heldout_top1"] > 95.0
    assert r["grid"][0]["heldout_top1"] < 60.0 and r["n_heldout"] == 24 and r["n_fit"] == 216
    # The validation split plays no part in the choice: permuted labels give the same lr and grid.
    r2 = linear_probe(x, y, xv, yv[torch.randperm(len(yv), generator=torch.Generator().manual_seed(3))], grid, **kw)
    assert r2["grid"] == r["grid"] and r2["chosen"] == r["chosen"]
    # The chosen head itself (no retraining) is reported just as well.
    r3 = linear_probe(x, y, xv, yv, grid, retrain=False, **kw)
    assert r3["chosen"] == r["chosen"] and r3["top1"] > 95.0 and not r3["retrained"]
    # A diverged head (non-finite logits) scores 0, so it is never chosen.
    assert accuracy(torch.full((3, 4), float("nan")), torch.tensor([0, 1, 2])) == (0.0, 0.0)


# ----------------------------------------------------------------------------- features


class _Counting(torch.nn.Module):
    def __init__(self, vit):
        super().__init__()
        self.vit, self.calls = vit, 0
        self.blocks, self.norm, self.pool = vit.blocks, vit.norm, vit.pool

    def forward_features(self, *a, **kw):
        self.calls += 1
        return self.vit.forward_features(*a, **kw)

    def forward_intermediates(self, *a, **kw):
        self.calls += 1
        return self.vit.forward_intermediates(*a, **kw)


def test_feature_kinds_shapes_and_values():
    vit = randomize_(create_model(**{**NODE, "num_classes": 0})).eval()
    x = torch.randn(5, 3, 16, 16)
    cls = batch_features(vit, x, "cls")
    assert cls.shape == (5, 48)
    torch.testing.assert_close(cls.norm(dim=1), torch.ones(5))
    torch.testing.assert_close(cls, F.normalize(laplace.features(vit, x, layers=[])["norm"][:, 0], dim=1))
    lin = batch_features(vit, x, "linear", n_last_blocks=2)
    assert lin.shape == (5, 96)
    feats = laplace.features(vit, x, layers=[1, 2], norm=True)
    torch.testing.assert_close(lin[:, :48], vit.norm(feats["blocks.1"])[:, 0])
    torch.testing.assert_close(lin[:, 48:], feats["norm"][:, 0])  # the last block after the final norm
    lin4 = batch_features(vit, x, "linear", n_last_blocks=3, avgpool=True)
    assert lin4.shape == (5, 4 * 48)
    torch.testing.assert_close(lin4[:, 144:], feats["norm"][:, 1:].mean(1))


def test_cache_reused_and_invalidated(tmp_path):
    vit = randomize_(create_model(**NODE)).eval()
    ckpt = save_checkpoint(tmp_path / "run/ckpt/last.pt", model=vit, config={"model": NODE}, loop={"step": 7})
    model, info = load_backbone(ckpt, img_size=16)
    assert info["step"] == 7 and info["model"] == "vitt_d3_w48_0L" and model.num_classes == 0
    # A DINO checkpoint's model is a backbone without head (num_classes=0): the same path.
    bare = randomize_(create_model(**{**NODE, "num_classes": 0}))
    save_checkpoint(tmp_path / "dino/ckpt/last.pt", model=bare, config={"model": {**NODE, "num_classes": 0}})
    b, binfo = load_backbone(tmp_path / "dino/ckpt/last.pt")
    assert binfo["step"] is None and torch.equal(b.state_dict()["norm.weight"], bare.state_dict()["norm.weight"])
    counting = _Counting(model)
    data = TensorDataset(torch.randn(11, 3, 16, 16), torch.arange(11) % 3)
    dcfg = OmegaConf.create({"name": "toy", "img_size": 16, "mean": [0.5] * 3, "std": [0.5] * 3})
    cache = tmp_path / "run/eval/features_toy_train_cls.pt"
    kw = dict(kind="cls", batch_size=4, cache=cache, key=cache_key(info, dcfg, "train", "cls", data, 1.0))
    f1, y1 = extract_features(counting, data, **kw)
    assert counting.calls == 3 and f1.shape == (11, 48) and cache.is_file()
    torch.testing.assert_close(f1, batch_features(model, data.tensors[0], "cls"))
    assert torch.equal(y1, data.tensors[1])
    f2, y2 = extract_features(counting, data, **kw)
    assert counting.calls == 3 and torch.equal(f1, f2) and torch.equal(y1, y2)  # read back, no forward
    # Another checkpoint at the same path (a new step): the key differs, the features are recomputed.
    save_checkpoint(ckpt, model=vit, config={"model": NODE}, loop={"step": 8})
    _, info2 = load_backbone(ckpt, img_size=16)
    kw["key"] = cache_key(info2, dcfg, "train", "cls", data, 1.0)
    extract_features(counting, data, **kw)
    assert counting.calls == 6
    # So does another transform setting.
    kw["key"] = cache_key(info2, dcfg, "train", "cls", data, 0.875)
    extract_features(counting, data, **kw)
    assert counting.calls == 9


def test_gather_rows_restores_dataset_order(monkeypatch):
    """Each rank extracts what DistributedSampler gives it (3 ranks, 10 samples: r, r + 3, ...,
    wrapping round to 4 each); the all-gathered rows come back in dataset order (all_gather simulated)."""
    import eval.features as ef
    from train.dist import DistInfo
    from torch.utils.data import DistributedSampler

    rows = torch.arange(10.0)[:, None].repeat(1, 2)
    shards = [rows[list(DistributedSampler(rows, 3, r, shuffle=False))] for r in range(3)]
    assert [len(s) for s in shards] == [4, 4, 4]

    def fake_all_gather(parts, local):
        for r, p in enumerate(parts):
            p.copy_(shards[r])

    monkeypatch.setattr(ef.dist, "all_gather", fake_all_gather)
    out = ef._gather_rows(shards[1], 10, DistInfo(rank=1, world_size=3))
    assert torch.equal(out, rows)


def test_one_backbone_loader_for_probes_and_segmentation(tmp_path):
    """laplace.pretrained.load_backbone serves k-NN / linear (no head) and segmentation (head kept,
    so its construction draws the random numbers it always drew): frozen, eval mode, at the
    asked size, the node it reports (and `backbone_source`'s) the one it built."""
    vit = randomize_(create_model(**NODE))
    ckpt = save_checkpoint(tmp_path / "run/ckpt/last.pt", model=vit, config={"model": NODE}, loop={"step": 3})
    seg, info = load_backbone(ckpt, img_size=32, head=True)
    assert info["node"] == {**NODE, "img_size": 32, "drop_path_rate": 0.0} == backbone_source(ckpt, img_size=32, head=True)["node"]
    assert seg.pos_embed.shape[1] == 16 and not seg.training and not any(p.requires_grad for p in seg.parameters())
    assert torch.equal(seg.head.weight, vit.head.weight)
    torch.manual_seed(0)
    create_model(**info["node"])
    after_fresh = torch.rand(3)
    torch.manual_seed(0)
    load_backbone(ckpt, img_size=32, head=True)
    assert torch.equal(torch.rand(3), after_fresh)  # the same draws as building the recorded node
    probe, pinfo = load_backbone(ckpt)
    assert pinfo["node"]["num_classes"] == 0 and "head.weight" not in probe.state_dict()
    assert results_header(pinfo["node"], "digits", ckpt, step=3) == {
        "model": "vitt_d3_w48_0L", "num_laplacian_heads": 0, "laplacian_mode": "fixed", "attention": "softmax",
        "dataset": "digits", "checkpoint": str(ckpt), "step": 3}


def test_timm_state_dict_needs_a_model_node(tmp_path):
    vit = randomize_(create_model(**NODE))
    torch.save(vit.state_dict(), tmp_path / "w.pth")
    from laplace.errors import ConfigError

    with pytest.raises(ConfigError, match="model=vits_0L"):
        load_backbone(tmp_path / "w.pth")
    model, info = load_backbone(tmp_path / "w.pth", NODE, img_size=32)  # position embedding resampled
    assert info["source"] == "timm" and info["step"] is None and model.pos_embed.shape[1] == 16
    ref = create_model(**{**NODE, "num_classes": 0})
    assert torch.equal(model.state_dict()["blocks.2.mlp.fc2.weight"], vit.state_dict()["blocks.2.mlp.fc2.weight"])
    assert set(model.state_dict()) == set(ref.state_dict())


def test_timm_weights_through_the_model_group(tmp_path):
    """`python -m eval.knn checkpoint=W.pth model=vitt_0L`: the architecture from the `model=`
    group (sized by the data node), the weights from the state dict."""
    from eval.knn import evaluate_knn

    node = dict(model_node("vitt_0L"), depth=1, img_size=32, patch_size=8, num_classes=10)
    torch.save(randomize_(create_model(**node)).state_dict(), tmp_path / "w.pth")
    with initialize_config_dir(config_dir=CONFIGS, version_base="1.3"):
        cfg = compose("knn", overrides=[f"checkpoint={tmp_path / 'w.pth'}", "model=vitt_0L", "model.depth=1",
                                        "device=cpu", "num_workers=0", "ks=[5]", "k=5", "cache=false",
                                        f"run_dir={tmp_path / 'out'}"])
    rec = evaluate_knn(cfg)
    assert rec["weights"] == "timm" and rec["step"] is None and rec["n_train"] == 1438 and rec["n_val"] == 359
    assert 0 <= rec["knn"]["top1"] <= 100 and (tmp_path / "out/results.json").is_file()
    assert not (tmp_path / "eval").exists()  # cache=false writes no features


# ----------------------------------------------------------------------------- end to end


def _cli(module: str, *args):
    return subprocess.run([sys.executable, "-m", module, *args, "num_workers=0", "batch_size=128"],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)


@pytest.mark.timeout(900)  # two CLI subprocesses of up to 600 s each
def test_knn_and_linear_end_to_end_on_digits(make_cfg, tmp_path):
    from analysis.runs import read_run
    from train import run

    torch.set_num_threads(1)  # tiny matrices: a second thread only waits (seconds on a loaded machine)

    run(make_cfg(*TINY_VIT, "model=vitt_0L", "model.depth=1", "trainer.max_steps=2", run_dir=tmp_path / "bb"))
    ckpt = tmp_path / "bb/ckpt/last.pt"
    knn = _cli("eval.knn", f"checkpoint={ckpt}", "data=digits", "device=cpu")
    assert knn.returncode == 0, knn.stdout[-2000:] + knn.stderr[-2000:]
    assert len([ln for ln in knn.stdout.splitlines() if ln.startswith("[knn]")]) == 4
    # The linear probe in-process (the same entry function `python -m eval.linear` runs).
    with initialize_config_dir(config_dir=CONFIGS, version_base="1.3"):
        lcfg = compose("linear", overrides=[f"checkpoint={ckpt}", "data=digits", "device=cpu", "epochs=10",
                                            "train_batch_size=256", "lr_grid=[0.0,0.01,1.0]", "n_last_blocks=1",
                                            "avgpool=true", "num_workers=0", "batch_size=128"])
    evaluate_linear(lcfg)
    k = json.loads((tmp_path / "bb/eval/knn_digits/results.json").read_text())
    li = json.loads((tmp_path / "bb/eval/linear_digits/results.json").read_text())
    print(knn.stdout)
    assert k["protocol"] == "knn" and k["model"] == "vitt_d1_w48_0L" and k["step"] == 2 and k["k"] == 20
    assert 0 <= k["knn"]["top1"] <= 100 and set(k["knn"]["per_k"]) == {"10", "20", "100", "200"}
    assert li["protocol"] == "linear" and 0 <= li["linear"]["top1"] <= 100 and len(li["grid"]) == 3
    assert li["linear"]["base_lr"] != 0.0 and li["n_heldout"] == round(0.1 * li["n_train"])
    assert (tmp_path / "bb/eval/features_digits_train_cls.pt").is_file()
    assert (tmp_path / "bb/eval/features_digits_val_last1_avgpool.pt").is_file()
    assert li["feature_dim"] == 2 * 48  # the class token and the mean patch token of the one block
    metrics = read_run(tmp_path / "bb")["metrics"]
    ssl = OmegaConf.load(f"{CONFIGS}/tables.yaml").tables.ssl.columns
    for name, got in (("knn_top1", k["knn"]["top1"]), ("linear_top1", li["linear"]["top1"])):
        keys = next(c.metric for c in ssl if c.name == name)
        assert metrics[keys[0]] == pytest.approx(got)


def test_errors_are_one_line(tmp_path):
    from laplace.checkpoint import CheckpointError
    from laplace.errors import ConfigError

    gpt = tmp_path / "gpt.pt"
    node = dict(model_node("gpt_d2_0L"), vocab_size=32, max_seq_len=16)
    save_checkpoint(gpt, model=create_model(**node), config={"model": node})
    junk = tmp_path / "junk.pt"
    junk.write_bytes(b"not a checkpoint")
    vit = save_checkpoint(tmp_path / "vit.pt", model=create_model(**NODE), config={"model": NODE})
    with pytest.raises(ConfigError, match="needs a ViT"):
        load_backbone(gpt)
    with pytest.raises(CheckpointError, match="not a readable"):
        load_backbone(junk)
    with initialize_config_dir(config_dir=CONFIGS, version_base="1.3"):
        cfg = compose("knn", overrides=[f"checkpoint={vit}", "device=cpu", "ks=[0]"])
    with pytest.raises(ConfigError, match="k >= 1"):
        from eval.knn import evaluate_knn

        evaluate_knn(cfg)
    # The command lines: one `error:` line, exit status 1.
    cases = [("eval.knn", [f"checkpoint={tmp_path / 'none.pt'}"], "no such file"),
             ("eval.linear", [f"checkpoint={vit}", "data=cifar100", f"data.root={tmp_path}"], "cifar100 not found")]
    for module, args, expect in cases:
        proc = subprocess.run([sys.executable, "-m", module, *args], cwd=ROOT, capture_output=True, text=True,
                              timeout=120)
        err = proc.stderr.strip().splitlines()
        assert proc.returncode == 1 and len(err) == 1 and expect in err[0], proc.stderr[-1000:]


def test_probe_transform_is_dinos_on_imagenet(tmp_path):
    """eval.knn / eval.linear on data=imagenet: DINO's Resize(256, bicubic) + CenterCrop(224)
    for both splits (the same 256/224 ratio at another size); the digits keep their own crop."""
    import fakedata
    from torchvision import transforms as T
    from torchvision.transforms import v2

    from laplace.data.vision import build_vision_dataset

    root = tmp_path / "imagenet"
    fakedata.write_imagenet_folder(root, n_classes=2, per_class=2, size=40)
    for entry in ("knn", "linear"):
        for size, resize in ((224, 256), (112, 128)):
            with initialize_config_dir(config_dir=CONFIGS, version_base="1.3"):
                cfg = compose(entry, overrides=["checkpoint=x.pt", "data=imagenet", f"data.root={root}",
                                                f"data.img_size={size}"])
            for train in (True, False):
                steps = build_vision_dataset(probe_data_node(cfg.data, cfg.crop_pct), train).transform.transforms
                steps = [getattr(s, "crop", s) for s in steps]  # laplace.data.decode.DecodeCrop wraps the resize
                rs, cc = (next(s for s in steps if isinstance(s, c)) for c in (T.Resize, (T.CenterCrop, v2.CenterCrop)))
                assert rs.size == resize and rs.interpolation == T.InterpolationMode.BICUBIC
                assert cc.size == (size, size)
    with initialize_config_dir(config_dir=CONFIGS, version_base="1.3"):
        cfg = compose("knn", overrides=["checkpoint=x.pt", "data=digits"])
    assert probe_data_node(cfg.data, cfg.crop_pct).eval_crop_pct == cfg.data.eval_crop_pct == 1.0
    assert probe_data_node(cfg.data, 0.5).eval_crop_pct == 0.5  # crop_pct= overrides
