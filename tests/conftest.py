"""Shared fixtures: compose the real Hydra configs (the same files train.py uses)."""
from __future__ import annotations

import math
import os
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from omegaconf import open_dict


ROOT = Path(__file__).resolve().parent.parent
CONFIGS = str(ROOT / "configs")
# Tests marked `cuda` run on this device: scripts/gpu_check.sh sets LAPLACE_TEST_DEVICE=cuda
# (CPU-only CI runs them on the CPU like every other test).
TEST_DEVICE = os.environ.get("LAPLACE_TEST_DEVICE", "cpu")

# A tiny ViT on digits that trains a step in well under a second on CPU.
TINY_VIT = ["model.depth=2", "model.embed_dim=48", "trainer.num_workers=0", "trainer.progress=false",
            "trainer.global_batch_size=32", "trainer.log_every=1"]


@pytest.fixture(autouse=True)
def _torch_threads():
    # scripts/test.sh runs one thread per pytest worker (OMP_NUM_THREADS=1, which the tests'
    # subprocesses inherit): more would only oversubscribe the cores and spin.
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "2")))


@pytest.fixture
def device() -> torch.device:
    """The device of `cuda`-marked tests (LAPLACE_TEST_DEVICE, default cpu)."""
    return torch.device(TEST_DEVICE)


@pytest.fixture(scope="session")
def pydoc_shards(tmp_path_factory):
    """python prepare.py source=pydoc vocab_size=512, into a temp folder: built once
    per session for every test file that trains on shards (treat it as read-only)."""
    from laplace.data.prepare import prepare

    out = tmp_path_factory.mktemp("pydoc_bpe")
    with initialize_config_dir(config_dir=CONFIGS, version_base="1.3"):
        cfg = compose("prepare", overrides=["source=pydoc", "vocab_size=512", f"out={out}", "progress=false"])
    prepare(cfg)
    return out


@pytest.fixture
def make_cfg(tmp_path):
    """make_cfg(*overrides, run_dir=...) -> the composed config, run_dir set under tmp_path
    (trainer.device is LAPLACE_TEST_DEVICE's when that is set)."""

    def _make(*overrides, run_dir=None):
        dev = [f"trainer.device={TEST_DEVICE}"] if TEST_DEVICE != "cpu" else []
        with initialize_config_dir(config_dir=CONFIGS, version_base="1.3"):
            cfg = compose("config", overrides=[f"paths.runs_dir={tmp_path / 'runs'}", *dev, *overrides])
        with open_dict(cfg):
            cfg.run_dir = str(run_dir or tmp_path / "run")
        return cfg

    return _make


def schedule_node(value, warmup=None, start=None, warmdown=None, end=None, shape=None) -> dict:
    """A complete schedule node (train.optim.Schedule.from_config refuses one with a key missing)."""
    return dict(value=value, warmup=warmup, start=start, warmdown=warmdown, end=end, shape=shape)


def randomize_(model: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    """Random non-trivial weights. nanochat zero-inits the output layers and DeiT-III starts
    LayerScale at 1e-6: with those inits blocks are (near) identities and tests prove little."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.copy_(torch.randn(p.shape, generator=g) / math.sqrt(p[0].numel()))
            else:
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g))
    return model


def train_tiny_vit(tmp: Path, name: str = "vitt_1L") -> Path:
    """A 2-step tiny ViT (TINY_VIT: 2 blocks, width 48) trained on digits in-process; its last.pt."""
    from train import run as train_run

    with initialize_config_dir(config_dir=CONFIGS, version_base="1.3"):
        cfg = compose("config", overrides=[f"model={name}", *TINY_VIT, "trainer.max_steps=2",
                                           f"paths.runs_dir={tmp / 'runs'}"])
    with open_dict(cfg):
        cfg.run_dir = str(tmp / name)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # module fixtures run before the per-test thread setting
    try:
        train_run(cfg)
    finally:
        torch.set_num_threads(threads)
    return tmp / name / "ckpt" / "last.pt"


def save_tiny_gpt(path, seq_len: int = 64, name: str = "gpt_d2_1L") -> str:
    """An untrained tiny GPT checkpoint (`name`, bytes) on pydoc_text; out-projections and
    lm_head made non-zero so tokens mix and the unembedding is defined (nanochat's init zeroes them)."""
    from laplace.checkpoint import save_checkpoint
    from train.config import model_node
    from laplace.zoo import create_model

    node = model_node(name)
    node.update(vocab_size=257, max_seq_len=seq_len)
    torch.manual_seed(0)
    model = create_model(**node)
    for p in [model.lm_head.weight] + [w for b in model.blocks for w in (b.attn.proj.weight, b.mlp.c_proj.weight)]:
        torch.nn.init.normal_(p, std=0.05)
    cfg = {"model": node, "data": {"name": "pydoc_text", "vocab_size": 257, "seq_len": seq_len}}
    return str(save_checkpoint(path, model=model, config=cfg))


def per_sequence_spectra(features, seq_ids, thresholds: tuple = (0.9, 0.99)) -> dict:
    """n_pcs_<t> and effective_rank of each sequence's own centred tokens (analysis.metrics.spectral_decay
    of one sequence at a time; sequences may differ in length), averaged over the sequences that vary;
    n_sequences (averaged) and n_no_variance (left out: their tokens are all equal). The direct
    reference of analysis.metrics.SequenceSpectra (streamed, batched)."""
    from analysis.formulas import as_float64, as_index
    from analysis.metrics import spectral_decay

    x = as_float64(features)
    sid = as_index(seq_ids, x.device)
    if sid.numel() != x.shape[0]:
        raise ValueError(f"{x.shape[0]} feature rows but {sid.numel()} seq_ids")
    keys = [f"n_pcs_{t:g}" for t in thresholds] + ["effective_rank"]
    # one spectrum per sequence; a sequence of identical tokens has none (NaN) and is counted apart
    each = [spectral_decay(x[sid == s], thresholds) for s in torch.unique(sid)]
    varied = [one for one in each if not math.isnan(one["effective_rank"])]
    out = {k: math.fsum(one[k] for one in varied) / len(varied) if varied else float("nan") for k in keys}
    return {**out, "n_sequences": float(len(varied)), "n_no_variance": float(len(each) - len(varied))}
