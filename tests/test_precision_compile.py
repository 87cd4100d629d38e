"""bf16 autocast and torch.compile on CPU for every trainer family, each a shipped experiment shrunk
by overrides: DeiT-III ImageNet (the first author's recipe: QK-norm), the GPT d20 on token shards with Muon, GPT chat SFT and DINO
ImageNet; a GPU run adds speed, not new code paths. The paper's experiments compile (and use bf16)
by default on CUDA.

bf16: a few steps with trainer.amp=true stay finite and near the fp32 losses (tolerances below
are the measured gaps with margin: docs/LOG.md). Compile: the model's forward has no graph break
(torch._dynamo's counters over a real training run, and fullgraph=True on the Laplacian
projection's custom autograd function and the KV-cache forward the sampler runs), and the
number of compiled graphs over the run is bounded (recompiles from lr schedules, the last
partial batch of an epoch, varying SFT lengths would show here).
"""
from __future__ import annotations

import functools
import math
import os
import subprocess
import sys

import fakedata
import pytest
import torch
from torch._dynamo.utils import counters

from conftest import ROOT
from laplace import create_model
from train import run
from train.logger import read_metrics

STEPS = 3
VIT = ["model=vitt_3L", "model.depth=1", "model.embed_dim=48", "trainer.num_workers=0", "trainer.progress=false",
       "trainer.log_every=1", f"trainer.max_steps={STEPS}", "trainer.device=cpu"]
GPT = ["model=gpt_d2_1L", "trainer.global_batch_size=4", "trainer.num_workers=0",
       "trainer.progress=false", "trainer.log_every=1", f"trainer.max_steps={STEPS}", "trainer.device=cpu",
       "trainer.sample_prompts=[]"]
TINY_IMAGES = ["data.img_size=32", "data.patch_size=8"]
# family -> (the shipped experiment shrunk by overrides, largest relative |bf16 - fp32| loss gap
# allowed, most compiled graphs over the run). Measured gaps over 3 steps: docs/LOG.md.
FAMILIES = {
    # the paper's ImageNet run as its author ran it: QK-norm, timm's '3a', AdamW, Mixup with soft BCE
    "deit3": (["experiment=deit3_in1k_author", *VIT, *TINY_IMAGES, "trainer.global_batch_size=16",
               "trainer.micro_batch_size=8"], 0.005, 4),
    "gpt_muon": (["experiment=gpt_d20", *GPT, "trainer.micro_batch_size=null", "data.seq_len=64",
                  "data.vocab_size=512", "data.val_tokens=1024"], 0.005, 4),
    # SFT rows keep data.seq_len=256: shorter ones cut the assistant turns off (every target masked)
    "gpt_sft": (["experiment=gpt_tiny_sft", *GPT], 0.005, 4),
    "dino": (["experiment=dino_in1k", *VIT, *TINY_IMAGES, "trainer.multicrop.local_size=16",
              "trainer.global_batch_size=8", "trainer.head.out_dim=64", "trainer.head.hidden_dim=32",
              "trainer.head.bottleneck_dim=16", "trainer.multicrop.local_crops=2"], 0.03, 6),
}
# The paper's experiments (and the stages they start from): compiled and in bf16 on CUDA by default.
PAPER = ["deit3_in1k_author", "deit3_in1k", "deit3_in1k_ft224", "deit3_cifar10", "deit3_cifar100", "deit3_cifar10_ft",
         "deit3_cifar100_ft", "dino_in1k", "gpt_d12", "gpt_d20", "gpt_d20_mid"]


@pytest.mark.parametrize("experiment", PAPER)
def test_the_papers_experiments_compile_on_cuda_by_default(experiment, make_cfg):
    from fakedevice import fake_cuda
    from train import get_trainer

    over = [f"experiment={experiment}", "trainer.init_from=pretrained.pt"]  # the _ft ones need one
    cfg = make_cfg(*over, "trainer.device=cuda")
    with fake_cuda():
        trainer = get_trainer(cfg.trainer.name)(cfg)
    assert trainer.compile and trainer.amp, cfg.trainer.compile
    cpu = make_cfg(*over, "trainer.device=cpu")
    assert not get_trainer(cpu.trainer.name)(cpu).compile  # auto: eager where inductor's compile time dominates


@pytest.fixture(scope="module")
def data(tmp_path_factory, pydoc_shards):
    """Per family the data overrides: a fake ImageNet folder, the session's pydoc shards, and a
    one-step shard-pretrained GPT for SFT to start from (the family's own fp32 baseline of training)."""
    root = tmp_path_factory.mktemp("pc_data")
    fakedata.write_imagenet_folder(root / "imagenet", n_classes=4, per_class=10, size=40)
    images = [f"data.root={root / 'imagenet'}"]
    return {"deit3": images, "gpt_muon": [f"data.root={pydoc_shards}"], "dino": images, "gpt_sft": None,
            "root": root, "shards": pydoc_shards}


@pytest.fixture(scope="module")
def sft_init(data, tmp_path_factory):
    from hydra import compose, initialize_config_dir

    from conftest import CONFIGS
    from omegaconf import open_dict

    out = tmp_path_factory.mktemp("pc_pre")
    with initialize_config_dir(config_dir=CONFIGS, version_base="1.3"):
        cfg = compose("config", overrides=[f"paths.runs_dir={out / 'runs'}", "experiment=gpt_tiny", *GPT,
                                           "data.seq_len=64", "data.vocab_size=512", f"data.root={data['shards']}",
                                           "trainer.max_steps=1"])
    with open_dict(cfg):
        cfg.run_dir = str(out / "pre")
    run(cfg)
    return out / "pre/ckpt/last.pt"


def _overrides(family, data, sft_init_path=None):
    over, tol, graphs = FAMILIES[family]
    extra = [f"trainer.init_from={sft_init_path}"] if family == "gpt_sft" else data[family]
    return [*over, *extra], tol, graphs


def _losses(run_dir):
    return [r["loss"] for r in read_metrics(run_dir) if r.get("split") == "train"]


def _init(family, request):
    return request.getfixturevalue("sft_init") if family == "gpt_sft" else None


@pytest.mark.slow
@pytest.mark.parametrize("family", list(FAMILIES))
def test_bf16_losses_are_finite_and_near_fp32(family, data, make_cfg, tmp_path, request):
    over, tol, _ = _overrides(family, data, _init(family, request))
    for amp in ("false", "true"):
        run(make_cfg(*over, f"trainer.amp={amp}", run_dir=tmp_path / amp))
    fp32, bf16 = _losses(tmp_path / "false"), _losses(tmp_path / "true")
    assert len(fp32) == len(bf16) == STEPS and all(math.isfinite(x) for x in bf16)
    gap = max(abs(a - b) / max(abs(a), 1e-3) for a, b in zip(fp32, bf16))
    print(f"{family}: fp32 {fp32} bf16 {bf16} max relative gap {gap:.4f}")
    assert gap < tol, (family, fp32, bf16)
    assert fp32 != bf16  # autocast was really on


# Graph breaks and recompiles are Dynamo's (the backend only turns the captured graphs into
# kernels), so three families count them through AOTAutograd's aot_eager (forward and backward
# traced, seconds) and one family goes through inductor's C++ code generation (minutes on 2 cores).
BACKENDS = {"deit3": "aot_eager", "gpt_muon": "inductor", "gpt_sft": "aot_eager", "dino": "aot_eager"}


@pytest.mark.slow
@pytest.mark.parametrize("family", list(FAMILIES))
def test_compiled_training_has_no_graph_break_and_few_graphs(family, data, make_cfg, tmp_path, request, monkeypatch):
    over, _, most = _overrides(family, data, _init(family, request))
    run(make_cfg(*over, run_dir=tmp_path / "eager"))
    torch._dynamo.reset()
    counters.clear()
    monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend=BACKENDS[family]))
    run(make_cfg(*over, "trainer.compile=true", run_dir=tmp_path / "compiled"))
    breaks = {k: v for k, v in counters["graph_break"].items()}
    graphs = counters["stats"]["unique_graphs"]
    print(f"{family}: graph breaks {sum(breaks.values())} {breaks}; compiled graphs {graphs}")
    assert not breaks, breaks
    assert 1 <= graphs <= most, graphs
    torch.testing.assert_close(torch.tensor(_losses(tmp_path / "compiled")), torch.tensor(_losses(tmp_path / "eager")),
                               rtol=1e-3, atol=1e-4)


@pytest.mark.slow
@pytest.mark.parametrize("name, backend", [("vitt_3L", "aot_eager"), ("gpt_d2_1L", "inductor")])
def test_fullgraph_forward_backward_with_the_laplacian_projection(name, backend):
    """fullgraph=True raises on any graph break: the custom autograd function (the fused path
    with Laplacian heads under grad) compiles inside the model, forward and backward (inductor
    once, on the GPT; the ViT's graph through aot_eager)."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    if name.startswith("gpt"):
        model = create_model(name, vocab_size=64, max_seq_len=16)
        x = torch.randint(0, 64, (2, 16))
        loss_of = lambda m: m(x, targets=x)
    else:
        model = create_model(name, depth=1, embed_dim=48, img_size=16, patch_size=8, num_classes=5)
        x = torch.randn(2, 3, 16, 16)
        loss_of = lambda m: m(x).square().mean()
    compiled = torch.compile(model, fullgraph=True, backend=backend)
    for bf16 in (False, True):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            want = loss_of(model)
            got = loss_of(compiled)
        g_want = torch.autograd.grad(want, list(model.parameters()))
        g_got = torch.autograd.grad(got, list(model.parameters()))
        tol = dict(rtol=2e-2, atol=2e-2) if bf16 else dict(rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(got, want, **tol)
        for a, b in zip(g_got, g_want):
            torch.testing.assert_close(a, b, **tol)


@pytest.mark.slow
def test_fullgraph_kv_cache_forward_matches_eager():
    """The sampler's step (prefill, then one token at a time into a KV cache) compiles without
    a graph break and gives eager's logits."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = create_model("gpt_d2_1L", vocab_size=64, max_seq_len=16).eval()
    step = torch.compile(lambda ids, cache: model(ids, kv_cache=cache), fullgraph=True)
    prompt = torch.randint(0, 64, (1, 5))
    caches = model.new_kv_cache(1, 8), model.new_kv_cache(1, 8)
    with torch.inference_mode():
        ids = prompt
        for _ in range(3):
            want, got = model(ids, kv_cache=caches[0]), step(ids, caches[1])
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
            ids = want[:, -1:].argmax(-1)


@pytest.mark.timeout(900)  # above its torchrun subprocess's 600 s
@pytest.mark.slow
def test_ddp_two_processes_compiled(data, tmp_path):
    """DeiT-III under DDP (gloo, two CPU processes) with torch.compile: trains and its losses
    are finite; DDP's bucketed all-reduce is where dynamo splits graphs (DDPOptimizer)."""
    over, _, _ = _overrides("deit3", data)
    env = dict(os.environ, OMP_NUM_THREADS="1", HYDRA_FULL_ERROR="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "train.py",
           *over, "trainer.micro_batch_size=4", "trainer.compile=true", f"run_dir={tmp_path / 'two'}",
           f"paths.runs_dir={tmp_path / 'runs'}"]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "global batch 16 = 4 x 2 x 2 accum" in proc.stdout
    losses = _losses(tmp_path / "two")
    assert len(losses) == STEPS and all(math.isfinite(x) for x in losses)
