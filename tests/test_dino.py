"""trainer=dino: multi-crop, head, loss and centre, EMA teacher, frozen last layer, exact
resume, and the dino_in1k recipe end to end on a tiny ImageFolder (teacher backbone exported)."""
from __future__ import annotations

import math

import fakedata
import numpy as np
import pytest
import torch

import laplace
from PIL import Image

from laplace import create_model
from laplace.checkpoint import CheckpointError, load_checkpoint, load_model
from laplace.data.multicrop import (
    GaussianBlur,
    MultiCrop,
    Solarization,
    multicrop_collate,
)
from laplace.dino import DINO, DINOHead, DINOLoss
from laplace.vit import resample_pos_embed
from laplace.errors import ConfigError
from train import run
from train.dino import DINOTrainer
from train.logger import read_metrics

# A 48-wide, 1-block ViT, a 64-way head, 2 local crops, 18 training digits (2 steps per epoch).
TINY_DINO = ["experiment=dino_digits", "model.depth=1", "model.embed_dim=48", "trainer.num_workers=0",
             "trainer.progress=false", "trainer.global_batch_size=8", "trainer.log_every=1",
             "trainer.head.out_dim=64", "trainer.head.hidden_dim=32", "trainer.head.bottleneck_dim=16",
             "trainer.multicrop.local_crops=2", "data.val_fraction=0.99"]


@pytest.fixture(autouse=True)
def _one_thread():
    # After conftest's 2 threads: on the shared 2 cores, 2 OpenMP threads ran these tiny steps
    # 10-30x slower than one (spin-waiting against the other processes).
    torch.set_num_threads(1)


def _mc(**kw) -> MultiCrop:
    base = {"global_size": 32, "local_size": 16, "global_scale": (1.0, 1.0), "local_crops": 3, "flip": 0.0,
                "color_jitter_prob": 0.0, "grayscale": 0.0, "global_blur": (0.0, 0.0), "local_blur": 0.0,
                "mean": (0.0, 0.0, 0.0), "std": (1.0, 1.0, 1.0)}
    return MultiCrop(**{**base, **kw})


def test_multicrop_counts_sizes_and_dino_defaults(make_cfg):
    cfg = make_cfg("trainer=dino", "data=imagenet")
    mc = MultiCrop.from_config(cfg.trainer.multicrop, cfg.data.mean, cfg.data.std)
    img = Image.fromarray(np.random.default_rng(0).integers(0, 256, (60, 70, 3), dtype=np.uint8))
    crops = mc(img)
    assert [size for _, size in mc.views] == [224] * 2 + [96] * 8 and len(crops) == 10
    assert [c.shape for c in crops] == [(3, 224, 224)] * 2 + [(3, 96, 96)] * 8
    # DINO's composition: blur 1.0 / 0.1 on the global crops, solarize on the second only.
    steps = lambda t: t.transforms
    global_transforms, local_transform = [t for t, _ in mc.views[:2]], mc.views[-1][0]
    rrc = next(s for s in steps(local_transform) if type(s).__name__ == "RandomResizedCrop")
    assert rrc.scale == (0.05, 0.4) and rrc.size == (96, 96)
    g_rrc = next(s for s in steps(global_transforms[0]) if type(s).__name__ == "RandomResizedCrop")
    assert g_rrc.scale == (0.4, 1.0)
    blur = [[s.p for s in steps(t) if isinstance(s, GaussianBlur)] for t in [*global_transforms, local_transform]]
    assert blur == [[1.0], [0.1], [0.5]]
    sol = [[s.p for s in steps(t) if isinstance(s, Solarization)] for t in [*global_transforms, local_transform]]
    assert sol == [[], [0.2], []]
    jitter = next(s for s in steps(local_transform) if type(s).__name__ == "RandomApply")
    assert jitter.p == 0.8 and jitter.transforms[0].hue == (-0.1, 0.1)

    batch = multicrop_collate([(mc(img), 3), (mc(img), 5)])
    assert [tuple(b.shape) for b in batch] == [(2, 3, 224, 224)] * 2 + [(2, 3, 96, 96)] * 8


def test_only_the_second_global_crop_is_solarised():
    # Whole-image crops, no flip / jitter / blur: view 1 is the image, view 2 its solarisation
    # when forced (p 1 from the config's global_solarize).
    x = np.tile(np.linspace(0, 255, 32).round().astype(np.uint8), (32, 1))
    img = Image.fromarray(np.stack([x, x.T, 255 - x], -1))
    ref = torch.from_numpy(np.array(img)).permute(2, 0, 1).float() / 255
    sol = torch.where(ref * 255 >= 128, 1 - ref, ref)
    g1, g2, *local = _mc(global_solarize=(0.0, 1.0))(img)
    assert torch.allclose(g1, ref, atol=1 / 255) and torch.allclose(g2, sol, atol=1 / 255)
    g1, g2, *_ = _mc(global_solarize=(0.0, 0.0))(img)
    assert torch.allclose(g2, ref, atol=1 / 255)
    # Local crops: at most 40% of the area (DINO's scale 0.05-0.4), resized to 16 px.
    torch.manual_seed(0)
    mc = _mc(local_scale=(0.05, 0.4))
    rrc = mc.views[-1][0].transforms[0]  # a local crop's
    for _ in range(50):
        box = rrc.make_params([img])
        h, w = box["height"], box["width"]
        assert 0.05 * 32 * 32 * 0.8 <= h * w <= 0.4 * 32 * 32 * 1.1
    assert all(c.shape == (3, 16, 16) for c in local) and len(local) == 3


def test_dino_loss_matches_a_hand_computation_and_updates_the_centre():
    torch.manual_seed(0)
    B, K, tt, st = 3, 5, 0.05, 0.1
    student = torch.randn(4 * B, K)  # 2 global + 2 local crops
    teacher = torch.randn(2 * B, K)
    loss_fn = DINOLoss(K, n_global=2, student_temp=st, center_momentum=0.9)
    c0 = torch.randn(1, K)
    loss_fn.center.copy_(c0)
    loss = loss_fn(student, teacher, tt)

    total, pairs = 0.0, 0
    for i in range(2):
        for v in range(4):
            if v == i:
                continue
            per_image = []
            for b in range(B):
                t = (teacher[i * B + b] - c0[0]) / tt
                q = [math.exp(z) for z in t.tolist()]
                q = [z / sum(q) for z in q]
                s = (student[v * B + b] / st).tolist()
                lse = math.log(sum(math.exp(z) for z in s))
                per_image.append(-sum(qk * (sk - lse) for qk, sk in zip(q, s)))
            total += sum(per_image) / B
            pairs += 1
    assert pairs == 6
    assert loss.item() == pytest.approx(total / pairs, rel=1e-5)
    assert torch.equal(loss_fn.center, c0)  # the centre moves once per step, not per forward
    loss_fn.update_center()
    assert torch.allclose(loss_fn.center, 0.9 * c0 + 0.1 * teacher.mean(0, keepdim=True), atol=1e-6)


def test_centre_and_loss_of_two_micro_batches_equal_one_batch_of_both():
    """DINO: every sample of a step uses the centre from before the step; after the step the
    centre moves by the mean over the whole batch. Split into micro-batches, as the engine's
    accumulation does, the loss (mean of the halves) and the centre are the full batch's."""
    torch.manual_seed(0)
    B, K = 4, 7
    student, teacher = torch.randn(4, B, K), torch.randn(2, B, K)  # [crop, image, K]
    c0 = torch.randn(1, K)
    whole, halves = DINOLoss(K), DINOLoss(K)
    whole.center.copy_(c0)
    halves.center.copy_(c0)
    full = whole(student.reshape(-1, K), teacher.reshape(-1, K), 0.04)
    whole.update_center()
    parts = [halves(student[:, h].reshape(-1, K), teacher[:, h].reshape(-1, K), 0.04)
             for h in (slice(0, 2), slice(2, 4))]
    halves.update_center()
    assert (parts[0] + parts[1]).item() / 2 == pytest.approx(full.item(), rel=1e-6)
    assert torch.allclose(halves.center, whole.center, atol=1e-6)
    with pytest.raises(RuntimeError, match="no teacher output"):
        halves.update_center()  # nothing accumulated since: no 0/0 centre


def test_dino_trainer_with_accumulation_equals_one_batch(make_cfg, tmp_path):
    """trainer.micro_batch_size = half the batch gives the centre and the losses of the whole
    batch (no BatchNorm head, no drop-path: the only batch-size-dependent parts)."""
    cfg = lambda *o, d: make_cfg(*TINY_DINO, "trainer.max_steps=3", "trainer.head.use_bn=false",
                                 "model.drop_path_rate=0.0", *o, run_dir=tmp_path / d)
    run(cfg(d="whole"))
    run(cfg("trainer.micro_batch_size=4", d="micro"))
    train = lambda d: [r["loss"] for r in read_metrics(tmp_path / d) if r.get("split") == "train"]
    assert len(train("whole")) == 3
    assert train("micro") == pytest.approx(train("whole"), rel=1e-5, abs=1e-6)
    a, b = (load_checkpoint(tmp_path / d / "ckpt/last.pt")["train_model"]["loss.center"] for d in ("whole", "micro"))
    assert a.abs().max() > 1e-3
    assert torch.allclose(a, b, atol=1e-5)


def test_head_and_any_crop_size_through_the_vit():
    head = DINOHead(48, 64, hidden_dim=32, bottleneck_dim=16)
    g = head.last_layer.parametrizations.weight.original0
    assert not g.requires_grad and torch.all(g == 1)
    w = head.last_layer.weight
    assert torch.allclose(w.norm(dim=1), torch.ones(64), atol=1e-5)  # weight-normed rows
    assert head(torch.randn(5, 48)).shape == (5, 64)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert head(torch.randn(5, 48)).dtype == torch.float32  # logits in float32 under autocast


@pytest.mark.parametrize("rule", ["dino", "plain"])
def test_the_vit_takes_any_crop_size(rule):
    """The ViT's own forward at another size: patch projection, the position table resampled
    to the crop's grid by the model's rule, class token, blocks, final norm (what DINO's
    vision_transformer does; trainer=dino's backbones use DINO's rule)."""
    torch.manual_seed(0)
    vit = create_model("vits_2L", num_classes=0, depth=1, embed_dim=48, img_size=32, patch_size=8,
                       pos_embed_resample=rule).eval()
    x = torch.randn(2, 3, 16, 24)
    pe = vit.patch_embed
    tokens = pe.proj(x).flatten(2).transpose(1, 2) + resample_pos_embed(vit.pos_embed, (4, 4), (2, 3), rule)
    tokens = vit.blocks[0](torch.cat((vit.cls_token.expand(2, -1, -1), tokens), dim=1))
    assert torch.equal(vit(x), vit.norm(tokens)[:, 0])
    assert laplace.features(vit, x)["norm"].shape == (2, 1 + 6, 48)
    own = torch.randn(2, 3, 32, 32)  # the model's own size: the table as it is
    want = vit.blocks[0](torch.cat((vit.cls_token.expand(2, -1, -1), pe.proj(own).flatten(2).transpose(1, 2)
                                    + vit.pos_embed), dim=1))
    assert torch.equal(vit(own), vit.norm(want)[:, 0])
    with pytest.raises(AssertionError, match=r"height \(20\) should be divisible by patch size \(8\)"):  # timm's
        vit(torch.randn(1, 3, 20, 16))
    with pytest.raises(ValueError, match="pos_embed_resample='size'"):
        create_model("vits_2L", depth=1, pos_embed_resample="size")


def test_batchnorm_head_and_the_teacher_modes():
    """use_bn (DINO's --use_bn_in_head): BatchNorm before each hidden GELU. The teacher's
    backbone stays in eval mode (no drop-path), its head follows the student's mode, so its
    BatchNorm normalises with batch statistics during training as DINO's teacher does."""
    head = DINOHead(48, 64, hidden_dim=32, bottleneck_dim=16, use_bn=True)
    assert [type(m).__name__ for m in head.mlp] == ["Linear", "BatchNorm1d", "GELU", "Linear",
                                                    "BatchNorm1d", "GELU", "Linear"]
    vit = create_model("vits_2L", num_classes=0, depth=1, embed_dim=48, img_size=32, patch_size=8,
                       drop_path_rate=0.5)
    model = DINO(vit, head).train()
    assert model.student.training and model.teacher.head.training and not model.teacher.backbone.training
    x = torch.randn(4, 3, 32, 32)
    with torch.no_grad():
        assert torch.equal(model.teacher.backbone(x), model.teacher.backbone(x))  # no drop-path
        bn = model.teacher.head.mlp[1]
        before = bn.running_mean.clone()
        model.teacher(x)
        assert not torch.equal(before, bn.running_mean)  # batch statistics: running stats move
    model.eval()
    assert not model.teacher.head.training and not model.student.training


def test_the_dino_module_holds_all_of_dinos_state():
    """Student, teacher and the loss centre are one module's state: its forward is the loss of
    the teacher's global crops against the student's crops, update_teacher moves the centre
    (by the teacher outputs since the last update), then the teacher (EMA)."""
    torch.manual_seed(0)
    vit = create_model("vits_2L", num_classes=0, depth=1, embed_dim=48, img_size=32, patch_size=8,
                       pos_embed_resample="dino")
    model = DINO(vit, DINOHead(48, 64, hidden_dim=32, bottleneck_dim=16), n_global=2).train()
    sd = model.state_dict()
    assert "loss.center" in sd and not any("_pending" in k for k in sd)  # between steps it is 0
    crops = [torch.randn(3, 3, 32, 32), torch.randn(3, 3, 32, 32), torch.randn(3, 3, 16, 16)]
    with torch.no_grad():
        t = model.teacher(crops[:2])
    s = model.student(crops)
    assert s.shape == (9, 64)
    want = DINOLoss(64, 2)(s, t, 0.04)
    assert torch.equal(model(crops, 0.04), want)
    before = [p.detach().clone() for p in model.teacher.parameters()]
    with torch.no_grad():
        for p in model.student.parameters():
            p.add_(0.01)
    model.update_teacher(0.9)
    assert torch.allclose(model.loss.center, 0.1 * t.mean(0, keepdim=True), atol=1e-6)
    for t0, t1, p in zip(before, model.teacher.parameters(), model.student.parameters()):
        assert torch.allclose(t1, 0.9 * t0 + 0.1 * p, atol=1e-6)
    fresh = DINO(create_model("vits_2L", num_classes=0, depth=1, embed_dim=48, img_size=32, patch_size=8),
                 DINOHead(48, 64, hidden_dim=32, bottleneck_dim=16))
    fresh.load_state_dict(model.state_dict())
    assert torch.equal(fresh.loss.center, model.loss.center)


class Probe(DINOTrainer):
    """Checks, at every step, the teacher EMA and that no gradient reaches the teacher."""

    def configure_optimizers(self):
        optimizers = super().configure_optimizers()  # DINO's own hooks first: these see their work
        for opt in optimizers.values():
            opt.register_step_pre_hook(lambda *_: self._before())
            opt.register_step_post_hook(lambda *_: self._after())
        return optimizers

    def _before(self):
        assert all(p.grad is None for p in self.model.teacher.parameters())
        last = list(self.model.student.head.last_layer.parameters())
        self.frozen_steps = getattr(self, "frozen_steps", []) + [all(p.grad is None for p in last)]
        self.teacher_before = [p.detach().clone() for p in self.model.teacher.parameters()]

    def _after(self):
        m = self.hparams["teacher_momentum"]
        assert self.cfg.trainer.schedules.teacher_momentum.value - 1e-9 <= m < 1.0
        for t0, t1, s in zip(self.teacher_before, self.model.teacher.parameters(), self.model.student.parameters()):
            assert torch.allclose(t1, m * t0 + (1 - m) * s, atol=1e-6)  # the EMA of the stepped student


def test_ema_teacher_and_last_layer_frozen_in_the_first_epoch_only(make_cfg, tmp_path):
    cfg = make_cfg(*TINY_DINO, "trainer.max_steps=4", "trainer.stop_after=2")
    (tmp_path / "run").mkdir()  # train.run makes it; here the trainer is driven directly
    t = Probe(cfg).setup()
    assert t.steps_per_epoch == 2 and cfg.trainer.freeze_last_layer == 1  # one epoch: two steps
    last = lambda: [p.detach().clone() for p in t.model.student.head.last_layer.parameters()]
    first = [p.detach().clone() for p in t.model.student.head.mlp.parameters()]
    teacher0 = [p.detach().clone() for p in t.model.teacher.parameters()]
    assert all(torch.equal(a, b) for a, b in zip(teacher0, t.model.student.parameters()))  # same init
    w0 = last()
    t.fit()  # epoch 0: steps 1-2
    assert t.step == 2 and t.frozen_steps == [True, True]
    assert all(torch.equal(a, b) for a, b in zip(w0, last()))  # last layer untouched
    assert not torch.equal(first[0], t.model.student.head.mlp[0].weight)  # the rest trains
    assert not torch.equal(teacher0[0], next(t.model.teacher.parameters()))  # teacher moved (EMA)
    t.fit()  # epoch 1: steps 3-4
    assert t.step == 4 and t.frozen_steps == [True, True, False, False]
    assert not all(torch.equal(a, b) for a, b in zip(w0, last()))


def test_dino_digits_resumes_exactly(make_cfg, tmp_path):
    cfg = lambda *o, d: make_cfg(*TINY_DINO, "trainer.max_steps=4", *o, run_dir=tmp_path / d)
    run(cfg(d="a"))
    run(cfg("trainer.stop_after=2", d="b"))
    mid = load_checkpoint(tmp_path / "b/ckpt/last.pt")
    assert mid["loop"]["step"] == 2 and mid["train_model"]["loss.center"].abs().sum() > 0
    assert set(mid) & {"trainer", "rank_state"} == set()  # model + optimizer: all of DINO's state
    run(cfg(d="b"))
    train = lambda d: [(r["step"], r["loss"], r["teacher_temp"], r["teacher_momentum"])
                       for r in read_metrics(tmp_path / d) if r.get("split") == "train"]
    assert [r[0] for r in train("a")] == [1, 2, 3, 4]
    assert train("a") == train("b")
    a, b = load_checkpoint(tmp_path / "a/ckpt/last.pt"), load_checkpoint(tmp_path / "b/ckpt/last.pt")
    assert all(torch.equal(a["train_model"][k], b["train_model"][k]) for k in a["train_model"])  # centre too
    # The exported model is the teacher backbone.
    assert all(torch.equal(v, a["train_model"][f"teacher.backbone.{k}"]) for k, v in a["model"].items())


def test_a_checkpoint_with_the_centre_outside_the_model_is_refused_in_one_line(make_cfg, tmp_path):
    """Checkpoints from before the centre became a buffer of the model kept it as trainer
    state: resuming one says how in one line; load_model still reads its teacher backbone."""
    cfg = lambda: make_cfg(*TINY_DINO, "trainer.max_steps=4", "trainer.stop_after=1")
    run(cfg())
    path = tmp_path / "run/ckpt/last.pt"
    ckpt = load_checkpoint(path)
    ckpt["trainer"] = {"center": ckpt["train_model"].pop("loss.center")}  # the old layout
    ckpt["rank_state"] = [{}]
    torch.save(ckpt, path)
    with pytest.raises(CheckpointError) as e:
        run(cfg())
    msg = str(e.value)
    assert "\n" not in msg and "keeps trainer state (center) outside the model" in msg
    assert "resume it with revision" in msg and "start a new run_dir" in msg
    vit = load_model(path)
    assert all(torch.equal(v, ckpt["train_model"][f"teacher.backbone.{k}"]) for k, v in vit.state_dict().items())


@pytest.mark.parametrize("device_augment", [False, True])
def test_dino_in1k_smoke_on_an_image_folder_and_load_model(make_cfg, tmp_path, device_augment):
    """device_augment: the workers decode, the step cuts, resizes and augments the batch (laplace.data.crop_augment)."""
    with pytest.raises(ConfigError, match="data.root"):  # the experiment names no data location
        run(make_cfg("experiment=dino_in1k", "model=vits_5L", run_dir=tmp_path / "no_root"))
    root = tmp_path / "imagenet"
    fakedata.write_imagenet_folder(root, n_classes=2, per_class=4, size=40)
    # The backbone as the first author's timm fork has it (the card's open question): QK-norm, LayerScale.
    metrics = run(make_cfg(
        "experiment=dino_in1k", "model=vits_5L", "model.qk_norm=true", "model.init_values=1e-6",
        "model.depth=1", "model.embed_dim=48", f"data.root={root}",
        "data.img_size=32", "trainer.multicrop.local_size=16", "trainer.global_batch_size=4",
        "trainer.max_steps=2", "trainer.num_workers=0", "trainer.progress=false", "trainer.log_every=1",
        "trainer.head.out_dim=64", "trainer.head.hidden_dim=32", "trainer.head.bottleneck_dim=16",
        f"trainer.multicrop.device_augment={str(device_augment).lower()}"))
    assert metrics == {}
    run_dir = tmp_path / "run"
    losses = [r["loss"] for r in read_metrics(run_dir) if r.get("split") == "train"]
    assert len(losses) == 2 and all(math.isfinite(x) for x in losses)
    ckpt = load_checkpoint(run_dir / "ckpt/last.pt")
    assert ckpt["config"]["model"]["num_classes"] == 0 and ckpt["config"]["optim"]["lr"] == 1.0e-3
    assert ckpt["config"]["trainer"]["multicrop"]["local_crops"] == 8
    vit = load_model(run_dir / "ckpt/last.pt")
    assert type(vit).__name__ == "VisionTransformer" and vit.num_laplacian_heads == [5]
    assert isinstance(vit.blocks[0].attn.q_norm, torch.nn.LayerNorm)
    feats = laplace.features(vit, torch.randn(2, 3, 32, 32))
    assert feats["norm"].shape == (2, 1 + 4, 48)
    assert (run_dir / "results.json").exists()


def _dino_interpolate_pos_encoding(patch_pos: torch.Tensor, w: int, h: int, patch: int) -> torch.Tensor:
    """facebookresearch/dino vision_transformer.py `interpolate_pos_encoding`, the patch part
    (a square table of N entries), as written there: the target grid + 0.1 as a scale factor."""
    N, dim = patch_pos.shape[1], patch_pos.shape[-1]
    w0, h0 = w // patch + 0.1, h // patch + 0.1
    out = torch.nn.functional.interpolate(
        patch_pos.reshape(1, int(math.sqrt(N)), int(math.sqrt(N)), dim).permute(0, 3, 1, 2),
        scale_factor=(w0 / math.sqrt(N), h0 / math.sqrt(N)), mode="bicubic")
    assert int(w0) == out.shape[-2] and int(h0) == out.shape[-1]
    return out.permute(0, 2, 3, 1).view(1, -1, dim)


def test_position_embeddings_resampled_by_dinos_scale_factor_rule():
    torch.manual_seed(0)
    table = torch.nn.init.trunc_normal_(torch.empty(1, 14 * 14, 384), std=0.02)  # ViT-S/16 at 224
    for crop in (96, 160, 32):
        g = crop // 16
        ours = resample_pos_embed(table, (14, 14), (g, g), "dino")
        assert torch.equal(ours, _dino_interpolate_pos_encoding(table, crop, crop, 16))
    # Not the size= resampling: the 96 px local crops' table differs (what the rule changes).
    by_size = torch.nn.functional.interpolate(table.reshape(1, 14, 14, 384).permute(0, 3, 1, 2), size=(6, 6),
                                              mode="bicubic").permute(0, 2, 3, 1).reshape(1, 36, 384)
    assert (resample_pos_embed(table, (14, 14), (6, 6), "dino") - by_size).abs().max() > 1e-3
    assert torch.equal(resample_pos_embed(table, (14, 14), (6, 6), "plain"), by_size)  # plain: by size
    assert resample_pos_embed(table, (14, 14), (14, 14), "dino") is table  # the model's own grid


# facebookresearch/dino README, "Vanilla DINO training": main_dino.py --arch deit_small on 8 GPUs,
# i.e. main_dino.py's defaults (batch_size_per_gpu 64, lr 5e-4 per 256 images).
DINO_VANILLA_VITS16 = {
    "epochs": 100, "batch": 8 * 64, "lr": 5e-4 * 8 * 64 / 256, "min_lr": 1e-6, "warmup_epochs": 10,
    "weight_decay": 0.04, "weight_decay_end": 0.4, "teacher_temp": 0.04, "warmup_teacher_temp": 0.04,
    "momentum_teacher": 0.996, "norm_last_layer": True, "out_dim": 65536, "use_bn_in_head": False,
    "drop_path_rate": 0.1, "clip_grad": 3.0, "freeze_last_layer": 1, "local_crops_number": 8,
    "global_crops_scale": (0.4, 1.0), "local_crops_scale": (0.05, 0.4), "patch_size": 16,
}


def test_dino_in1k_is_dinos_vanilla_vits16_command(make_cfg):
    from train.optim import build_schedules

    cfg = make_cfg("experiment=dino_in1k", "data.root=/nowhere")
    tc, o, ref = cfg.trainer, cfg.optim, DINO_VANILLA_VITS16
    steps_per_epoch = 2502  # 1,281,167 images // 512 (drop_last)
    total = ref["epochs"] * steps_per_epoch
    sched = {**build_schedules(o.schedules, "optim.schedules", total, steps_per_epoch),
             **build_schedules(tc.schedules, "trainer.schedules", total, steps_per_epoch)}
    lr, wd, tt, mom = (sched[k] for k in ("lr", "weight_decay", "teacher_temp", "teacher_momentum"))
    assert tc.epochs == ref["epochs"] and tc.global_batch_size == ref["batch"]
    assert o.lr == pytest.approx(ref["lr"]) and lr(10 * steps_per_epoch) == pytest.approx(ref["lr"], rel=1e-3)
    assert lr(0) == 0.0 and lr(total - 1) == pytest.approx(ref["min_lr"], rel=0.01)
    assert wd(0) == pytest.approx(ref["weight_decay"]) and wd(total - 1) == pytest.approx(ref["weight_decay_end"], rel=1e-3)
    assert tt(0) == tt(30 * steps_per_epoch) == tt(total - 1) == ref["teacher_temp"] == ref["warmup_teacher_temp"]
    assert mom(0) == pytest.approx(ref["momentum_teacher"]) and mom(total - 1) == pytest.approx(1.0, abs=1e-9)
    assert tc.head.norm_last_layer is ref["norm_last_layer"] and tc.head.out_dim == ref["out_dim"]
    assert tc.head.use_bn is ref["use_bn_in_head"] and cfg.model.drop_path_rate == ref["drop_path_rate"]
    assert o.grad_clip == ref["clip_grad"] and o.grad_clip_mode == "param"
    assert tc.freeze_last_layer == ref["freeze_last_layer"]
    mc = tc.multicrop
    assert mc.local_crops == ref["local_crops_number"] and tuple(mc.global_scale) == ref["global_crops_scale"]
    assert tuple(mc.local_scale) == ref["local_crops_scale"] and cfg.data.patch_size == ref["patch_size"]
    assert (tc.head.hidden_dim, tc.head.bottleneck_dim, tc.student_temp, tc.center_momentum) == (2048, 256, 0.1, 0.9)
