"""One checkpoint format for every trainer, eval and analysis.

A checkpoint is plain data, loadable with `torch.load(weights_only=True)`:

    {"format": "laplace-checkpoint", "version": 2,
     "model": state dict of the network `load_model` rebuilds (no `_orig_mod.` / `module.`
              prefixes): the trained model, or what its trainer exports (DINO: the teacher
              backbone),
     "config": the resolved run config as a plain dict (its `model` node describes "model"),
     "git_rev": the code revision that wrote it,
     # written by the training engine, for exact resume:
     "train_model": state dict of the trained module when it is not "model" itself
              (DINO: student, EMA teacher and the loss centre),
     "optimizer": {name: optimizer state dict},
     "loop": {"step", "feed": the data position, "world_size"},
     "rng": [per-rank RNG states: Python, NumPy, torch's CPU and the rank's own CUDA device]}

Writes go through `laplace.io.atomic_write` (temp file in the same folder, fsync, rename, folder
fsync), so a kill during a save never leaves a broken `last.pt`; the temp file of a killed
writer is removed by the next save. A resume reads memory-mapped (`load_checkpoint(mmap=True)`).
`load_model(path_or_id)` is the one loader: it rebuilds the model from a checkpoint, a run folder,
a folder `python -m laplace.export` wrote (config.json + model.safetensors), a nanochat checkpoint
folder or a Hugging Face Hub id alone, and the evaluations' frozen backbones (laplace.pretrained);
laplace.pretrained.load_pretrained loads weights into a model built otherwise (fine-tuning's init_from).
"""
import argparse
import importlib
import os
import re
import subprocess
from pathlib import Path
from typing import Any, Optional

import torch
import torch.nn as nn
from timm.models import clean_state_dict  # strips DDP's `module.` and torch.compile's `_orig_mod.`
from timm.utils import unwrap_model  # DDP's and torch.compile's wrappers

from .errors import UserError, one_line
from .io import atomic_write

FORMAT = "laplace-checkpoint"
VERSION = 2


class CheckpointError(UserError, ValueError):
    """A file that is not a laplace checkpoint, or is truncated / corrupt."""


def git(*args: str) -> Optional[str]:
    """The output of `git args` in this checkout; None outside one (or without git)."""
    try:
        return subprocess.run(["git", *args], cwd=Path(__file__).resolve().parent, capture_output=True, text=True,
                              timeout=30, check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None


def save_checkpoint(path: str | os.PathLike, *, model: nn.Module, config: dict, **entries) -> Path:
    """Write a checkpoint atomically. Call on one rank only (gather per-rank states first).

    Args:
        path: the file to (over)write.
        model: the network `load_model` must rebuild (wrappers are removed).
        config: the resolved run config as a plain dict (with the `model` node).
        **entries: plain data stored beside it (optimizer: {name: optimizer state dict}; loop,
            rng, ...): state dicts, not objects, which would need weights_only=False to load.
    """
    payload = {"format": FORMAT, "version": VERSION,
               "model": clean_state_dict(unwrap_model(model).state_dict()), "config": config,
               # the code that wrote it, so that a result can be traced to it
               "git_rev": git("rev-parse", "HEAD") or "unknown", **entries}
    # One writer per run directory: a temp file beside `path` is a killed writer's (SIGKILL, node
    # failure), full size, and goes first.
    return atomic_write(path, lambda f: torch.save(payload, f), sole_writer=True)


def resume_candidates(ckpt_dir: str | os.PathLike) -> list[Path]:
    """Checkpoints a run can resume from, best first: last.pt, then step_<N>.pt newest first."""
    ckpt_dir = Path(ckpt_dir)
    # A torn last.pt (a full disk, a kill the atomic write did not cover) falls back to the newest
    # kept step_<N>.pt; a name that is not step_<number>.pt sorts last.
    steps = sorted(ckpt_dir.glob("step_*.pt"),
                   key=lambda p: int(p.stem[5:]) if p.stem[5:].isdigit() else -1, reverse=True)
    return [p for p in [ckpt_dir / "last.pt", *steps] if p.is_file()]


def _read(path: Path, what: str, map_location: Any = "cpu", mmap: bool = False) -> Any:
    """torch.load(weights_only=True) (or safetensors), every failure as one CheckpointError line.
    mmap: the file's tensors stay mapped (see load_checkpoint)."""
    if not path.is_file():
        raise CheckpointError(f"no {what} at {path}")
    try:
        if path.suffix == ".safetensors":
            from safetensors.torch import load_file

            return load_file(str(path), device=str(map_location))
        # timm's train.py saves its argparse Namespace beside the weights (`args`): the one
        # non-tensor class allowed, so the first author's last.pth.tar / model_best.pth.tar load.
        with torch.serialization.safe_globals([argparse.Namespace]):
            try:
                return torch.load(path, map_location=map_location, weights_only=True, mmap=mmap)
            except RuntimeError as e:  # a file torch < 1.6 wrote (no zip archive) cannot be mapped: read it
                if not mmap or "mmap can only be used" not in str(e):
                    raise
                return torch.load(path, map_location=map_location, weights_only=True)
    except Exception as e:  # torch raises many types for truncated / foreign pickles
        raise CheckpointError(f"{path} is not a readable {what} (corrupt, truncated or not "
                              f"saved by laplace / timm): {one_line(e)[:200]}") from None


def _validate(ckpt, path: Path) -> dict:
    if ckpt.get("version", 0) > VERSION:
        raise CheckpointError(f"{path} has checkpoint version {ckpt['version']}, newer than this "
                              f"code ({VERSION}); update laplace")
    if not isinstance(ckpt.get("config"), dict):
        _incomplete(path, "config")
    if not isinstance(ckpt.get("model"), dict):
        _incomplete(path, "model weights")
    return ckpt


def _incomplete(path, part: str):
    raise CheckpointError(f"{path} is a laplace checkpoint without its {part}, so its model cannot be "
                          f"rebuilt; use the run's ckpt/last.pt as the trainer wrote it (or re-save with "
                          f"laplace.checkpoint.save_checkpoint(path, model=..., config=<the run's config>))")


def model_node_of(ckpt: dict, path) -> dict:
    node = ckpt["config"].get("model")
    if not (isinstance(node, dict) and node.get("name")):
        _incomplete(path, "config.model (the model's name and shape)")
    return node


def load_checkpoint(path: str | os.PathLike, map_location: Any = "cpu", mmap: bool = False) -> dict:
    """Read and validate a checkpoint; a foreign or corrupt file raises CheckpointError.

    mmap=True (a resume): the tensors are views of the file mapped into memory, read from disk
    when used (copied to their device); the ranks of a node share those pages in the page
    cache, so the file is read once per node instead of once per rank. Valid as long as nothing
    writes into the file: laplace's saves rename a new file over it (atomic_write), but a
    `torch.save` onto the same path while the tensors live makes reading them a bus error."""
    path = Path(path)
    ckpt = _read(path, "checkpoint", map_location, mmap)
    if not isinstance(ckpt, dict) or ckpt.get("format") != FORMAT:
        raise CheckpointError(f"{path} is not a laplace checkpoint (no format={FORMAT!r} tag); "
                              f"for timm weights use laplace.vit.load_timm_state_dict")
    return _validate(ckpt, path)


def read_weights(path: Path, model_node: Optional[dict] = None) -> dict:
    """model_source's description of a laplace checkpoint file, or of a timm / DeiT weights file
    (.pth, .bin, .safetensors; DeiT's `{"model": ...}` with `gamma_1` / `gamma_2` LayerScale names;
    timm train.py's `{"state_dict": ..., "args": Namespace}` .pth.tar): {kind: "weights", path, sd:
    its state dict, node: `model_node` (its architecture, given), ckpt: None}. What fine-tuning
    (`trainer.init_from`) and the frozen backbones start from (laplace.pretrained)."""
    obj = _read(path, "weights file")
    if isinstance(obj, dict) and obj.get("format") == FORMAT:
        ckpt = _validate(obj, path)
        return {"kind": "checkpoint", "path": path, "node": model_node_of(ckpt, path), "ckpt": ckpt}
    sd = obj
    for key in ("model", "state_dict"):  # DeiT's main.py saves {"model": ..., "optimizer": ...}
        if isinstance(sd, dict) and isinstance(sd.get(key), dict):
            sd = sd[key]
    if not (isinstance(sd, dict) and sd and all(torch.is_tensor(v) for v in sd.values())):
        raise CheckpointError(f"{path} holds no state dict (expected a laplace checkpoint, a "
                              f"timm state dict or DeiT's {{'model': state_dict}})")
    # DeiT's own models name LayerScale `gamma_1`/`gamma_2`; timm (and we) say `ls1.gamma`.
    sd = {k.replace(".gamma_1", ".ls1.gamma").replace(".gamma_2", ".ls2.gamma"): v
          for k, v in clean_state_dict(sd).items()}
    return {"kind": "weights", "path": path, "sd": sd, "node": model_node, "ckpt": None}


# An exported folder (laplace/export.py): Hugging Face's file names, so the Hub and timm find
# the files; config.json's "laplace" node says what it is and rebuilds the model.
EXPORT_FORMAT, EXPORT_VERSION = "laplace-export", 1
EXPORT_CONFIG, EXPORT_WEIGHTS, EXPORT_CARD = "config.json", "model.safetensors", "README.md"
EXPORT_TOKENIZER = "tokenizer.json"  # a trained BPE, copied beside the weights (bytes / gpt2 need no file)


def checkpoint_file(path: str | os.PathLike) -> Path:
    """`path` itself, or a run folder's checkpoint: its ckpt/last.pt, else its newest ckpt/step_<N>.pt."""
    path = Path(path)
    if path.is_dir() and (path / "ckpt").is_dir():
        found = resume_candidates(path / "ckpt")
        if not found:
            raise CheckpointError(f"{path} is a run folder without a checkpoint (ckpt/last.pt or ckpt/step_<N>.pt)")
        return found[0]
    return path


def model_source(path_or_id: str | os.PathLike, revision: Optional[str] = None, cache_dir=None) -> dict:
    """What `load_model` builds, read without building it: {kind, path, node (the zoo model node),
    ckpt (a checkpoint's dict; an export's {config: {model, data}, git_rev, loop: {step}}), export (an
    export's "laplace" node)}; kind is "checkpoint", "export" or "nanochat".

    `path_or_id`: a laplace checkpoint, a run folder (its ckpt/last.pt), a folder `python -m
    laplace.export` wrote, a nanochat checkpoint folder (model_<step>.pt + meta_<step>.json), or a
    Hugging Face Hub id ("org/name", downloaded with huggingface_hub; `revision`, `cache_dir`)."""
    path = Path(path_or_id).expanduser()
    if not path.exists():
        if path.suffix in (".pt", ".pth", ".safetensors"):
            raise CheckpointError(f"no checkpoint at {path}")
        # only what reads as org/name asks the Hub: a missing runs/x is no id to look up
        if not re.fullmatch(r"[\w.-]+/[\w.-]+", str(path_or_id)):
            raise CheckpointError(f"{path_or_id}: no such file or folder, and not a Hugging Face Hub id (org/name)")
        path = _from_hub(path_or_id, revision, cache_dir)
    if path.is_dir() and any(path.glob("model_*.pt")) and any(path.glob("meta_*.json")):
        return {"kind": "nanochat", "path": path}  # built by laplace.nanochat.load
    path = checkpoint_file(path)
    if path.is_dir():
        node = read_export_config(path)
        source = node.get("source") or {}
        ckpt = {"config": {"model": node["model"], "data": node.get("data")}, "git_rev": source.get("git_rev"),
                "loop": {"step": source.get("step")}}
        return {"kind": "export", "path": path, "node": node["model"], "ckpt": ckpt, "export": node}
    ckpt = load_checkpoint(path, mmap=True)  # mapped: the weights are read only when the model is built
    return {"kind": "checkpoint", "path": path, "node": model_node_of(ckpt, path), "ckpt": ckpt}


def load_model(path_or_id: str | os.PathLike | dict, map_location: Any = "cpu", *,
               revision: Optional[str] = None, cache_dir=None, **overrides) -> nn.Module:
    """The one loader: rebuild the model of a checkpoint, a run, an export, a nanochat checkpoint
    folder or a Hub id (see model_source; or what model_source or laplace.pretrained.weights_source
    returned) from it alone, in eval mode on `map_location`. `overrides` change constructor
    arguments (e.g. fused_attn=False for attention maps, drop_path_rate=0.0; a ViT's img_size
    resamples its position embedding, num_classes=0 leaves the head out: see load_weights)."""
    from .zoo import create_model  # late import: zoo imports models, models need no checkpoint

    src = path_or_id if isinstance(path_or_id, dict) else model_source(path_or_id, revision, cache_dir)
    kwargs = {**src.get("node", {}), **overrides}
    if src["kind"] == "nanochat":  # the 2026 GPT's own format (laplace/nanochat.py), imported when one is loaded
        model = importlib.import_module(f"{__package__}.nanochat").load(src["path"], map_location)
    else:
        # a state dict file's own (laplace.pretrained), an export's (read after its checks), a checkpoint's
        sd = src["sd"] if "sd" in src else _export_weights(src["path"], kwargs) if src["kind"] == "export" \
            else src["ckpt"]["model"]
        model = create_model(**kwargs)
        if src["kind"] == "export":
            where = src["path"] / EXPORT_WEIGHTS
            load_weights(model, sd, f"{where} does not match model {kwargs['name']!r} of its {EXPORT_CONFIG}")
            check_finite(model.state_dict(), str(where), "export a finite checkpoint again")  # refused at export too
        else:
            load_weights(model, sd, f"checkpoint={src['path']} does not fit model {kwargs['name']}")
    return model.to(map_location).eval()


HEADS = ("head.", "lm_head.")  # the classifier of a ViT, the output layer of a GPT


def load_weights(model: nn.Module, sd: dict, refusal: str) -> None:
    """Load `sd` strictly into `model`, but for head weights the model lacks (num_classes=0) and
    a ViT's position embedding, resampled (bicubic) to the model's patch grid. A misfit is one
    CheckpointError line, `refusal` (naming the file and model) and torch's reason."""
    from .vit import VisionTransformer, load_timm_state_dict

    own = model.state_dict()
    # a head the model does not have (num_classes=0: a backbone) is left out, every other key strict
    sd = {k: v for k, v in sd.items() if k in own or not k.startswith(HEADS)}
    try:
        if isinstance(model, VisionTransformer):
            load_timm_state_dict(model, sd)
        else:
            model.load_state_dict(sd, strict=True)
    except (RuntimeError, ValueError) as e:
        raise CheckpointError(f"{refusal}: {' '.join(str(e).split())[:300]}") from None


def _from_hub(name: str | os.PathLike, revision: Optional[str], cache_dir) -> Path:
    """The local copy of a Hugging Face Hub id (downloaded, or found in huggingface_hub's cache)."""
    from huggingface_hub import snapshot_download

    try:
        # only an export's own files: a Hub repository may hold more (other formats, logs)
        return Path(snapshot_download(str(name), revision=revision, cache_dir=cache_dir,
                                      allow_patterns=[EXPORT_CONFIG, EXPORT_WEIGHTS, EXPORT_CARD, EXPORT_TOKENIZER]))
    except (OSError, ValueError) as e:  # offline and not cached, not found, no access
        raise CheckpointError(f"{name}: no such local folder, and the Hugging Face Hub did not give "
                              f"it: {one_line(e)[:200]}") from None


def read_export_config(folder: str | os.PathLike) -> dict:
    """The "laplace" node of an exported folder's config.json, validated; a foreign or corrupt
    folder raises CheckpointError."""
    import json

    from .schema import Model, check_config

    folder = Path(folder)
    cfg_path = folder / EXPORT_CONFIG
    if not cfg_path.is_file():
        # export writes only into a folder of its own: the way out names a new one, never this one
        run = folder / "ckpt" / "last.pt"
        source = f"pass checkpoint={run} or export it" if run.is_file() else "write one"
        what = "a run folder" if run.is_file() else f"a folder without {EXPORT_CONFIG}"
        raise CheckpointError(f"{folder} is {what}, not an exported laplace model; {source} with `python -m "
                              f"laplace.export checkpoint={run if run.is_file() else '<run>/ckpt/last.pt'} "
                              f"out=exports/{folder.resolve().name}`")
    try:
        cfg = json.loads(cfg_path.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise CheckpointError(f"{cfg_path} is not readable JSON (corrupt or truncated): {str(e)[:200]}") from None
    node = cfg.get("laplace") if isinstance(cfg, dict) else None
    if not (isinstance(node, dict) and node.get("format") == EXPORT_FORMAT):
        raise CheckpointError(f"{cfg_path} is not a laplace export's (no laplace.format={EXPORT_FORMAT!r}); "
                              f"a timm folder loads with timm.create_model('local-dir:{folder}')")
    if not isinstance(node.get("version"), int) or node["version"] > EXPORT_VERSION:
        raise CheckpointError(f"{cfg_path} has export version {node.get('version')!r}, not one this code "
                              f"reads (<= {EXPORT_VERSION}); update laplace")
    if not (isinstance(node.get("model"), dict) and node["model"].get("name")):
        raise CheckpointError(f"{cfg_path} has no laplace.model node (the model's name and shape), so its "
                              f"model cannot be rebuilt; export the checkpoint again")
    # The tokenizer is the folder's own file or a built-in one: a path would read any file anywhere.
    if node.get("tokenizer", "bytes") not in ("bytes", "gpt2", EXPORT_TOKENIZER):
        raise CheckpointError(f"{cfg_path}: laplace.tokenizer={node['tokenizer']!r}; an export's tokenizer is "
                              f"bytes, gpt2 or {EXPORT_TOKENIZER} (the file in the folder)")
    check_config(node["model"], Model, f"{cfg_path}: laplace.model.")  # reliability: a hand-edited value is one line
    return node


def _export_weights(folder: Path, kwargs: dict) -> dict:
    """The state dict of an export, checked against the model's name and depth first."""
    from safetensors import safe_open
    from safetensors.torch import load_file

    from .zoo import model_defaults

    weights = folder / EXPORT_WEIGHTS
    if not weights.is_file():
        raise CheckpointError(f"{folder} has {EXPORT_CONFIG} but no {EXPORT_WEIGHTS}; copy the whole exported folder")
    try:
        with safe_open(str(weights), "pt") as f:  # the header only: names, dtypes, shapes
            dtypes = {k: f.get_slice(k).get_dtype() for k in f.keys()}
    except Exception as e:  # safetensors' own error for a corrupt or truncated file
        raise CheckpointError(f"{weights} is not a readable safetensors file (corrupt or truncated): "
                              f"{one_line(e)[:200]}") from None
    # The depth against the file before building: a hand-edited depth 4096 would allocate for minutes.
    depth = {**model_defaults(kwargs["name"]), **kwargs}.get("depth")
    layers = len({k.split(".")[1] for k in dtypes if k.startswith("blocks.")})
    if depth != layers:
        raise CheckpointError(f"{folder / EXPORT_CONFIG}: laplace.model.depth={depth} but {EXPORT_WEIGHTS} holds "
                              f"{layers} layers; copy the whole exported folder, or export the checkpoint again")
    # An export is written in float32: another dtype is a converted file, cast silently by loading.
    other = {k: v for k, v in dtypes.items() if v != "F32"}
    if other:
        k = next(iter(other))
        raise CheckpointError(f"{weights}: {k} is {other[k]} (and {len(other) - 1} more tensors not F32); "
                              f"laplace exports are float32: export the checkpoint again")
    # Our models share no tensors, so every name save_model wrote is one of the state dict's.
    return load_file(str(weights))


def check_finite(state_dict: dict, where: str, fix: str) -> None:
    """Refuse a state dict with NaN / inf in a floating tensor, in one line naming it."""
    for name, t in state_dict.items():
        if t.is_floating_point() and not torch.isfinite(t).all():
            raise CheckpointError(f"{where}: {name} holds {int((~torch.isfinite(t)).sum())} NaN / inf value(s) "
                                  f"of {t.numel()}; {fix}")


def run_dir_of(checkpoint: str | os.PathLike) -> Path:
    """The run directory a checkpoint belongs to (`<run>/ckpt/last.pt` -> `<run>`; a loose
    weights file -> its folder): where evaluations of it write, beside the run."""
    p = Path(checkpoint)
    if p.is_dir():  # a run folder, or an export: evaluations of it write into it
        return p
    return p.parent.parent if p.parent.name == "ckpt" else p.parent
