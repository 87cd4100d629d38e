"""The paper's first author's timm fork beside ours on the same inputs: a verification, skipped
unless LAPLACE_AUTHOR_FORK names a checkout of the fork (~3 min on 2 CPU cores):

    LAPLACE_AUTHOR_FORK=/path/to/pytorch-image-models python -m pytest -s tests/test_author_fork.py

The checkout (or `git archive`) is github.com/yuchongzhang/pytorch-image-models at e9c80e5
(2026-04-19), whose timm train.py sweep (imagenet_sweep_base_mixed.sh) most likely made the
paper's ImageNet numbers; experiment=deit3_in1k_author claims to be that recipe. The fork's `timm`
(1.0.27.dev0) and ours cannot share a process, so this file, run as a script, imports the fork in
a child process, computes on inputs the tests write and saves what it got; the tests compute the
same with laplace and compare (each prints its figures under -s):

  models      the fork's deit3_{base_qk,base_6L,base_12L}_patch16_192, deit3_small_5L_patch16_224 and
              deit3_large_8L_patch16_192 (norms and LayerScale randomised, so every block matters)
              load as trainer.init_from into laplace.create_model's; logits in eval mode, and in
              train mode with the same seed (the same drop-path draws); the eval crop;
  checkpoint  a last.pth.tar written by the fork's CheckpointSaver (with train.py's args) loads as
              trainer.init_from;
  transforms  the fork's training transform as its train.py builds it from the sweep's flags
              (timm's create_transform, '3a', random interpolation) and its evaluation transform
              against ours, image by image on two real photos;
  mixup+loss  Mixup / CutMix with smoothing 0.1 and BCE on the same batch and NumPy seeds, and the
              prefetcher's uint8 FastCollateMixup the fork's runs used;
  schedule    the fork's per-epoch learning rate (timm's CosineLRScheduler from the sweep's flags)
              against our per-step schedule; optimizer steps per epoch; the peak lr;
  optimizer   AdamW's hyper-parameters and which parameters get no weight decay.

Differences that are deliberate or come from the timm release are bounded, not equal (the recipe
card, configs/reference/deit3_in1k_author.yaml, gives their reasons).
"""
from __future__ import annotations

import importlib.util
import math
import os
import random
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
FORK = os.environ.get("LAPLACE_AUTHOR_FORK")
pytestmark = [pytest.mark.slow, pytest.mark.skipif(
    not FORK, reason="LAPLACE_AUTHOR_FORK=<checkout of yuchongzhang/pytorch-image-models at e9c80e5> runs "
                     "the first author's timm fork beside ours")]

# The flags imagenet_sweep_base_mixed.sh gives timm's train.py (TRAIN_CMD), paths left out.
SWEEP_ARGV = [
    "--seed", "0", "--img-size", "192", "--epochs", "400", "--batch-size", "256",
    "--validation-batch-size", "256", "--grad-accum-steps", "2", "--opt", "adamw",
    "--lr-base", "1e-3", "--lr-base-size", "1024", "--lr-base-scale", "linear",
    "--weight-decay", "0.05", "--sched", "cosine", "--warmup-epochs", "5", "--cooldown-epochs", "0",
    "--min-lr", "1e-6", "--clip-grad", "1.0", "--drop-path", "0.2", "--amp", "--amp-dtype", "bfloat16",
    "--aa", "3a", "--mixup", "0.8", "--cutmix", "1.0", "--smoothing", "0.1", "--color-jitter", "0.3",
    "--bce-loss",
]
WORLD, MICRO, ACCUM, TRAIN_SIZE = 4, 256, 2, 1281167  # the sweep's 4 GPUs; ImageNet-1k train
# (fork model, our zoo name, image size, drop-path rate)
MODELS = [("deit3_base_qk_patch16_192", "vitb_0L", 192, 0.2), ("deit3_base_6L_patch16_192", "vitb_6L", 192, 0.2),
          ("deit3_base_12L_patch16_192", "vitb_12L", 192, 0.2),
          ("deit3_small_5L_patch16_224", "vits_5L", 224, 0.2),
          ("deit3_large_8L_patch16_192", "vitl_8L", 192, 0.45)]
SEEDS = range(12)


# ---- helpers of both sides ----------------------------------------------------------------
def write_inputs(work: Path) -> dict:
    """Two real photographs re-encoded as ImageNet-like JPEGs (500x375, q90) and fixed tensors."""
    from PIL import Image
    from sklearn.datasets import load_sample_image

    paths = []
    for name in ("china.jpg", "flower.jpg"):
        p = work / name
        Image.fromarray(load_sample_image(name)).resize((500, 375), Image.BICUBIC).save(p, quality=90)
        paths.append(str(p))
    g = torch.Generator().manual_seed(0)
    inputs = {"images": paths, "batch": torch.randn(8, 3, 192, 192, generator=g),
              "labels": torch.randint(0, 1000, (8,), generator=g),
              "head": torch.randn(3 * 192 * 192, 1000, generator=g) / 300,
              "uint8": torch.randint(0, 256, (8, 3, 192, 192), generator=g, dtype=torch.uint8)}
    for _, _, size, _ in MODELS:
        inputs[f"x{size}"] = torch.randn(2, 3, size, size, generator=g)
    torch.save(inputs, work / "inputs.pt")
    return inputs


def seed_all(seed: int):
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


@torch.no_grad()
def randomise(model: torch.nn.Module):
    """Norm and LayerScale weights away from their init (LayerScale 1e-6 makes blocks identities)."""
    g = torch.Generator().manual_seed(1)
    for name, p in model.named_parameters():
        if name.endswith("gamma"):
            p.copy_(0.5 + torch.rand(p.shape, generator=g))
        elif "norm" in name:
            p.add_(0.2 * torch.randn(p.shape, generator=g))


def model_outputs(model, x) -> dict:
    model.eval()
    out = {"eval": model(x)}
    model.train()
    torch.manual_seed(1)  # the same drop-path draws on both sides
    out["train"] = model(x)
    return {k: v.detach() for k, v in out.items()}


def apply_tf(tf, paths) -> torch.Tensor:
    from PIL import Image

    outs = []
    for path in paths:
        for seed in SEEDS:
            seed_all(seed)
            with Image.open(path) as img:
                outs.append(tf(img.convert("RGB")))
    return torch.stack(outs)


def mix_and_loss(mixup, criterion, inputs) -> dict:
    xs, ys, losses = [], [], []
    for seed in SEEDS:
        np.random.seed(seed)  # timm's Mixup draws from NumPy's global generator
        x, y = mixup(inputs["batch"].clone(), inputs["labels"].clone())
        xs.append(x)
        ys.append(y)
        losses.append(criterion(x.flatten(1) @ inputs["head"], y))
    return {"x": torch.stack(xs), "y": torch.stack(ys), "loss": torch.stack(losses)}


# ---- the fork's side (this file as a script, in a child process) --------------------------
def fork_side(fork: Path, work: Path):
    sys.path.insert(0, str(fork))  # the fork's timm before ours
    import timm
    from timm.data import FastCollateMixup, Mixup, create_transform, resolve_data_config
    from timm.data.distributed_sampler import ParquetDistributedSampler
    from timm.loss import BinaryCrossEntropy
    from timm.optim import create_optimizer_v2, optimizer_kwargs
    from timm.scheduler import create_scheduler_v2, scheduler_kwargs
    from timm.utils import CheckpointSaver

    assert Path(timm.__file__).is_relative_to(fork), timm.__file__
    spec = importlib.util.spec_from_file_location("fork_train", fork / "train.py")
    fork_train = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(fork_train)
    args = fork_train.parser.parse_args(SWEEP_ARGV)
    args.prefetcher = not args.no_prefetcher
    inputs = torch.load(work / "inputs.pt")
    out = {"timm": timm.__version__}

    # What train.py adds to its args before they are saved in every checkpoint.
    args.device, args.world_size, args.rank, args.local_rank, args.distributed = "cuda:0", WORLD, 0, 0, True
    args.num_classes, args.data_dir = 1000, "/data/imagenet-1k/data"
    for name, _, size, dp in MODELS:
        torch.manual_seed(0)
        m = timm.create_model(name, pretrained=False, drop_path_rate=dp, img_size=size)
        randomise(m)
        torch.save(m.state_dict(), work / f"{name}.pth")  # a timm state dict file
        crop = resolve_data_config(vars(args), model=m)["crop_pct"]
        out[name] = {**model_outputs(m, inputs[f"x{size}"]), "crop_pct": crop}
        if name == "deit3_base_6L_patch16_192":  # a checkpoint as the sweep's runs wrote them
            args.model = name
            CheckpointSaver(m, torch.optim.AdamW(m.parameters()), args=args, checkpoint_dir=str(work),
                            recovery_dir=str(work), max_history=1).save_checkpoint(epoch=0, metric=81.0)
    base = timm.create_model("deit3_base_6L_patch16_192", pretrained=False, drop_path_rate=0.2)
    cfg = resolve_data_config(vars(args), model=base)
    train_tf = create_transform(
        cfg["input_size"], is_training=True, no_aug=args.no_aug, train_crop_mode=args.train_crop_mode,
        scale=args.scale, ratio=args.ratio, hflip=args.hflip, vflip=args.vflip, color_jitter=args.color_jitter,
        color_jitter_prob=args.color_jitter_prob, grayscale_prob=args.grayscale_prob,
        gaussian_blur_prob=args.gaussian_blur_prob, auto_augment=args.aa, interpolation=args.train_interpolation,
        mean=cfg["mean"], std=cfg["std"], re_prob=args.reprob, re_mode=args.remode, re_count=args.recount,
        use_prefetcher=False)
    eval_tf = create_transform(cfg["input_size"], is_training=False, interpolation=cfg["interpolation"],
                               mean=cfg["mean"], std=cfg["std"], crop_pct=cfg["crop_pct"], use_prefetcher=False)
    out["transforms"] = {"train": apply_tf(train_tf, inputs["images"]), "eval": apply_tf(eval_tf, inputs["images"])}

    mixup_args = dict(mixup_alpha=args.mixup, cutmix_alpha=args.cutmix, cutmix_minmax=args.cutmix_minmax,
                      prob=args.mixup_prob, switch_prob=args.mixup_switch_prob, mode=args.mixup_mode,
                      label_smoothing=args.smoothing, num_classes=1000)
    bce = BinaryCrossEntropy(target_threshold=args.bce_target_thresh, sum_classes=args.bce_sum,
                             pos_weight=args.bce_pos_weight)
    out["mixup"] = mix_and_loss(Mixup(**mixup_args), bce, inputs)
    fast = FastCollateMixup(**mixup_args)  # what the prefetcher's loader collates with
    mean = torch.tensor(cfg["mean"]).view(1, 3, 1, 1) * 255
    std = torch.tensor(cfg["std"]).view(1, 3, 1, 1) * 255
    fast_x = []
    for seed in SEEDS:
        np.random.seed(seed)
        x, _ = fast([(img.numpy(), int(y)) for img, y in zip(inputs["uint8"], inputs["labels"])])
        fast_x.append((x.float() - mean) / std)  # PrefetchLoader's normalisation
    out["fast_mixup"] = torch.stack(fast_x)

    # The learning rate train.py computes, and its per-epoch schedule over the run.
    global_batch = args.batch_size * WORLD * args.grad_accum_steps
    args.lr = args.lr_base * global_batch / args.lr_base_size  # --lr-base-scale linear
    opt = create_optimizer_v2(base, **optimizer_kwargs(cfg=args))
    names = {id(p): n for n, p in base.named_parameters()}
    out["optimizer"] = {"class": type(opt).__name__, "defaults": {k: opt.defaults[k] for k in ("lr", "betas", "eps")},
                        "no_decay": sorted(names[id(p)] for g in opt.param_groups if g["weight_decay"] == 0
                                           for p in g["params"])}

    class _Reader:  # what ParquetDistributedSampler reads of the parquet reader
        use_parquet_distributed_sampler, repeats, row_groups, seed = True, 0, [], 0

    class _Data:
        reader = _Reader()

        def __len__(self):
            return TRAIN_SIZE

    per_rank = len(ParquetDistributedSampler(_Data(), batch_size=MICRO, num_replicas=WORLD, rank=0))
    batches = per_rank // MICRO  # create_loader drops the last partial batch in training
    updates = math.ceil(batches / ACCUM)
    sched, epochs = create_scheduler_v2(opt, **scheduler_kwargs(args, decreasing_metric=False),
                                        updates_per_epoch=updates)
    lrs = []
    for epoch in range(epochs):  # train.py: the lr is the scheduler's during the epoch, then step(epoch + 1)
        lrs.append(opt.param_groups[0]["lr"])
        sched.step(epoch + 1)
    out["schedule"] = {"lr": args.lr, "per_epoch": lrs, "epochs": epochs, "updates_per_epoch": updates,
                       "batches_per_rank": batches, "last_update_micro_batches": batches % ACCUM or ACCUM}
    torch.save(out, work / "fork.pt")


# ---- our side: the tests ------------------------------------------------------------------
@pytest.fixture(scope="module")
def fork(tmp_path_factory) -> dict:
    """The fork's results on the inputs (the child process), with `work` and `inputs`."""
    fork = Path(FORK).expanduser().resolve()
    if not (fork / "timm" / "models" / "deit_mixed.py").is_file():
        pytest.fail(f"LAPLACE_AUTHOR_FORK={fork} has no timm/models/deit_mixed.py: give a checkout of "
                    f"yuchongzhang/pytorch-image-models (e9c80e5)")
    work = tmp_path_factory.mktemp("author_fork")
    inputs = write_inputs(work)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # nothing of ours in the child
    subprocess.run([sys.executable, __file__, str(fork), str(work)], check=True, timeout=1800, env=env)
    res = torch.load(work / "fork.pt", weights_only=True)  # plain data: tensors, numbers, strings
    print(f"\nfork timm {res['timm']}; ours: laplace beside timm {__import__('timm').__version__}")
    return {**res, "work": work, "inputs": inputs}


def compose(*overrides):
    from train.recipe import compose_config

    return compose_config(["experiment=deit3_in1k_author", *overrides])


def build(cfg):
    from omegaconf import OmegaConf

    from laplace import create_model

    return create_model(**OmegaConf.to_container(cfg.model, resolve=True))


def init_from(model, path: Path, cfg) -> str:
    """What trainer.init_from does with a file: strict but for the head rules and a resampled grid."""
    from laplace.pretrained import load_pretrained

    return load_pretrained(model, path, cfg.model)


@pytest.mark.parametrize("name,ours,size,dp", MODELS)
def test_models_give_the_forks_logits(fork, name, ours, size, dp):
    cfg = compose(f"model={ours}", f"model.drop_path_rate={dp}", f"data.img_size={size}")
    model = build(cfg)
    print(init_from(model, fork["work"] / f"{name}.pth", cfg))
    got = model_outputs(model, fork["inputs"][f"x{size}"])
    for mode in ("eval", "train"):
        diff = (got[mode] - fork[name][mode]).abs().max().item()
        scale = fork[name][mode].abs().max().item()
        print(f"model {ours} = {name} ({mode}): max |logit diff| {diff:.2e} (logits up to {scale:.2f})")
        assert diff <= 1e-4 * scale
    assert fork[name]["crop_pct"] == cfg.data.eval_crop_pct  # the models' default eval crop, 0.875


def test_the_forks_last_pth_tar_loads_as_init_from(fork):
    name, ours, size, dp = MODELS[1]
    cfg = compose(f"model={ours}", f"model.drop_path_rate={dp}", f"data.img_size={size}")
    model = build(cfg)
    msg = init_from(model, fork["work"] / "last.pth.tar", cfg)
    model.eval()
    diff = (model(fork["inputs"][f"x{size}"]) - fork[name]["eval"]).abs().max().item()
    print(f"the fork's last.pth.tar as trainer.init_from: {msg}; max |logit diff| {diff:.2e}")
    assert diff <= 1e-4


@pytest.mark.parametrize("split", ["train", "eval"])
def test_transforms_equal_pixel_for_pixel(fork, split):
    from laplace.data.vision import build_transform

    tf = build_transform(compose("model=vitb_6L").data, split == "train")
    got, ref = apply_tf(tf, fork["inputs"]["images"]), fork["transforms"][split]
    diff = (got - ref).abs().max().item() if got.shape == ref.shape else float("inf")
    print(f"{split} transform: {len(ref)} images (2 photos x {len(SEEDS)} seeds), max |pixel diff| {diff:.2e}")
    assert got.shape == ref.shape and diff == 0.0


def test_mixup_and_bce(fork):
    from train.deit3 import build_criterion, build_mixup

    tc = compose("model=vitb_6L").trainer
    got = mix_and_loss(build_mixup(tc, 1000), build_criterion(tc, 1000), fork["inputs"])
    ref = fork["mixup"]
    same = [bool(torch.equal(got["x"][i], ref["x"][i]) and torch.allclose(got["y"][i], ref["y"][i]))
            for i in range(len(SEEDS))]
    loss_diff = (got["loss"] - ref["loss"]).abs().max().item()
    print(f"mixup + BCE: {sum(same)}/{len(same)} seeds identical images and targets; max |loss diff| "
          f"{loss_diff:.2e} (losses {ref['loss'].min():.4f}..{ref['loss'].max():.4f})")
    # timm >= 1.0.29 centres the CutMix box with (cut + 1) // 2: one pixel more on odd cuts.
    assert sum(same) >= len(same) // 2 and loss_diff < 1e-3 * ref["loss"].abs().max().item()


def test_mixup_vs_the_prefetchers_uint8_fast_collate(fork):
    from train.deit3 import build_mixup

    cfg = compose("model=vitb_6L")
    mixup, inputs = build_mixup(cfg.trainer, 1000), fork["inputs"]
    mean, std = torch.tensor(cfg.data.mean).view(1, 3, 1, 1), torch.tensor(cfg.data.std).view(1, 3, 1, 1)
    ours = []
    for seed in SEEDS:
        np.random.seed(seed)
        ours.append(mixup((inputs["uint8"].float() / 255 - mean) / std, inputs["labels"].clone())[0])
    diff = (torch.stack(ours) - fork["fast_mixup"]).abs()
    # The fork mixes uint8 pixels (rounded), we mix floats; a CutMix box edge differs as above.
    print(f"mixup vs FastCollateMixup: median |diff| {diff.median():.2e} (one grey level = "
          f"{1 / 255 / min(cfg.data.std):.4f}), max {diff.max():.2e}")
    assert diff.median().item() < 0.01


def test_lr_and_steps_per_epoch(fork):
    from train.optim import build_schedules
    from train.recipe import Recipe

    cfg, fs = compose("model=vitb_6L"), fork["schedule"]
    rec = Recipe(cfg, train_size=TRAIN_SIZE)
    spe, total = rec.steps_per_epoch(), rec.total_steps()
    print(f"peak lr: fork {fs['lr']:g}, ours {cfg.optim.lr:g}; optimizer steps per epoch: fork "
          f"{fs['updates_per_epoch']} ({fs['batches_per_rank']} batches of {MICRO} per GPU, the last update "
          f"{fs['last_update_micro_batches']} of them), ours {spe} whole steps of {cfg.trainer.global_batch_size}")
    assert math.isclose(cfg.optim.lr, fs["lr"]) and abs(spe - fs["updates_per_epoch"]) <= 1
    lr = build_schedules(cfg.optim.schedules, "optim.schedules", total, spe)["lr"]
    ours = np.array([np.mean([lr(e * spe + i) for i in range(0, spe, 25)]) for e in range(fs["epochs"])])
    theirs = np.array(fs["per_epoch"])
    # Deliberate (the card says why): ours is per step with the cosine after the warm-up, the
    # fork's per epoch with the cosine over all epochs; bounded here, not equal.
    dev = np.abs(ours - theirs)[5:].max() / fs["lr"]
    ratio = ours.sum() / theirs.sum()
    warm = lambda lrs: ", ".join(f"{v:.2e}" for v in lrs[:6])  # noqa: E731
    print(f"lr schedule: {fs['epochs']} epochs; epoch means after the warm-up within {100 * dev:.2f}% of the peak "
          f"of the fork's, summed lr {ratio:.4f}x; warm-up epochs 0-5 fork {warm(theirs)}, ours {warm(ours)}; "
          f"last epoch {theirs[-1]:.3e} vs {ours[-1]:.3e}")
    assert fs["epochs"] == cfg.trainer.epochs and dev < 0.02 and abs(ratio - 1) < 0.02


def test_optimizer(fork):
    from train.optim import build_optimizers

    cfg, fo = compose("model=vitb_6L"), fork["optimizer"]
    model = build(cfg)
    opt = build_optimizers(model, cfg.optim)[cfg.optim.name]
    names = {id(p): n for n, p in model.named_parameters()}
    no_decay = sorted(names[id(p)] for g in opt.param_groups if g["weight_decay"] == 0 for p in g["params"])
    print(f"optimizer: {type(opt).__name__} (fork {fo['class']}), betas {opt.defaults['betas']}, eps "
          f"{opt.defaults['eps']}; {len(no_decay)} tensors without weight decay (fork {len(fo['no_decay'])})")
    assert type(opt).__name__ == fo["class"] and no_decay == fo["no_decay"]
    assert tuple(opt.defaults["betas"]) == tuple(fo["defaults"]["betas"])
    assert opt.defaults["eps"] == fo["defaults"]["eps"]


if __name__ == "__main__":  # the child process: python tests/test_author_fork.py <fork> <work>
    fork_side(Path(sys.argv[1]), Path(sys.argv[2]))
