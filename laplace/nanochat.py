"""nanochat checkpoints as our GPT: `laplace.nanochat.load(folder)`, equal logits.

A nanochat checkpoint folder (upstream karpathy/nanochat 92d63d4, or the first author's fork with
Laplacian heads) holds `model_<step>.pt` (a plain state dict) and `meta_<step>.json` (its
`model_config`); the newest step is read unless one is named. Tensors only (weights_only=True).
nanochat's tokenizer.pkl is a pickled tiktoken Encoding: `read_tokenizer` takes its ranks without
running any of its code.
"""
import json
import pickle
import re
from pathlib import Path
from typing import Any, Optional

import tiktoken
import torch

from .errors import UserError
from .gpt import GPT
from .zoo import GPT26, create_model

# The fork's ablation switches (on in upstream's and the fork's default model)
SWITCHES = ("use_ve", "use_resid_lambdas", "use_x0", "use_smear", "use_backout")


def model_node(model_config: dict) -> dict:
    """The zoo node (create_model's arguments) of a nanochat `model_config`."""
    c = model_config
    return dict(GPT26, name="gpt26", vocab_size=c["vocab_size"], max_seq_len=c["sequence_len"],
                depth=c["n_layer"], width=c["n_embd"], num_heads=c["n_head"], num_kv_heads=c["n_kv_head"],
                window_pattern=c.get("window_pattern", "L"),  # before windows: full context
                num_laplacian_heads=c.get("laplacian_heads", 0), **{s: c.get(s, True) for s in SWITCHES})


def our_name(key: str) -> str:
    """A nanochat parameter's name here (c_q, c_k and c_v are rows of one qkv: see load)."""
    key = key.removeprefix("_orig_mod.").replace("transformer.h.", "blocks.").replace("transformer.wte", "wte")
    return key.replace(".attn.c_proj", ".attn.proj")


def load(folder: str | Path, map_location: Any = "cpu", step: Optional[int] = None, **overrides) -> GPT:
    """Our GPT with the weights of the nanochat checkpoint in `folder` (evaluation mode, float32);
    `overrides`: constructor arguments that keep the shapes (e.g. fused_attn=False)."""
    folder = Path(folder)
    steps = sorted(int(m[1]) for p in folder.glob("model_*.pt") if (m := re.fullmatch(r"model_(\d+)\.pt", p.name)))
    if not steps or (step is not None and step not in steps):
        raise UserError(f"{folder}: no nanochat model_{'<step>' if step is None else f'{step:06d}'}.pt there "
                        f"(steps found: {steps}); pass a folder holding model_<step>.pt + meta_<step>.json")
    step = steps[-1] if step is None else step
    meta = json.loads((folder / f"meta_{step:06d}.json").read_text())
    sd = torch.load(folder / f"model_{step:06d}.pt", map_location=map_location, weights_only=True)
    ours = {our_name(k): t.float() for k, t in sd.items()}  # float32 master weights (nanochat's GPUs: bf16 embeddings)
    for i in range(meta["model_config"]["n_layer"]):  # fused qkv: rows [q (H D), k (Hkv D), v (Hkv D)]
        ours[f"blocks.{i}.attn.qkv.weight"] = torch.cat([ours.pop(f"blocks.{i}.attn.c_{n}.weight") for n in "qkv"])
    with torch.device("meta"):  # no init: every tensor comes from the file
        model = create_model(**{**model_node(meta["model_config"]), **overrides})
    try:
        model.load_state_dict(ours, strict=True, assign=True)
    except RuntimeError as e:  # e.g. a checkpoint from before 92d63d4's architecture (no smear, ...)
        raise UserError(f"{folder}: weights do not match the model of its meta_{step:06d}.json "
                        f"({str(e).splitlines()[1].strip()}); nanochat 92d63d4's architecture loads") from None
    return model.eval()


class _EncodingState:
    """Stands in for tiktoken.Encoding while unpickling: keeps its state, runs nothing."""

    def __setstate__(self, state):
        self.state = state


class _Unpickler(pickle.Unpickler):
    def find_class(self, module, name):
        if (module, name) == ("tiktoken.core", "Encoding"):
            return _EncodingState
        raise pickle.UnpicklingError(f"tokenizer.pkl refers to {module}.{name}: not a nanochat tokenizer")


def read_tokenizer(path: str | Path) -> tiktoken.Encoding:
    """nanochat's `tokenizer.pkl` as a tiktoken Encoding, rebuilt from the pickled ranks, pattern and
    specials (no other class is looked up, so no code in the file runs)."""
    with open(path, "rb") as f:
        state = _Unpickler(f).load().state
    return tiktoken.Encoding(**state)
