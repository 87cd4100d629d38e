"""Every trainer trains a step and evaluates on a stand-in CUDA device (tests/fakedevice.py):
a tensor left on the CPU where CUDA needs it on the device fails here as it would on a GPU."""
from __future__ import annotations

import json
import math
import os
import runpy
import subprocess
import sys
from pathlib import Path
from unittest import mock

import fakedata
import pytest
import torch
from hydra import compose, initialize_config_dir
from omegaconf import open_dict

from conftest import CONFIGS, ROOT
from fakedevice import fake_cuda
from train import run

VIT = ["model.depth=1", "model.embed_dim=48", "trainer.num_workers=0", "trainer.progress=false",
       "trainer.log_every=1", "trainer.device=cuda", "trainer.compile=false", "trainer.max_steps=1"]


def test_stand_in_raises_where_cuda_would():
    with fake_cuda():
        x = torch.randn(3, 4).to("cuda")
        assert x.device.type == "cuda" and torch.zeros(2, device=x.device).is_cuda and x[0].is_cuda
        assert (x * torch.tensor(2.0)).is_cuda  # a 0-dim CPU tensor may join a pointwise op
        assert not x.cpu().is_cuda and x.sum().item() == pytest.approx(float(x.cpu().sum()))
        lin = torch.nn.Linear(4, 2).to("cuda")
        lin(x).sum().backward()
        assert lin.weight.is_cuda and lin.weight.grad.is_cuda
        for bad in (lambda: x + torch.ones(4), lambda: torch.stack([x.sum(), torch.tensor(1.0)]),
                    lambda: torch.nn.Linear(4, 2)(x),
                    lambda: torch.multinomial(x.abs()[0], 2, generator=torch.Generator().manual_seed(0))):
            with pytest.raises(RuntimeError, match="same device|device type for generator"):
                bad()
        with pytest.raises(TypeError, match="cuda"):
            x.numpy()
        torch.multinomial(x.abs()[0], 2, generator=torch.Generator(device="cuda").manual_seed(0))


def test_stand_in_counts_host_syncs():
    with fake_cuda() as tags:
        x = torch.randn(3, 4).to("cuda")
        y = (x * 2).sum(0)
        w = torch.nn.Parameter(x.clone())
        w.grad = x.clone()
        assert torch.nn.utils.clip_grad_norm_([w], 1.0).is_cuda  # the norm stays on the device
        torch.randn(3).to("cuda", non_blocking=True)  # host to device: no wait
        assert tags.syncs == []
        y.sum().item(), float(x[0, 0]), bool(x.sum() > 0), x.tolist(), x.cpu(), x[x > 0], x.nonzero()
        torch.cuda.synchronize()
    assert len(tags.syncs) == 8, tags.syncs
    assert all("tests/test_device_placement.py:" in line for line in tags.syncs), tags.syncs


@pytest.fixture(autouse=True)
def float32_matmuls():
    """Each test starts with float32 matmuls in full precision (torch's default) and leaves them so."""
    torch.set_float32_matmul_precision("highest")
    yield
    torch.set_float32_matmul_precision("highest")


def test_a_cuda_device_turns_tf32_on_the_cpu_does_not():
    from train.dist import resolve_device

    assert resolve_device("cpu").type == "cpu" and torch.get_float32_matmul_precision() == "highest"
    with fake_cuda():
        assert resolve_device("auto").type == "cuda"
    assert torch.get_float32_matmul_precision() == "high"


def _run_on_fake_cuda(cfg) -> dict:
    with fake_cuda() as tags:
        metrics = run(cfg)
        assert tags.held, "nothing was placed on the device: the run ignored trainer.device=cuda"
    assert torch.get_float32_matmul_precision() == "high", "training on CUDA without TF32"
    torch.set_float32_matmul_precision("highest")
    return metrics


def test_deit3_step_and_evaluation(make_cfg, tmp_path):
    fakedata.write_cifar(tmp_path / "cifar", "cifar10", n_train=16, n_test=8)
    cfg = make_cfg("experiment=deit3_cifar10", *VIT, "data.img_size=32", "data.patch_size=8",
                   f"data.root={tmp_path / 'cifar'}", "trainer.global_batch_size=8", "trainer.micro_batch_size=8")
    metrics = _run_on_fake_cuda(cfg)
    assert math.isfinite(metrics["val_loss"])


def test_author_imagenet_recipe_step_and_evaluation(make_cfg, tmp_path):
    """experiment=deit3_in1k_author on the device: a QK-norm ViT with Laplacian heads, timm's '3a'
    transform, Mixup with BCE on ImageNet's parquet layout."""
    fakedata.write_imagenet_parquet(tmp_path / "in1k", n_classes=4, per_class=4, size=40)
    cfg = make_cfg("experiment=deit3_in1k_author", "model=vitb_6L", *VIT, "data.img_size=32", "data.patch_size=8",
                   f"data.root={tmp_path / 'in1k'}", f"data.cache_dir={tmp_path / 'cache'}",
                   "trainer.global_batch_size=8", "trainer.micro_batch_size=8")
    assert cfg.model.qk_norm and cfg.data.augment == "timm"
    metrics = _run_on_fake_cuda(cfg)
    assert math.isfinite(metrics["val_loss"])


def test_gpt_step_and_evaluation(make_cfg):
    cfg = make_cfg("experiment=gpt_pydoc", "model=gpt_d2_1L", "data.seq_len=32", "trainer.global_batch_size=8",
                   *VIT[2:], "trainer.eval_every=1")
    metrics = _run_on_fake_cuda(cfg)
    assert math.isfinite(metrics["val_loss"])


@pytest.mark.parametrize("device_augment", [False, True])
def test_dino_step_and_evaluation(make_cfg, tmp_path, device_augment):
    """device_augment: the crops cut, resized and augmented on the device (laplace.data.resample)."""
    cfg = make_cfg("experiment=dino_digits", *VIT, "trainer.global_batch_size=8", "trainer.head.out_dim=64",
                   "trainer.head.hidden_dim=32", "trainer.head.bottleneck_dim=16",
                   "trainer.multicrop.local_crops=2", "data.val_fraction=0.99",
                   f"trainer.multicrop.device_augment={str(device_augment).lower()}")
    _run_on_fake_cuda(cfg)  # asserts that the run placed its tensors on the device
    from train.logger import read_metrics

    losses = [r["loss"] for r in read_metrics(tmp_path / "run") if r.get("split") == "train"]
    assert losses and all(math.isfinite(x) for x in losses)


# ---------------------------------------------------------------- host syncs of the loop

QUIET = ["trainer.max_steps=4", "trainer.log_every=100", "trainer.eval_every=100", "trainer.ckpt_every=100"]


def _syncs_of_steps(train) -> list[list[str]]:
    """train() on the stand-in device; the device-to-host syncs made in each optimizer step
    (from one step's schedules to the next one's: its loop tail included)."""
    from train.engine import Trainer

    starts, set_schedules = [], Trainer._set_schedules
    with fake_cuda() as tags:
        def mark(self, step):
            starts.append(len(tags.syncs))
            return set_schedules(self, step)

        with mock.patch.object(Trainer, "_set_schedules", mark):
            train()
        syncs = list(tags.syncs)
    return [syncs[a:b] for a, b in zip(starts, starts[1:])]


@pytest.mark.parametrize("name", ["deit3", "gpt", "dino", "dino_device_augment", "seg_linear"])
def test_steps_between_log_steps_make_no_host_sync(name, make_cfg, tmp_path, request):
    """Steps 2 and 3 of 4 (no log, evaluation or checkpoint at either) never make the host wait
    for the device (an `.item()`, a `bool()` of a device tensor, a copy to the host, ...): the
    GPU keeps a queue of work. Step 1 may (first-call set-up); step 4 logs."""
    if name == "seg_linear":
        ckpt = request.getfixturevalue("vit_ckpt")
        train = lambda: _cli("eval.segmentation", f"checkpoint={ckpt}", "eval=seg_digits_linear", "iters=4",  # noqa: E731
                             "batch_size=4", "data.n_train=8", "data.n_val=2", "trainer.device=cuda",
                             "trainer.compile=false", f"paths.data_dir={tmp_path / 'data'}", "trainer.progress=false",
                             f"run_dir={tmp_path / 'seg'}", *QUIET)
    else:
        fakedata.write_cifar(tmp_path / "cifar", "cifar10", n_train=16, n_test=8)
        over = {"deit3": ["experiment=deit3_cifar10", *VIT, "data.img_size=32", "data.patch_size=8",
                          f"data.root={tmp_path / 'cifar'}", "trainer.global_batch_size=8"],
                "gpt": ["experiment=gpt_pydoc", "model=gpt_d2_1L", "data.seq_len=32", "optim=muon",
                        "trainer.global_batch_size=8", *VIT[2:]],
                "dino": ["experiment=dino_digits", *VIT, "trainer.global_batch_size=8", *DINO],
                "dino_device_augment": ["experiment=dino_digits", *VIT, "trainer.global_batch_size=8", *DINO,
                                        "trainer.multicrop.device_augment=true"]}[name]
        cfg = make_cfg(*over, *QUIET)
        train = lambda: run(cfg)  # noqa: E731
    steps = _syncs_of_steps(train)
    assert len(steps) == 3, steps
    assert steps[1] == steps[2] == [], steps[1:]


def _cli(module: str, *args: str):
    """`python -m module args` in this process (the same entry point), so it runs on the stand-in;
    one on the device runs float32 matmuls in TF32."""
    torch.set_float32_matmul_precision("highest")
    with mock.patch.object(sys, "argv", [module, *args]):
        try:
            runpy.run_module(module, run_name="__main__", alter_sys=True)
        except SystemExit as e:
            assert not e.code, f"python -m {module} exited with {e.code}"
    if any(a.endswith("device=cuda") for a in args):
        assert torch.get_float32_matmul_precision() == "high", f"python -m {module} on CUDA without TF32"


@pytest.fixture(scope="module")
def vit_ckpt(tmp_path_factory):
    """A tiny ViT trained a step on digits, on the stand-in device (the supervised trainer)."""
    tmp = tmp_path_factory.mktemp("vit")
    with initialize_config_dir(config_dir=CONFIGS, version_base="1.3"):
        cfg = compose("config", overrides=["model=vitt_3L", *VIT, "model.depth=2", "trainer.global_batch_size=8",
                                           f"paths.runs_dir={tmp / 'runs'}"])
    with open_dict(cfg):
        cfg.run_dir = str(tmp / "bb")
    _run_on_fake_cuda(cfg)
    return tmp / "bb/ckpt/last.pt"


@pytest.mark.slow  # ~50 s: four CLIs over the digits' validation split
def test_knn_linear_segmentation_analysis_clis(vit_ckpt, tmp_path):
    run_dir = vit_ckpt.parent.parent
    with fake_cuda():
        _cli("eval.knn", f"checkpoint={vit_ckpt}", "data=digits", "device=cuda", "num_workers=0", "batch_size=256")
        _cli("eval.linear", f"checkpoint={vit_ckpt}", "data=digits", "device=cuda", "epochs=1",
             "lr_grid=[0.01]", "n_last_blocks=1", "num_workers=0", "batch_size=256", "train_batch_size=256")
        _cli("eval.segmentation", f"checkpoint={vit_ckpt}", "eval=seg_digits_linear", "iters=2", "batch_size=4",
             "data.n_train=4", "data.n_val=2", "trainer.eval_every=2", "trainer.device=cuda",
             "trainer.compile=false", f"paths.data_dir={tmp_path / 'data'}", "trainer.progress=false")
        _cli("analysis", f"checkpoint={vit_ckpt}", "device=cuda", "max_tokens=300", "batch_size=8",
             "pca_maps=1", "cpu_threads=1", "progress=false")
    for res in ("eval/knn_digits", "eval/linear_digits", "eval/seg_digits_ade20k_l1"):
        assert (run_dir / res / "results.json").is_file(), res
    assert (vit_ckpt.parent / "last_analysis/analysis.json").is_file()


@pytest.mark.slow  # ~25 s: BPE + shards, a Muon step, an SFT step, sampling and lm-eval requests
def test_gpt_shards_muon_sft_generate_and_lm_eval(make_cfg, tmp_path):
    """BPE -> token shards -> a Muon step -> a chat SFT step (each evaluated) -> eval.generate and
    the lm-eval adapter's three request types, all on the stand-in device."""
    from laplace.data.prepare import prepare
    from lm_eval.api.instance import Instance

    from eval.lm_adapter import LaplaceLM

    with initialize_config_dir(config_dir=CONFIGS, version_base="1.3"):
        prepare(compose("prepare", overrides=["source=pydoc", "vocab_size=512", f"out={tmp_path / 'data'}",
                                              "progress=false"]))
    gpt = ["model=gpt_d2_1L", "data.seq_len=64", "trainer.global_batch_size=4", "trainer.eval_every=1", *VIT[2:]]
    pre, sft = tmp_path / "pre", tmp_path / "sft"
    _run_on_fake_cuda(make_cfg("experiment=gpt_tiny", *gpt, f"data.root={tmp_path / 'data'}", "data.vocab_size=512",
                               "data.val_tokens=1024", run_dir=pre))
    assert make_cfg("experiment=gpt_tiny", *gpt).optim.name == "muon"
    _run_on_fake_cuda(make_cfg("experiment=gpt_tiny_sft", *gpt, f"trainer.init_from={pre / 'ckpt/last.pt'}",
                               run_dir=sft))
    ckpt = str(sft / "ckpt/last.pt")
    with fake_cuda():
        _cli("eval.generate", f"checkpoint={ckpt}", "chat=true", "prompt=What is a class", "max_new_tokens=4",
             "device=cuda")
        torch.set_float32_matmul_precision("highest")
        lm = LaplaceLM(ckpt, device="cuda", batch_size=2)
        assert lm.device.type == "cuda" and torch.get_float32_matmul_precision() == "high"
        req = lambda kind, *a: Instance(request_type=kind, doc={}, arguments=a, idx=0)  # noqa: E731
        lls = lm.loglikelihood([req("loglikelihood", "A class is", " a"), req("loglikelihood", "Lists", " are")])
        rolling = lm.loglikelihood_rolling([req("loglikelihood_rolling", "The for statement")])
        text = lm.generate_until([req("generate_until", "A class is", {"until": ["\n"], "max_gen_toks": 4})])
    assert all(math.isfinite(lp) for lp, _ in lls) and math.isfinite(rolling[0]) and isinstance(text[0], str)


# ---------------------------------------------------------------- collectives under DDP

DDP = ["trainer.num_workers=0", "trainer.progress=false", "trainer.device=cuda", "trainer.compile=false",
       "trainer.max_steps=1", "trainer.eval_every=1", "trainer.log_every=1"]


DINO = ["trainer.head.out_dim=64", "trainer.head.hidden_dim=32", "trainer.head.bottleneck_dim=16",
        "trainer.multicrop.local_crops=2", "data.val_fraction=0.99"]


def _ddp_runs(tmp: Path, out: Path) -> dict[str, list[str]]:
    """label -> config name and overrides, in the order they run (seg_linear reads vit's checkpoint)."""
    fakedata.write_cifar(tmp / "cifar", "cifar10", n_train=16, n_test=8)
    vit = ["model.depth=1", "model.embed_dim=48", "trainer.global_batch_size=8", f"paths.runs_dir={tmp / 'runs'}", *DDP]
    return {
        "deit3": ["config", "experiment=deit3_cifar10", *vit, "data.img_size=32", "data.patch_size=8",
                  f"data.root={tmp / 'cifar'}"],
        "gpt": ["config", "experiment=gpt_pydoc", "model=gpt_d2_1L", "data.seq_len=32", "optim=muon",
                "trainer.global_batch_size=8", f"paths.runs_dir={tmp / 'runs'}", *DDP],
        "vit": ["config", "model=vitt_3L", *vit],
        "dino": ["config", "experiment=dino_digits", *vit, *DINO],
        "seg_linear": ["segmentation", f"checkpoint={out}.vit/ckpt/last.pt", "eval=seg_digits_linear", "iters=1",
                       "batch_size=4", "data.n_train=4", "data.n_val=2", f"paths.data_dir={tmp / 'data'}", *DDP],
    }


RUNS = ["deit3", "gpt", "vit", "dino", "seg_linear"]


@pytest.fixture(scope="module")
def ddp_records(tmp_path_factory) -> dict[int, list[dict]]:
    """Every run of _ddp_runs, one after another in one torchrun of 2 processes (~35 s): rank ->
    the collectives it made."""
    tmp = tmp_path_factory.mktemp("ddp")
    out = tmp / "out"
    lines = "\n".join(" ".join([name, *args]) for name, args in _ddp_runs(tmp, out).items())
    env = dict(os.environ, OMP_NUM_THREADS="1", HYDRA_FULL_ERROR="1", DUMP_AFTER="150")
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                           str(ROOT / "tests/ddp_collectives.py"), str(out), lines],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return {rank: json.loads((tmp / f"out.rank{rank}.json").read_text()) for rank in (0, 1)}


@pytest.mark.slow  # the fixture: ~35 s for all five runs
@pytest.mark.parametrize("name", RUNS)
def test_every_collective_fits_its_backend(name, ddp_records):
    """A trainer's step and evaluation over 2 processes, on the stand-in CUDA device, with a gloo
    group playing NCCL: a tensor all-reduced / gathered / broadcast on the NCCL group must be on
    the device, one on a gloo group on the CPU (NCCL cannot reduce CPU tensors); the engine converts
    the trained module's batch norms to SyncBatchNorm once, on the NCCL group (DINO's head's, the
    segmentation head's; a model without any is unchanged)."""
    for rank, records in ddp_records.items():
        mine = [r for r in records if r["run"] == name]
        tensors = [r for r in mine if r["device"] != "object"]
        assert {r["backend"] for r in tensors} == {"nccl", "gloo"}, (rank, mine)  # the step's and any_rank's
        wrong = [r for r in tensors if r["device"] != {"nccl": "cuda", "gloo": "cpu"}[r["backend"]]]
        assert not wrong, (rank, wrong)
        converted = [r["backend"] for r in mine if r["op"] == "convert_sync_batchnorm"]
        assert converted == ["nccl"], (rank, converted)


@pytest.mark.slow  # ~20 s: torchrun of 2 CPU processes
def test_segmentation_over_gloo_keeps_plain_batch_norm(make_cfg, tmp_path):
    """SyncBatchNorm has no CPU kernels: 2 CPU processes of eval.segmentation train their head."""
    run(make_cfg("model=vitt_3L", "model.depth=1", "model.embed_dim=48", "trainer.num_workers=0",
                 "trainer.progress=false", "trainer.global_batch_size=8", "trainer.max_steps=1",
                 "trainer.eval_every=100", run_dir=tmp_path / "bb"))
    env = dict(os.environ, OMP_NUM_THREADS="1", HYDRA_FULL_ERROR="1")
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                           "-m", "eval.segmentation", f"checkpoint={tmp_path / 'bb/ckpt/last.pt'}",
                           "eval=seg_digits_linear", "iters=1", "batch_size=4", "data.n_train=4", "data.n_val=2",
                           "trainer.eval_every=1", "trainer.device=cpu", f"paths.data_dir={tmp_path / 'data'}",
                           "trainer.progress=false"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "val_mIoU" in proc.stdout
