"""What a resume checks before it restores anything (train/engine.py restores): the newest
readable checkpoint of the run directory, written by a laplace that keeps all training state in
model and optimizers, for the same configuration and the same data. Every refusal is one
CheckpointError line; trainer.resume=force continues on another configuration or data.

A checkpoint written before a config key existed has no value for it: `ADDED_KEYS` declares, for
each key added over time, the value that does what the code did before the key (or ANY: the key
acts on no training step). Such a checkpoint resumes when this run's value is that one, so an
upgrade of laplace is no reason for trainer.resume=force; any other value is a recipe change.

`rng_state` / `set_rng_state`: each rank's random generators, saved in the checkpoint and restored."""
import random
import sys
from fnmatch import fnmatchcase
from pathlib import Path

import numpy as np
import torch

from laplace.checkpoint import CheckpointError, load_checkpoint, resume_candidates
from .config import flatten
from .rundir import EXECUTION_KEYS
from laplace.zoo import UnknownModelError, model_defaults

# Resume does not compare these either: they only act on a fresh run.
_FRESH_ONLY_KEYS = ("trainer.init_from", "trainer.init_head")

ANY = object()  # an added key whose value changes no training step (a label, evaluation, logging)
# Key (fnmatch pattern) -> the value that behaves as the code before the key; newest last.
ADDED_KEYS = {
    "model.laplacian_mode": "fixed",      # every Laplacian head I - P, as the paper, before learned gates
    "data.modality": ANY,                 # 2026-11-29 db68ed3: a label the trainer checks data against
    "optim.grad_clip_mode": "global",     # 2026-11-29 db68ed3: clip_grad_norm_ over all parameters
    "trainer.head.use_bn": False,         # 2026-11-30 b9c5239: DINO's head without BatchNorm
    "data.kind": "windows",               # 2026-11-30 d53e1ea: pydoc_text as in-memory windows
    "trainer.sample_prompts": ANY,        # 2026-11-30 d53e1ea: greedy samples at evaluation, to a file
    "trainer.sample_tokens": ANY,
    "trainer.peak_flops": ANY,            # the denominator of the logged MFU
    "data.masked": True,                  # 2026-12-01 72f5b9a: SFT rows always had the masked loss
    "data.probe_crop_pct": ANY,           # 2026-12-01 5f26102: k-NN / linear probes only
    "*.schedules.*.warmdown": None,       # 2026-12-01 3a574a8: a node without it had no warm-down
    "model.qk_norm": False,               # 2026-12-01 issue 30: the ViT had no QK-norm
    "model.drop_path_schedule": "uniform",  # 2026-12-01 issue 30: the same drop-path rate in every block
    "data.device_augment": False,         # 2026-12-02 issue 33: 3-Augment's colour work in the workers
    "trainer.multicrop.device_augment": False,  # 2026-12-02 issue 33: DINO's crops augmented in the workers
    "model.global_pool": "token",         # 2026-12-02 issue 34: the head read the class token
    "model.attention": "softmax",         # 2026-12-06 issue 57: every head softmax (or Laplacian)
}


def find_checkpoint(ckpt_dir: Path, is_main: bool) -> tuple[Path, dict] | None:
    """The newest readable checkpoint of the run dir (last.pt, else the newest step_N.pt),
    or None for a fresh run. Corrupt or truncated files are skipped with a warning."""
    candidates = resume_candidates(ckpt_dir)
    for path in candidates:
        try:
            return path, load_checkpoint(path, map_location="cpu", mmap=True)  # once per node, not per rank
        except CheckpointError as e:
            if is_main:
                print(f"[laplace] cannot resume from it: {e}", file=sys.stderr)
    if candidates:
        raise CheckpointError(f"no readable checkpoint in {ckpt_dir} ({', '.join(p.name for p in candidates)}); "
                              f"move them away to start this run afresh")
    return None


def check_resumable(path: Path, ckpt: dict, config: dict, data_identity: dict | None, data_root,
                    force: bool, is_main: bool):
    """Refuse a checkpoint this run cannot continue: an older layout, another configuration
    (`config`: this run's, plain) or other data (`data_identity`: this run's), unless forced."""
    rev = ckpt.get("git_rev", "?")[:10]
    if ckpt.get("version", 1) < 2:
        raise CheckpointError(f"{path} was written by an older laplace (checkpoint version 1, revision {rev}): "
                              f"load_model still reads it, but resume it with that revision or start a new run_dir")
    if ckpt.get("trainer"):  # DINO's loss centre, before it became a buffer of the model
        raise CheckpointError(f"{path} keeps trainer state ({', '.join(ckpt['trainer'])}) outside the model "
                              f"(laplace before 2026-12-01): load_model still reads it, but resume it with "
                              f"revision {rev} or start a new run_dir")
    saved = dict(ckpt.get("config") or {})
    if isinstance(saved.get("model"), dict):  # a node of b601d55 or before named the model with its k
        saved["model"] = upgrade_node(saved["model"])
    diffs = config_differences(saved, config)
    if diffs and not force:
        more = f" and {len(diffs) - 3} more" if len(diffs) > 3 else ""
        raise CheckpointError(f"{path} belongs to another configuration ({'; '.join(diffs[:3])}{more}); "
                              f"use another run_dir for a new run, or trainer.resume=force to continue anyway")
    saved, now = ckpt.get("data_identity"), data_identity
    if not saved or not now or saved == now:  # a checkpoint from before the check: trusted
        return
    diffs = ", ".join(f"{k} {saved.get(k)} -> {now.get(k)}" for k in sorted(set(saved) | set(now))
                      if saved.get(k) != now.get(k))
    if not force:
        raise CheckpointError(f"{path} was trained on other data than data.root={data_root} ({diffs}); "
                              f"point data.root / data.tokenizer at that run's data, use another run_dir "
                              f"for a new run, or trainer.resume=force to continue anyway")
    if is_main:
        print(f"[laplace] trainer.resume=force: continuing on other data ({diffs})", file=sys.stderr)


def config_differences(saved: dict, current: dict) -> list[str]:
    """'key: checkpoint value -> this run's value' for every training-relevant difference
    (execution keys such as workers, devices or cadences are not compared; a key the checkpoint
    predates is compared as its ADDED_KEYS value)."""
    a, b = flatten(saved), flatten(current)
    diffs = []
    for k in sorted(set(a) | set(b)):
        if k.startswith(EXECUTION_KEYS + _FRESH_ONLY_KEYS):
            continue
        was, now = a.get(k, "<unset>"), b.get(k, "<unset>")
        declared = [v for pattern, v in ADDED_KEYS.items() if fnmatchcase(k, pattern)]
        if k not in a and k in b and declared:  # a key added after the checkpoint was written
            if declared[0] is ANY or declared[0] == now:
                continue
            was = f"<unset: {declared[0]} before the key>"
        if was != now:
            diffs.append(f"{k}: {was} -> {now}")
    return diffs


def upgrade_node(node: dict) -> dict:
    """A model node as this code writes it. Until b601d55 a node's name held k ("vitb_12L",
    "gpt_d20_5L") beside `num_laplacian_heads`; now it names the family and k is the key alone."""
    try:
        family = model_defaults(node["name"])["name"]
    except UnknownModelError:  # a name outside the zoo: kept
        return node
    return {**node, "name": family}


def rng_state() -> dict:
    """This process's RNG states as plain tensors / tuples (weights_only-safe)."""
    # NumPy's key array as an int64 tensor: weights_only=True loads tensors and plain Python
    # types, never ndarrays (a checkpoint must not need unpickling arbitrary classes)
    np_state = np.random.get_state()
    state = {
        "python": random.getstate(),
        "numpy": {"keys": torch.from_numpy(np_state[1].astype(np.int64)), "pos": int(np_state[2]),
                  "has_gauss": int(np_state[3]), "cached_gaussian": float(np_state[4])},
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        # This process's device only: a resume may see another number of GPUs (one per task
        # under Slurm's --gpus-per-task, all of the node under torchrun).
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict):
    random.setstate(state["python"])
    n = state["numpy"]
    np.random.set_state(("MT19937", n["keys"].numpy().astype(np.uint32), n["pos"],
                         n["has_gauss"], n["cached_gaussian"]))
    torch.set_rng_state(state["torch"])
    cuda = state.get("cuda")
    if isinstance(cuda, (list, tuple)):  # laplace before 2026-12-01: every visible device's state
        i = torch.cuda.current_device() if torch.cuda.is_available() else 0
        cuda = cuda[i] if i < len(cuda) else None
    if cuda is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(cuda)
